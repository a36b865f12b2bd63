"""Muon's hyper-parameters: their allowed values, their checks, and each matrix shape's lr scale.

One of them, ``adjust_lr``, picks the rule that scales lr by the matrix's shape (``update_scale``).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .coefficients import resolve_coefficients
from .newton_schulz import METHODS

ADJUST_LR = ("original", "match_rms_adamw", "spectral")
WEIGHT_DECAY_MODES = ("decoupled", "cautious")
NS_DTYPES = (None, torch.float32, torch.bfloat16, torch.float16, torch.float64)


def update_scale(rows: int, cols: int, adjust_lr: str) -> float:
    """Multiplier on lr for an orthogonalized [rows, cols] update (the flattened 2D shape)."""
    if adjust_lr == "original":  # Keller Jordan's reference and torch.optim.Muon's default
        return math.sqrt(max(1.0, rows / cols))
    if adjust_lr == "match_rms_adamw":  # Moonlight (arXiv 2502.16982): update RMS ~0.2, like AdamW
        return 0.2 * math.sqrt(max(rows, cols))
    if adjust_lr == "spectral":
        return math.sqrt(rows / cols)
    raise ValueError(f"adjust_lr must be one of {ADJUST_LR}, got {adjust_lr!r}")


def check(name: str, value: Any, ok: bool, rule: str) -> None:
    if not ok:
        raise ValueError(f"invalid {name}: {value!r} ({rule})")


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def validate_group(group: dict[str, Any]) -> None:
    """Raise ValueError naming the first bad hyper-parameter of a param group (or of defaults)."""
    check("lr", group["lr"], is_number(group["lr"]) and group["lr"] >= 0, "must be a finite number >= 0")
    wd = group["weight_decay"]
    check("weight_decay", wd, is_number(wd) and wd >= 0, "must be a finite number >= 0")
    mode = group["weight_decay_mode"]
    check("weight_decay_mode", mode, mode in WEIGHT_DECAY_MODES, f"must be one of {WEIGHT_DECAY_MODES}")
    if not group["use_muon"]:
        betas = group["betas"]
        ok = isinstance(betas, (tuple, list)) and len(betas) == 2 and all(is_number(b) and 0 <= b < 1 for b in betas)
        check("adamw_betas", betas, ok, "must be two numbers in [0, 1)")
        check("adamw_eps", group["eps"], is_number(group["eps"]) and group["eps"] >= 0, "must be a number >= 0")
        return
    m = group["momentum"]
    check("momentum", m, is_number(m) and 0 <= m < 1, "must be in [0, 1)")
    check("nesterov", group["nesterov"], isinstance(group["nesterov"], bool), "must be a bool")
    check("ns_method", group["ns_method"], group["ns_method"] in METHODS, f"must be one of {METHODS}")
    check("ns_dtype", group["ns_dtype"], group["ns_dtype"] in NS_DTYPES, f"must be one of {NS_DTYPES}")
    check("adjust_lr", group["adjust_lr"], group["adjust_lr"] in ADJUST_LR, f"must be one of {ADJUST_LR}")
    check("normuon", group["normuon"], isinstance(group["normuon"], bool), "must be a bool")
    b2 = group["normuon_beta2"]
    check("normuon_beta2", b2, is_number(b2) and 0 <= b2 < 1, "must be in [0, 1)")
    blocks = group["row_blocks"]
    ok = blocks is None or (
        isinstance(blocks, (tuple, list)) and bool(blocks) and all(type(h) is int and h > 0 for h in blocks)
    )
    check("row_blocks", blocks, ok, "must be None or a non-empty sequence of positive ints (block heights)")
    resolve_coefficients(group["ns_coefficients"], group["ns_steps"])  # raises on bad steps or coefficients
