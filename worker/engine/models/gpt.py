"""The decoder language models gpt and moe, built from a ModelConfig.

gpt is a pre-norm decoder (learned positions, LayerNorm, GELU); moe is a gpt whose feed-forward
layers are mixtures of experts.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import ModelConfig
from .attention import CausalSelfAttention
from .base import AttentionLayer, LanguageModel
from .moe import MoEFeedForward


class FeedForward(nn.Module):
    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(d_model, hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    """x + attn(ln(x)), then x + ffn(ln(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hidden = cfg.mlp_ratio * cfg.d_model
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg.d_model, cfg.n_head)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        if cfg.arch == "moe":
            if cfg.n_experts is None or cfg.top_k is None:
                raise ValueError("a moe model needs n_experts and top_k")
            self.ffn: nn.Module = MoEFeedForward(cfg.d_model, cfg.n_experts, cfg.top_k, hidden)
        else:
            self.ffn = FeedForward(cfg.d_model, hidden)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.ffn(self.ln_2(x))


class GPT(LanguageModel):
    """Token + learned position embeddings, pre-norm blocks, final norm, head tied to the embedding."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        init_weights(self, cfg.n_layer)

    def forward(self, idx: Tensor) -> Tensor:
        """idx [B, T] token ids -> logits [B, T, vocab]."""
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))  # [B, T, C]
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    def attention_layers(self) -> list[AttentionLayer]:
        return [b.attn for b in self.blocks if isinstance(b.attn, CausalSelfAttention)]

    def moe_layers(self) -> list[MoEFeedForward]:
        return [b.ffn for b in self.blocks if isinstance(b.ffn, MoEFeedForward)]

    def aux_loss(self) -> Tensor | None:
        """Mean load-balancing loss over the MoE layers of the latest forward (None for gpt)."""
        losses = [m.aux_loss for m in self.moe_layers() if m.aux_loss is not None]
        return torch.stack(losses).mean() if losses else None


def init_weights(model: nn.Module, n_layer: int) -> None:
    """GPT-2 initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2 n_layer)."""
    for name, p in model.named_parameters():
        if p.ndim >= 2 and "router" not in name:
            std = 0.02 / math.sqrt(2 * n_layer) if name.endswith(("proj.weight", "down.weight")) else 0.02
            nn.init.normal_(p, mean=0.0, std=std)


ARCHITECTURES = {"gpt": GPT, "moe": GPT}  # moe: MoE feed-forward layers (n_experts, top_k)
