"""Telemetry: what the trainer reports each telemetry step, and where it goes (a sink)."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor, nn


class TelemetrySink(Protocol):
    """Receives the trainer's reports. The service plugs in one that writes Postgres and the
    live bus; ``muonforge train`` uses :class:`JsonlSink`."""

    def metrics(self, step: int, values: dict[str, float]) -> None:
        """One telemetry step: ``{name: value}`` measured at ``step`` (optimizer steps completed)."""

    def checkpoint(self, step: int, path: Path, nbytes: int, metrics: dict[str, float]) -> None:
        """A checkpoint was written after ``step`` steps; ``metrics``: every metric's latest value."""

    def log(self, level: str, message: str) -> None:
        """A human-readable line."""


class JsonlSink:
    """Writes ``metrics.jsonl``: one ``{"step": n, "metrics": {...}}`` object per telemetry step."""

    def __init__(self, path: Path, append: bool = False) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a" if append else "w", encoding="utf-8")

    def metrics(self, step: int, values: dict[str, float]) -> None:
        self._file.write(json.dumps({"step": step, "metrics": values}) + "\n")
        self._file.flush()

    def checkpoint(self, step: int, path: Path, nbytes: int, metrics: dict[str, float]) -> None:
        pass

    def log(self, level: str, message: str) -> None:
        pass

    def close(self) -> None:
        self._file.close()


class FanOut:
    """Sends every report to several sinks."""

    def __init__(self, *sinks: Any) -> None:
        self.sinks = [s for s in sinks if s is not None]

    def metrics(self, step: int, values: dict[str, float]) -> None:
        for s in self.sinks:
            s.metrics(step, values)

    def checkpoint(self, step: int, path: Path, nbytes: int, metrics: dict[str, float]) -> None:
        for s in self.sinks:
            s.checkpoint(step, path, nbytes, metrics)

    def log(self, level: str, message: str) -> None:
        for s in self.sinks:
            s.log(level, message)


@torch.no_grad()
def model_metrics(model: nn.Module, logits: Tensor) -> dict[str, Tensor]:
    """Attention, output-logit and router statistics of the latest training forward, as tensors
    (the caller converts them all in one host transfer)."""
    out: dict[str, Tensor] = {}
    per_layer = [layer.qk_max_logits() for layer in model.attention_layers()]
    if per_layer and all(m is not None for m in per_layer):
        heads = torch.stack(per_layer)  # [L, H]
        out["attn_max_logit"] = heads.max()
        for i, row in enumerate(heads):
            out[f"attn_max_logit/l{i}"] = row.max()
            for j, value in enumerate(row):
                out[f"attn_max_logit/l{i}h{j}"] = value
    flat = logits.detach().float()
    out["logits/max_abs"] = flat.abs().max()
    out["logits/std"] = flat.std()
    moe = model.moe_layers()
    if moe:
        loads = torch.stack([m.last_load for m in moe])  # [L, E]
        out["router/aux_loss"] = torch.stack([m.aux_loss.detach() for m in moe]).mean()
        out["router/entropy"] = torch.stack([m.last_probs_entropy for m in moe]).mean()
        out["router/load_max"] = loads.max() * loads.shape[1]  # 1.0 = perfectly even
        out["router/load_min"] = loads.min() * loads.shape[1]
        for i, row in enumerate(loads):
            for j, value in enumerate(row):
                out[f"router/load/l{i}e{j}"] = value
    return out


def to_floats(values: dict[str, Tensor | float]) -> dict[str, float]:
    """Tensors to floats with one device-to-host copy."""
    out = {k: float(v) for k, v in values.items() if not isinstance(v, Tensor)}
    by_device: dict[torch.device, list[str]] = defaultdict(list)
    for k, v in values.items():
        if isinstance(v, Tensor):
            by_device[v.device].append(k)
    for names in by_device.values():
        stacked = torch.stack([values[k].detach().float().reshape(()) for k in names])
        out.update(zip(names, stacked.tolist()))
    return {k: out[k] for k in values}  # keep the caller's order
