"""What the trainer steps with: the optimizer a job config names, and its lr schedule."""

from __future__ import annotations

import math
from collections import Counter
from typing import Protocol, TypedDict, runtime_checkable

import torch
from torch import nn

import optim
from contract.spec import CLIPPED, NORMUON, OptimizerSpec, TrainSpec

from .models import LanguageModel
from .telemetry import TelemetrySink

NS_DTYPES = {"auto": None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # optimizer.ns_dtype
WSD_DECAY_FRACTION = 0.2  # warmup-stable-decay: linear decay over the last 20% (MiniCPM, arXiv 2404.06395)


def lr_factor(step: int, cfg: TrainSpec) -> float:
    """Multiplier on every group's base lr before optimizer step ``step`` (0-based)."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return 1.0
    if cfg.lr_schedule == "cosine":
        progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    if cfg.lr_schedule == "wsd":
        decay_start = cfg.steps - int(WSD_DECAY_FRACTION * cfg.steps)
        return 1.0 if step < decay_start else max(0.0, (cfg.steps - step) / max(1, cfg.steps - decay_start))
    raise ValueError(f"unknown lr_schedule {cfg.lr_schedule!r}")


class MuonOptions(TypedDict):
    """The keyword arguments a job's Muon or MuonClip is built with (beside its groups)."""

    lr: float
    momentum: float
    nesterov: bool
    ns_steps: int
    ns_coefficients: str
    ns_method: str
    ns_dtype: torch.dtype | None
    adjust_lr: str
    weight_decay: float
    weight_decay_mode: str
    normuon: bool
    normuon_beta2: float
    adamw_lr: float
    adamw_betas: tuple[float, float]
    adamw_eps: float
    adamw_weight_decay: float
    distributed: bool


def build_optimizer(
    model: nn.Module, cfg: OptimizerSpec, distributed: bool = False, ns_dtype: torch.dtype | None = None
) -> torch.optim.Optimizer:
    """muon, normuon / muonclip, normuonclip: optim.Muon(Clip) over role-split groups (normuon: NorMuon's
    update); adamw: AdamW on every parameter.

    ``distributed``: data-parallel Muon over the default process group (each rank orthogonalizes
    the matrices it owns; the gradients must arrive averaged, as DDP leaves them). ``ns_dtype``: the
    Newton-Schulz precision in place of ``cfg.ns_dtype``'s (a group pins rank 0's choice).
    """
    if cfg.lr is None:  # the spec's validation sets the optimizer's default
        raise ValueError("the optimizer spec has no lr: it was not validated")
    if cfg.name == "adamw" and cfg.weight_decay_mode == "decoupled":
        return torch.optim.AdamW(
            model.parameters(), lr=cfg.lr, betas=cfg.adamw_betas, eps=cfg.adamw_eps, weight_decay=cfg.weight_decay
        )
    if cfg.name == "adamw":  # cautious: our AdamW (torch.optim.AdamW's step to rounding) on every parameter
        every = [{"params": list(model.parameters()), "use_muon": False}]
        return optim.Muon(
            every,
            adamw_lr=cfg.lr,
            adamw_betas=cfg.adamw_betas,
            adamw_eps=cfg.adamw_eps,
            adamw_weight_decay=cfg.weight_decay,
            weight_decay_mode="cautious",
        )
    options = MuonOptions(
        lr=cfg.lr,
        momentum=cfg.momentum,
        nesterov=cfg.nesterov,
        ns_steps=cfg.ns_steps,
        ns_coefficients=cfg.ns_coefficients,
        ns_method=cfg.ns_method,
        ns_dtype=ns_dtype or NS_DTYPES[cfg.ns_dtype],
        adjust_lr=cfg.adjust_lr,
        weight_decay=cfg.weight_decay,
        weight_decay_mode=cfg.weight_decay_mode,
        normuon=cfg.name in NORMUON,
        normuon_beta2=cfg.normuon_beta2,
        adamw_lr=cfg.adamw_lr,
        adamw_betas=cfg.adamw_betas,
        adamw_eps=cfg.adamw_eps,
        adamw_weight_decay=cfg.adamw_weight_decay,
        distributed=distributed,
    )
    groups = optim.split_params(model)
    if cfg.orthogonalize == "per_head" and isinstance(model, LanguageModel):
        groups = optim.split_by_heads(groups, model.head_blocks())
    if cfg.name in CLIPPED:
        tau = {} if cfg.qk_clip_tau is None else {"qk_clip_tau": cfg.qk_clip_tau}  # else MuonClip's default
        sources = model.qk_clip_sources() if isinstance(model, LanguageModel) else model
        return optim.MuonClip(groups, sources, **tau, **options)
    if cfg.name in ("muon", "normuon"):
        return optim.Muon(groups, **options)
    raise ValueError(f"unknown optimizer {cfg.name!r}")


def routing_lines(model: nn.Module) -> list[tuple[str, str]]:
    """What the job's log says of the routing: one info line (each optimizer's share, by rule) and a
    warning for each matrix whose role no rule knows (AdamW takes it: optim.routes, rule 4)."""
    table = optim.routes(model)
    share: dict[str, list[optim.Route]] = {"Muon": [], "AdamW": []}
    for route in table:
        share["AdamW" if route.group == "adamw" else "Muon"].append(route)

    def part(name: str, taken: list[optim.Route]) -> str:
        values = sum(math.prod(r.shape) for r in taken)
        reasons = Counter(r.reason for r in taken)
        why = ", ".join(f"{reason} {count}" for reason, count in sorted(reasons.items()))
        return f"{name} takes {len(taken)} ({values:,} values{': ' + why if why else ''})"

    lines = [("info", f"parameters: {part('Muon', share['Muon'])}; {part('AdamW', share['AdamW'])}")]
    lines += [("warning", warning) for r in table if (warning := unrecognized_warning(r))]
    return lines


# The API's name of each rule of optim.routes: stable words a client can match on.
ROLE_CODES = {
    optim.routing.DECLARED: "declared",
    optim.routing.HEAD: "output_head",
    optim.routing.TABLE: "embedding_or_norm",
    optim.routing.MATRIX: "hidden_matrix",
    optim.routing.VECTOR: "bias_or_vector",
    optim.routing.UNRECOGNIZED: "unrecognized",
}


class RoutedParameter(TypedDict):
    """One parameter of a job's routing table."""

    name: str
    shape: list[int]
    optimizer: str  # "muon" or "adamw": what steps it in this job
    role: str  # one of ROLE_CODES' values
    reason: str  # the rule's own words (optim.routing.REASONS)
    warning: str | None  # what the log warns of it (an unrecognized matrix), else None


class RoutingTable(TypedDict):
    """Every parameter of a job's model once (a tied one under its first name), in module order."""

    optimizer: str  # the spec's optimizer.name
    parameters: list[RoutedParameter]


@runtime_checkable
class RoutingSink(Protocol):
    """A sink that keeps the job's routing table (the service's, and a group's rank 0 line to it)."""

    def routing(self, table: RoutingTable) -> None: ...


def unrecognized_warning(route: optim.Route) -> str | None:
    """The log's warning for a matrix whose role no rule knows; None for any other parameter."""
    if route.reason != optim.routing.UNRECOGNIZED:
        return None
    shape = "x".join(map(str, route.shape))
    return f"parameter {route.name} [{shape}] is a {route.reason}: AdamW takes it, not Muon"


def routed_parameter(route: optim.Route, optimizer: str) -> RoutedParameter:
    """One row of the routing table: ``optimizer`` adamw steps every parameter with AdamW."""
    muon = optimizer != "adamw" and route.group != "adamw"
    return RoutedParameter(
        name=route.name,
        shape=list(route.shape),
        optimizer="muon" if muon else "adamw",
        role=ROLE_CODES[route.reason],
        reason=route.reason,
        warning=unrecognized_warning(route) if optimizer != "adamw" else None,
    )


def routing_table(model: nn.Module, optimizer: str) -> RoutingTable:
    """The routing of ``model``'s parameters under the spec's ``optimizer`` (optim.routes)."""
    return RoutingTable(optimizer=optimizer, parameters=[routed_parameter(r, optimizer) for r in optim.routes(model)])


def report_routing(sink: TelemetrySink, model: nn.Module, optimizer: str, log: bool) -> None:
    """Hand the routing table to a sink that keeps one (a FanOut passes it on); with ``log``, also its
    lines (routing_lines) to the job's log, for an optimizer that routes (not plain adamw)."""
    if isinstance(sink, RoutingSink):
        sink.routing(routing_table(model, optimizer))
    if log and optimizer != "adamw":
        for level, line in routing_lines(model):
            sink.log(level, line)
