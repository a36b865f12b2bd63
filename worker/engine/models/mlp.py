"""The mlp baseline: an attention-free language model over a fixed context window (Bengio et al. 2003)."""

from __future__ import annotations

import itertools

import torch.nn.functional as F
from torch import Tensor, nn

from ..config import ModelConfig
from ..facts import MLP_CONTEXT  # each token is predicted from this many before it
from .base import LanguageModel
from .gpt import init_weights


class MLPLanguageModel(LanguageModel):
    """Predicts each token from the embeddings of the MLP_CONTEXT tokens before it (zero-padded)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.context = min(MLP_CONTEXT, cfg.seq_len)
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        width = cfg.mlp_ratio * cfg.d_model
        dims = [self.context * cfg.d_model] + [width] * cfg.n_layer
        self.hidden = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(dims))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, cfg.vocab_size, bias=False)
        init_weights(self, cfg.n_layer)

    def forward(self, idx: Tensor) -> Tensor:
        B, T = idx.shape
        e = self.wte(idx)  # [B, T, C]
        e = F.pad(e, (0, 0, self.context - 1, 0))  # [B, T + ctx - 1, C]: zeros before the start
        x = e.unfold(1, self.context, 1)  # [B, T, C, ctx]: window ending at each position
        x = x.transpose(2, 3).reshape(B, T, -1)  # [B, T, ctx * C]
        for layer in self.hidden:
            x = F.gelu(layer(x))
        return self.lm_head(self.ln_f(x))


ARCHITECTURES = {"mlp": MLPLanguageModel}
