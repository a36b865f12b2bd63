"""What the engine trains: ``LanguageModel``, token ids in, logits out, its attention and MoE layers named."""

from __future__ import annotations

from torch import Tensor, nn

from .attention import CausalSelfAttention
from .moe import MoEFeedForward


class LanguageModel(nn.Module):
    """A model that maps token ids [B, T] to logits [B, T, vocab].

    The trainer and its telemetry ask it for its attention layers (their max logits, QK-Clip's
    targets) and its MoE layers (router statistics, the load-balancing loss); a model without
    either keeps these defaults.
    """

    def attention_layers(self) -> list[CausalSelfAttention]:
        return []

    def moe_layers(self) -> list[MoEFeedForward]:
        return []

    def aux_loss(self) -> Tensor | None:
        """The load-balancing loss of the latest forward, to add to the training loss (None: none)."""
        return None
