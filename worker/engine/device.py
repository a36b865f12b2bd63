"""Where a run trains: its device and the precision of its autocast, from ``train``."""

from __future__ import annotations

import torch

from contract.spec import TrainSpec

from .outcome import TrainingError


def device_type(device: str) -> str:
    """Where a run with ``train.device`` goes on this machine: "cuda" or "cpu"."""
    return "cuda" if device == "cuda" or (device == "auto" and torch.cuda.is_available()) else "cpu"


def resolve_device(cfg: TrainSpec, index: int | None = None) -> tuple[torch.device, torch.dtype | None]:
    """(device, autocast dtype or None for plain fp32); ``index``: the CUDA device of a rank."""
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise TrainingError("train.device is 'cuda' but no CUDA device is available")
    kind = device_type(cfg.device)
    device = torch.device(kind, index) if kind == "cuda" and index is not None else torch.device(kind)
    bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and device.type == "cuda")
    return device, torch.bfloat16 if bf16 else None
