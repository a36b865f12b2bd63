"""Exported weights loaded back into the engine's model, without the service.

The weights are a checkpoint as safetensors (``GET …/checkpoints/{step}?format=safetensors`` or
``muonforge export``).
"""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import Any

from torch import nn

from contract.export import EXPORT_KEY

from .config import ModelConfig
from .models import build_model
from .tokenizer import Tokenizer


def model_from_config(config: dict[str, Any]) -> nn.Module:
    """The engine's model for an export's config (``config.json``, or the file's metadata),
    freshly initialised: load the weights into it."""
    names = {f.name for f in fields(ModelConfig)}
    return build_model(ModelConfig(**{k: v for k, v in config.items() if k in names}))


def tokenizer_from_config(config: dict[str, Any]) -> Tokenizer | None:
    """The tokenizer the model was trained with (None for the synthetic task's token ids)."""
    return Tokenizer(**config["tokenizer"]) if config.get("tokenizer") else None


def load_safetensors(path: str | Path) -> tuple[nn.Module, dict[str, Any]]:
    """The model of an exported file, its weights loaded strictly, in eval mode; and its config."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(path), framework="pt") as f:
        config = json.loads(f.metadata()[EXPORT_KEY])
    model = model_from_config(config)
    model.load_state_dict(load_file(str(path)))
    return model.eval(), config
