"""What the engine trains: ``LanguageModel``, token ids in, logits out, its attention and MoE layers named."""

from __future__ import annotations

from typing import Protocol

from torch import Tensor, nn

from optim import QKClipSource

from .moe import MoEFeedForward


class AttentionLayer(QKClipSource, Protocol):
    """An attention layer as the trainer sees it: it records each head's max logit while
    ``record_max_logits`` is on, and QK-Clip scales its targets."""

    record_max_logits: bool

    def head_blocks(self) -> dict[Tensor, tuple[int, ...]]:
        """Per-head row blocks of its query and key weights (``optimizer.orthogonalize: per_head``)."""
        ...


class LanguageModel(nn.Module):
    """A model that maps token ids [B, T] to logits [B, T, vocab].

    The trainer and its telemetry ask it for its attention layers (their max logits, QK-Clip's
    targets) and its MoE layers (router statistics, the load-balancing loss); a model without
    either keeps these defaults.
    """

    def attention_layers(self) -> list[AttentionLayer]:
        return []

    def qk_clip_sources(self) -> list[QKClipSource]:
        """What QK-Clip scales from which maxima: the attention layers, unless a model says otherwise."""
        return list(self.attention_layers())

    def head_blocks(self) -> dict[Tensor, tuple[int, ...]]:
        """Every attention layer's per-head row blocks (:func:`optim.split_by_heads`)."""
        return {w: heights for layer in self.attention_layers() for w, heights in layer.head_blocks().items()}

    def moe_layers(self) -> list[MoEFeedForward]:
        return []

    def aux_loss(self) -> Tensor | None:
        """The load-balancing loss of the latest forward, to add to the training loss (None: none)."""
        return None
