"""Causal self-attention that hands QK-Clip and telemetry its exact per-head max logits."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from optim import QKClipTarget, fused_qkv_targets

# On CUDA the output comes from fused attention (no [T, T] matrix is kept); the exact maxima are
# then recomputed under no_grad, one block of query rows at a time: one extra Q K^T product
# per layer (attention's forward is two such products, Q K^T and P V), taken in fp32, and at
# most B * H * MAX_LOGIT_BLOCK * T extra floats of memory (plus fp32 copies of bf16 q and k).
MAX_LOGIT_BLOCK = 256


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused [Q | K | V] projection.

    While training (and while ``record_max_logits`` is on) it keeps, per head, the signed
    maximum of q.k / sqrt(d_head) over every batch element and causal (query, key) pair of the
    forward passes since the last reset: the S_max of QK-Clip (Kimi K2) and of the
    ``attn_max_logit`` telemetry. It implements :class:`optim.QKClipSource`.
    """

    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.n_head, self.head_dim = n_head, d_model // n_head
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)
        self.record_max_logits = True
        self._max_logits: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)  # 3 x [B, T, C]
        q, k, v = (t.view(B, T, self.n_head, self.head_dim).transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]
        record = self.training and self.record_max_logits
        if x.is_cuda:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            if record:
                self._remember(causal_max_logits(q.detach(), k.detach()))
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))  # [B, H, T, T]
            mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            att = att.masked_fill(~mask, float("-inf"))
            if record:
                self._remember(att.detach().amax(dim=(0, 2, 3)))
            y = F.softmax(att, dim=-1) @ v  # [B, H, T, D]
        y = y.transpose(1, 2).reshape(B, T, C)  # [B, T, C]
        return self.proj(y)

    def _remember(self, per_head: Tensor) -> None:
        per_head = per_head.float()
        self._max_logits = per_head if self._max_logits is None else torch.maximum(self._max_logits, per_head)

    # optim.QKClipSource
    def qk_max_logits(self) -> Tensor | None:
        return self._max_logits

    def reset_qk_max_logits(self) -> None:
        self._max_logits = None

    def qk_clip_targets(self) -> list[QKClipTarget]:
        return fused_qkv_targets(self.qkv.weight, self.n_head, self.head_dim)


@torch.no_grad()
def causal_max_logits(q: Tensor, k: Tensor, block: int = MAX_LOGIT_BLOCK) -> Tensor:
    """Per-head max of q.k / sqrt(d) over batch and causal pairs, in query blocks. q, k: [B, H, T, D] -> [H]."""
    T, scale = q.shape[2], 1.0 / math.sqrt(q.shape[-1])
    best = torch.full((q.shape[1],), float("-inf"), device=q.device)
    # A bf16 product rounds each logit to 8 bits (up to 0.25 off at 100), so S_max would miss tau:
    # the product runs in fp32, outside autocast, on bf16 q and k as the fused kernel sees them.
    q, k = q.float(), k.float()
    with torch.autocast(q.device.type, enabled=False):
        for start in range(0, T, block):
            stop = min(start + block, T)
            s = (q[:, :, start:stop] @ k[:, :, :stop].transpose(-2, -1)) * scale  # [B, H, b, stop]
            rows = torch.arange(start, stop, device=q.device).view(-1, 1)
            s = s.masked_fill(torch.arange(stop, device=q.device).view(1, -1) > rows, float("-inf"))
            best = torch.maximum(best, s.amax(dim=(0, 2, 3)))
    return best
