"""Test-support models for the optimizer core: attention in every QK-Clip layout, a tiny GPT, byte data.

Attention is written out explicitly (no fused SDPA) so that every forward records the exact
per-head signed max of q.k * softmax_scale over the batch and the causal (i, j) pairs: the
S_max of QK-Clip. The modules implement :class:`optim.QKClipSource`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import optim
from worker.engine.data import pysource_text

LAYOUTS = ("separate", "fused", "gqa", "mla")


def rope(x: Tensor, base: float = 10000.0) -> Tensor:
    """Rotary position embedding on the last dim of x [..., T, r] (r even), positions 0..T-1.

    Pairs (x[i], x[i + r/2]) are rotated by pos * base^(-2i/r): a linear map per position.
    """
    T, r = x.shape[-2], x.shape[-1]
    half = r // 2
    inv_freq = base ** (-torch.arange(half, dtype=torch.float32, device=x.device) * 2.0 / r)
    angles = torch.arange(T, dtype=torch.float32, device=x.device)[:, None] * inv_freq[None, :]  # [T, half]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class CausalSelfAttention(nn.Module):
    """Causal multi-head self-attention in one of four weight layouts.

    * ``separate``: W_q, W_k, W_v (Linear, no bias), each [n_head * head_dim, d_model].
    * ``fused``: one W_qkv [3 * n_head * head_dim, d_model] laid out [Q heads | K heads | V heads].
    * ``gqa``: separate W_q [n_head * d, d_model], W_k and W_v [n_kv_head * d, d_model]; query head h
      uses key/value head h // (n_head / n_kv_head).
    * ``mla``: DeepSeek-V3 latent attention. q_down [q_rank, d_model] -> q_up
      [n_head * (nope + rope), q_rank] (per head: q^C rows then q^R rows); kv_down [kv_rank, d_model]
      -> kv_up [n_head * (nope + v), kv_rank] (per head: k^C rows then v rows); one rotary key k^R
      shared by all heads from k_rope [rope, d_model]. RoPE on q^R and k^R;
      softmax_scale = 1 / sqrt(nope + rope).
    """

    def __init__(
        self,
        d_model: int,
        n_head: int,
        layout: str = "fused",
        n_kv_head: int | None = None,
        q_rank: int = 24,
        kv_rank: int = 16,
        qk_nope_dim: int = 8,
        qk_rope_dim: int = 4,
        v_head_dim: int = 8,
    ) -> None:
        super().__init__()
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if d_model % n_head:
            raise ValueError("d_model must be a multiple of n_head")
        self.layout, self.d_model, self.n_head = layout, d_model, n_head
        self.head_dim = d_model // n_head
        self.n_kv_head = n_head if n_kv_head is None else n_kv_head
        if layout == "gqa" and (self.n_kv_head >= n_head or n_head % self.n_kv_head):
            raise ValueError("gqa needs n_kv_head < n_head dividing it")
        if layout != "gqa" and self.n_kv_head != n_head:
            raise ValueError(f"n_kv_head applies to the gqa layout only, not {layout!r}")
        d = self.head_dim
        if layout == "separate":
            self.W_q = nn.Linear(d_model, n_head * d, bias=False)
            self.W_k = nn.Linear(d_model, n_head * d, bias=False)
            self.W_v = nn.Linear(d_model, n_head * d, bias=False)
            out_in = n_head * d
        elif layout == "fused":
            self.qkv = nn.Linear(d_model, 3 * n_head * d, bias=False)
            out_in = n_head * d
        elif layout == "gqa":
            self.W_q = nn.Linear(d_model, n_head * d, bias=False)
            self.W_k = nn.Linear(d_model, self.n_kv_head * d, bias=False)
            self.W_v = nn.Linear(d_model, self.n_kv_head * d, bias=False)
            out_in = n_head * d
        else:  # mla
            if qk_rope_dim % 2:
                raise ValueError("qk_rope_dim must be even")
            self.nope, self.rope_dim, self.v_dim = qk_nope_dim, qk_rope_dim, v_head_dim
            self.q_down = nn.Linear(d_model, q_rank, bias=False)
            self.q_up = nn.Linear(q_rank, n_head * (qk_nope_dim + qk_rope_dim), bias=False)
            self.kv_down = nn.Linear(d_model, kv_rank, bias=False)
            self.kv_up = nn.Linear(kv_rank, n_head * (qk_nope_dim + v_head_dim), bias=False)
            self.k_rope = nn.Linear(d_model, qk_rope_dim, bias=False)
            out_in = n_head * v_head_dim
        self.proj = nn.Linear(out_in, d_model, bias=False)
        self.softmax_scale = 1.0 / math.sqrt(qk_nope_dim + qk_rope_dim if layout == "mla" else d)
        self.record_max_logits = True
        self._max_logits: Tensor | None = None

    def logits(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(q.k * softmax_scale [B, H, T, T], unmasked; values [B, H, T, Dv])."""
        B, T, _ = x.shape
        H, d = self.n_head, self.head_dim
        if self.layout == "mla":
            q = self.q_up(self.q_down(x)).view(B, T, H, self.nope + self.rope_dim).transpose(1, 2)  # [B, H, T, n+r]
            kv = self.kv_up(self.kv_down(x)).view(B, T, H, self.nope + self.v_dim).transpose(1, 2)
            q_c, q_r = q[..., : self.nope], rope(q[..., self.nope :])
            k_c, v = kv[..., : self.nope], kv[..., self.nope :]
            k_r = rope(self.k_rope(x)).unsqueeze(1)  # [B, 1, T, r], shared by every head
            att = q_c @ k_c.transpose(-2, -1) + q_r @ k_r.transpose(-2, -1)
            return att * self.softmax_scale, v
        if self.layout == "fused":
            q, k, v = self.qkv(x).split(H * d, dim=2)
        else:
            q, k, v = self.W_q(x), self.W_k(x), self.W_v(x)
        q = q.view(B, T, H, d).transpose(1, 2)
        k = k.view(B, T, self.n_kv_head, d).transpose(1, 2)
        v = v.view(B, T, self.n_kv_head, d).transpose(1, 2)
        if self.n_kv_head != H:  # each key/value head serves a group of consecutive query heads
            k = k.repeat_interleave(H // self.n_kv_head, dim=1)
            v = v.repeat_interleave(H // self.n_kv_head, dim=1)
        return (q @ k.transpose(-2, -1)) * self.softmax_scale, v

    def forward(self, x: Tensor) -> Tensor:
        B, T, _ = x.shape
        att, v = self.logits(x)
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~causal, float("-inf"))
        if self.record_max_logits:
            self.record(att.detach().amax(dim=(0, 2, 3)))
        y = F.softmax(att, dim=-1) @ v  # [B, H, T, Dv]
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))

    def record(self, per_head: Tensor) -> None:
        """Fold per-head maxima [n_head] into the running max (also how tests plant maxima)."""
        per_head = per_head.detach().float()
        self._max_logits = per_head if self._max_logits is None else torch.maximum(self._max_logits, per_head)

    # ---- optim.QKClipSource ----
    def qk_max_logits(self) -> Tensor | None:
        return self._max_logits

    def reset_qk_max_logits(self) -> None:
        self._max_logits = None

    def qk_clip_targets(self) -> list[optim.QKClipTarget]:
        if self.layout == "fused":
            return optim.fused_qkv_targets(self.qkv.weight, self.n_head, self.head_dim)
        if self.layout == "mla":
            return optim.mla_targets(
                self.q_up.weight, self.kv_up.weight, self.n_head, self.nope, self.rope_dim, self.v_dim
            )
        return optim.separate_qk_targets(
            self.W_q.weight, self.W_k.weight, self.n_head, self.head_dim, n_kv_head=self.n_kv_head
        )


