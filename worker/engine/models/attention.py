"""Causal self-attention that hands QK-Clip and telemetry its exact per-head max logits."""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from optim import QKClipTarget, fused_qkv_blocks, fused_qkv_targets

from ..facts import MAX_LOGIT_BLOCK

# On CUDA the output comes from fused attention (no [T, T] matrix is kept); the exact maxima are
# then recomputed under no_grad, one block of query rows at a time: one extra causal Q K^T product
# per layer (attention's forward is two such products, Q K^T and P V), 16-bit q and k multiplied
# into fp32 on tensor cores, and at most B * H * MAX_LOGIT_BLOCK * T extra floats of memory.


class MaxLogitRecord:
    """Each head's maximum logit over the training forwards since the last reset (the S_max of
    QK-Clip and of the ``attn_max_logit`` telemetry), recorded while ``record_max_logits`` is on;
    the reads of :class:`optim.QKClipSource`."""

    record_max_logits: bool = True
    _max_logits: Tensor | None = None

    def remember(self, per_head: Tensor) -> None:
        per_head = per_head.float()
        self._max_logits = per_head if self._max_logits is None else torch.maximum(self._max_logits, per_head)

    def qk_max_logits(self) -> Tensor | None:
        return self._max_logits

    def reset_qk_max_logits(self) -> None:
        self._max_logits = None


class CausalSelfAttention(MaxLogitRecord, nn.Module):
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

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)  # 3 x [B, T, C]
        q, k, v = (t.view(B, T, self.n_head, self.head_dim).transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]
        record = self.training and self.record_max_logits
        if x.is_cuda:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            if record:
                self.remember(causal_max_logits(q.detach(), k.detach()))
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))  # [B, H, T, T]
            mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            att = att.masked_fill(~mask, float("-inf"))
            if record:
                self.remember(att.detach().amax(dim=(0, 2, 3)))
            y = F.softmax(att, dim=-1) @ v  # [B, H, T, D]
        y = y.transpose(1, 2).reshape(B, T, C)  # [B, T, C]
        return self.proj(y)

    def qk_clip_targets(self) -> list[QKClipTarget]:
        return fused_qkv_targets(self.qkv.weight, self.n_head, self.head_dim)

    def head_blocks(self) -> dict[Tensor, tuple[int, ...]]:
        return {self.qkv.weight: fused_qkv_blocks(self.n_head, self.head_dim)}


@torch.no_grad()
def causal_max_logits(q: Tensor, k: Tensor, block: int = MAX_LOGIT_BLOCK, scale: float | None = None) -> Tensor:
    """Per-head max of q.k x scale (default 1 / sqrt(d)) over batch and causal pairs, in query
    blocks. q, k: [B, H, T, D] -> [H].

    Each block of query rows reads the keys before it (all visible: no mask) and its own square
    of keys (the strict upper triangle masked). Every product is exact before its fp32
    accumulation, and the scale multiplies the per-head maxima, not the logits: rounding is
    monotone, so that is the same number, with two passes over each score block fewer.
    """
    B, H, T, D = q.shape
    q3, k3 = _exact_operands(q.reshape(B * H, T, D), k.reshape(B * H, T, D))  # one copy each, at most
    above = torch.ones(block, block, dtype=torch.bool, device=q.device).triu(1)
    maxima = []
    with torch.autocast(q.device.type, enabled=False):
        for start in range(0, T, block):
            stop = min(start + block, T)
            rows = q3[:, start:stop]  # [B*H, b, D]
            if start:
                maxima.append(_fp32_logits(rows, k3[:, :start]).view(B, H, -1).amax(dim=(0, 2)))
            own = _fp32_logits(rows, k3[:, start:stop])  # [B*H, b, b]
            own.masked_fill_(above[: stop - start, : stop - start], float("-inf"))
            maxima.append(own.view(B, H, -1).amax(dim=(0, 2)))
    return torch.stack(maxima).amax(dim=0) * (1.0 / math.sqrt(D) if scale is None else scale)


@torch.no_grad()
def masked_max_logits(q: Tensor, k: Tensor, allowed: Tensor, scale: float, block: int = MAX_LOGIT_BLOCK) -> Tensor:
    """Per-head max of q.k x scale over the (query, key) pairs a boolean mask allows, in query blocks.

    q [B, H, T, D], k [B, H, S, D], allowed [B or 1, H or 1, T, S] (True: the query attends to the
    key; a sliding window's band) -> [H]. A head with no allowed pair reads -inf.
    """
    B, H, T, D = q.shape
    q, k = _exact_operands(q, k)
    maxima = []
    with torch.autocast(q.device.type, enabled=False):
        for start in range(0, T, block):
            rows = slice(start, min(start + block, T))
            logits = _fp32_logits(q[:, :, rows].reshape(B * H, -1, D), k.reshape(B * H, -1, D))  # [B*H, b, S]
            logits = logits.view(B, H, *logits.shape[1:]).masked_fill(~allowed[:, :, rows], float("-inf"))
            maxima.append(logits.amax(dim=(0, 2, 3)))
    return torch.stack(maxima).amax(dim=0) * scale


def _exact_operands(q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
    """q and k as the products take them, so that each logit is exact.

    A bf16 (or fp16) product *output* rounds each logit to 8 (11) bits, up to 0.25 off at 100, and
    QK-Clip would leave heads above tau; the products of their *inputs* are exact in fp32. So on
    CUDA 16-bit q and k stay 16-bit and the product accumulates and returns fp32 (tensor cores,
    ``bmm(..., out_dtype=float32)``); elsewhere, or where that product is missing, they are upcast
    to fp32 once.
    """
    if q.dtype in (torch.bfloat16, torch.float16) and _fp32_out_products(q.device, q.dtype):
        return q, k
    return q.float(), k.float()


def _fp32_logits(q: Tensor, k: Tensor) -> Tensor:
    """[N, b, D] x [N, n, D] -> [N, b, n] in fp32 (see _exact_operands)."""
    if q.dtype == torch.float32:
        return torch.bmm(q, k.mT)
    return torch.bmm(q, k.mT, out_dtype=torch.float32)


@functools.cache
def _fp32_out_products(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this device multiplies 16-bit matrices into fp32 (CUDA in recent PyTorch; not CPU)."""
    if device.type != "cuda":
        return False
    try:
        a = torch.ones(1, 2, 2, dtype=dtype, device=device)
        return torch.bmm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError, NotImplementedError):
        return False
