"""What the trainer steps with: the optimizer a job config names, and its lr schedule."""

from __future__ import annotations

import math
from collections import Counter
from typing import TypedDict

import torch
from torch import nn

import optim
from contract.spec import OptimizerSpec, TrainSpec

from .models import LanguageModel

NS_DTYPES = {"auto": None, "fp32": torch.float32, "bf16": torch.bfloat16}  # optimizer.ns_dtype
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
    adamw_lr: float
    adamw_betas: tuple[float, float]
    adamw_eps: float
    adamw_weight_decay: float
    distributed: bool


def build_optimizer(
    model: nn.Module, cfg: OptimizerSpec, distributed: bool = False, ns_dtype: torch.dtype | None = None
) -> torch.optim.Optimizer:
    """muon / muonclip: optim.Muon(Clip) over role-split groups; adamw: AdamW on every parameter.

    ``distributed``: data-parallel Muon over the default process group (each rank orthogonalizes
    the matrices it owns; the gradients must arrive averaged, as DDP leaves them). ``ns_dtype``: the
    Newton-Schulz precision in place of ``cfg.ns_dtype``'s (a group pins rank 0's choice).
    """
    if cfg.lr is None:  # the spec's validation sets the optimizer's default
        raise ValueError("the optimizer spec has no lr: it was not validated")
    if cfg.name == "adamw":
        return torch.optim.AdamW(
            model.parameters(), lr=cfg.lr, betas=cfg.adamw_betas, eps=cfg.adamw_eps, weight_decay=cfg.weight_decay
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
        adamw_lr=cfg.adamw_lr,
        adamw_betas=cfg.adamw_betas,
        adamw_eps=cfg.adamw_eps,
        adamw_weight_decay=cfg.adamw_weight_decay,
        distributed=distributed,
    )
    groups = optim.split_params(model)
    if cfg.name == "muonclip":
        tau = {} if cfg.qk_clip_tau is None else {"qk_clip_tau": cfg.qk_clip_tau}  # else MuonClip's default
        sources = model.qk_clip_sources() if isinstance(model, LanguageModel) else model
        return optim.MuonClip(groups, sources, **tau, **options)
    if cfg.name == "muon":
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
    for r in table:
        if r.reason == optim.routing.UNRECOGNIZED:
            shape = "x".join(map(str, r.shape))
            lines.append(("warning", f"parameter {r.name} [{shape}] is a {r.reason}: AdamW takes it, not Muon"))
    return lines