class Block(nn.Module):
    def __init__(self, d_model: int, n_head: int, layout: str) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, layout)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model, bias=False)
        self.fc_proj = nn.Linear(4 * d_model, d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.fc_proj(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """Token + position embeddings, pre-norm blocks, final LayerNorm, lm_head tied to the embedding."""

    def __init__(self, vocab: int, n_layer: int, n_head: int, d_model: int, seq_len: int, layout: str = "fused"):
        super().__init__()
        self.seq_len = seq_len
        self.wte = nn.Embedding(vocab, d_model)
        self.wpe = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head, layout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
        for block in self.blocks:  # GPT-2: residual projections scaled down with depth
            nn.init.normal_(block.attn.proj.weight, std=0.02 / math.sqrt(2 * n_layer))
            nn.init.normal_(block.fc_proj.weight, std=0.02 / math.sqrt(2 * n_layer))

    def attention(self) -> list[CausalSelfAttention]:
        return [block.attn for block in self.blocks]

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        T = idx.shape[1]
        if T > self.seq_len:
            raise ValueError(f"sequence of {T} tokens is longer than seq_len {self.seq_len}")
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


class CharData:
    """The builtin pysource text as bytes (vocab 256): 90/10 train/val split, seeded random batches."""

    vocab = 256

    def __init__(self, seq_len: int) -> None:
        data = torch.frombuffer(bytearray(pysource_text().encode()), dtype=torch.uint8).long()
        n_train = int(0.9 * len(data))
        self.splits = {"train": data[:n_train], "val": data[n_train:]}
        self.seq_len = seq_len

    def batch(self, split: str, batch_size: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """(inputs, next-byte targets), each [batch_size, seq_len], starts drawn from ``generator``."""
        data = self.splits[split]
        starts = torch.randint(0, len(data) - self.seq_len - 1, (batch_size,), generator=generator)
        offsets = torch.arange(self.seq_len + 1)
        chunk = data[starts[:, None] + offsets[None, :]]  # [B, T + 1]
        return chunk[:, :-1], chunk[:, 1:]

    def batches(self, split: str, n: int, batch_size: int, seed: int) -> list[tuple[Tensor, Tensor]]:
        g = torch.Generator().manual_seed(seed)
        return [self.batch(split, batch_size, g) for _ in range(n)]
