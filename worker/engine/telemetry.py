"""Telemetry: what the trainer reports each telemetry step, and where it goes (a sink)."""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from contract import metrics

from .models import LanguageModel


@dataclass(frozen=True)
class Report:
    """One telemetry step, as the trainer hands it to every sink."""

    step: int  # optimizer steps completed before this forward pass: the step the values belong to
    values: dict[str, float]
    completed: int  # optimizer steps completed once this report is made: the run's progress
    summary: dict[
        str, Any
    ]  # the run's summary so far (metrics.SUMMARY; stopped_at and stop_reason once it stopped early)


class TelemetrySink(Protocol):
    """Receives the trainer's reports.

    The service plugs in one that writes Postgres and the live bus; ``muonforge train`` uses
    :class:`JsonlSink` and a progress bar.
    """

    def metrics(self, report: Report) -> None:
        """One telemetry step."""

    def checkpoint(self, step: int, path: Path, nbytes: int, metrics: dict[str, float]) -> None:
        """A checkpoint was written after ``step`` steps; ``metrics``: every metric's latest value."""

    def log(self, level: str, message: str) -> None:
        """A human-readable line."""

    def sample(self, step: int, prompt: str, text: str) -> None:
        """What the model wrote after ``prompt`` at the evaluation after ``step`` steps."""


class JsonlSink:
    """Writes ``metrics.jsonl`` (one ``{"step": n, "metrics": {...}}`` object per telemetry step)
    and ``samples.jsonl`` (one ``{"step", "prompt", "text"}`` object per evaluation) in a run's
    directory."""

    def __init__(self, directory: Path, append: bool = False) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        mode = "a" if append else "w"
        self._metrics = (directory / "metrics.jsonl").open(mode, encoding="utf-8")
        self._samples = (directory / "samples.jsonl").open(mode, encoding="utf-8")

    def metrics(self, report: Report) -> None:
        self._metrics.write(json.dumps({"step": report.step, "metrics": report.values}) + "\n")
        self._metrics.flush()

    def checkpoint(self, step: int, path: Path, nbytes: int, metrics: dict[str, float]) -> None:
        pass

    def log(self, level: str, message: str) -> None:
        pass

    def sample(self, step: int, prompt: str, text: str) -> None:
        self._samples.write(json.dumps({"step": step, "prompt": prompt, "text": text}) + "\n")
        self._samples.flush()

    def close(self) -> None:
        self._metrics.close()
        self._samples.close()


class FanOut:
    """Sends every report to several sinks."""

    def __init__(self, *sinks: Any) -> None:
        self.sinks = [s for s in sinks if s is not None]

    def metrics(self, report: Report) -> None:
        for s in self.sinks:
            s.metrics(report)

    def checkpoint(self, step: int, path: Path, nbytes: int, metrics: dict[str, float]) -> None:
        for s in self.sinks:
            s.checkpoint(step, path, nbytes, metrics)

    def log(self, level: str, message: str) -> None:
        for s in self.sinks:
            s.log(level, message)

    def sample(self, step: int, prompt: str, text: str) -> None:
        for s in self.sinks:
            s.sample(step, prompt, text)

    def routing(self, table: Any) -> None:
        """The job's routing table (optimizer.RoutingTable), to the sinks that keep one."""
        for s in self.sinks:
            if callable(getattr(s, "routing", None)):
                s.routing(table)


@torch.no_grad()
def model_metrics(
    model: LanguageModel, logits: Tensor, per_head: bool = True, per_expert: bool = True
) -> dict[str, Tensor]:
    """Attention, output-logit and router statistics of the latest training forward, as tensors
    (the caller converts them all in one host transfer); the per-head and per-expert series when
    asked."""
    out: dict[str, Tensor] = {}
    per_layer = [layer.qk_max_logits() for layer in model.attention_layers()]
    recorded = [m for m in per_layer if m is not None]
    if per_layer and len(recorded) == len(per_layer):
        heads = torch.stack(recorded)  # [L, H]
        out[metrics.ATTN_MAX_LOGIT] = heads.max()
        for i, row in enumerate(heads):
            out[metrics.layer_max_logit(i)] = row.max()
            for j, value in enumerate(row if per_head else ()):
                out[metrics.head_max_logit(i, j)] = value
    flat = logits.detach().float()
    out[metrics.LOGITS_MAX_ABS] = flat.abs().max()
    out[metrics.LOGITS_STD] = flat.std()
    routing = [m.routing_stats() for m in model.moe_layers()]
    if routing:
        aux_losses, loads, entropies = (torch.stack(column) for column in zip(*routing))  # loads [L, E]
        out[metrics.ROUTER_AUX_LOSS] = aux_losses.mean()
        out[metrics.ROUTER_ENTROPY] = entropies.mean()
        out[metrics.ROUTER_LOAD_MAX] = loads.max() * loads.shape[1]  # 1.0 = perfectly even
        out[metrics.ROUTER_LOAD_MIN] = loads.min() * loads.shape[1]
        for i, row in enumerate(loads if per_expert else ()):
            for j, value in enumerate(row):
                out[metrics.expert_load(i, j)] = value
    return out


def to_floats(values: dict[str, Tensor | float]) -> dict[str, float]:
    """Tensors to floats with one device-to-host copy."""
    out = {k: float(v) for k, v in values.items() if not isinstance(v, Tensor)}
    by_device: dict[torch.device, dict[str, Tensor]] = defaultdict(dict)
    for k, v in values.items():
        if isinstance(v, Tensor):
            by_device[v.device][k] = v
    for tensors in by_device.values():
        stacked = torch.stack([v.detach().float().reshape(()) for v in tensors.values()])
        out.update(zip(tensors, stacked.tolist()))
    return {k: out[k] for k in values}  # keep the caller's order
