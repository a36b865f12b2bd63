"""Models the engine trains, built from a ModelConfig: one module per family, each naming its archs.

A module of this package that defines ``ARCHITECTURES`` (arch name -> a model class built from a
ModelConfig) is found here by itself: a new architecture is a module of its own, its name in
contract.spec and its figures in worker.engine.facts (docs/architecture.md, "Where a change goes").
"""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

from ..config import ModelConfig
from .attention import CausalSelfAttention, causal_max_logits
from .base import LanguageModel
from .gpt import GPT
from .mlp import MLPLanguageModel
from .moe import MoEFeedForward, load_balancing_loss, top_k_routing


def _architectures() -> dict[str, type[LanguageModel]]:
    found: dict[str, type[LanguageModel]] = {}
    for module in pkgutil.iter_modules(__path__):
        found |= getattr(importlib.import_module(f"{__name__}.{module.name}"), "ARCHITECTURES", {})
    return found


ARCHITECTURES = _architectures()


def build_model(cfg: ModelConfig, pretrained: Path | None = None) -> LanguageModel:
    """A freshly initialised model of ``cfg.arch``; with ``pretrained`` (arch hf), an uploaded
    model's directory, the weights stored there."""
    if cfg.arch not in ARCHITECTURES:
        raise ValueError(f"unknown arch {cfg.arch!r}")
    if pretrained is not None:
        if cfg.arch != "hf":
            raise ValueError("only arch hf starts from an uploaded model's weights")
        return ARCHITECTURES[cfg.arch](cfg, pretrained)
    return ARCHITECTURES[cfg.arch](cfg)


__all__ = [
    "ARCHITECTURES",
    "GPT",
    "CausalSelfAttention",
    "LanguageModel",
    "MLPLanguageModel",
    "MoEFeedForward",
    "build_model",
    "causal_max_logits",
    "load_balancing_loss",
    "top_k_routing",
]
