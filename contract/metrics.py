"""Telemetry names: every series a run reports, the run's summary keys and the per-unit series.

The per-unit series are named per layer, per head and per expert. A step number is the number
of optimizer steps completed before that forward pass. The optimizer's own statistics
(``optim.Muon.last_step_stats()``) are reported under their own names, prefixed ``optim/``
unless they carry a prefix of their own (``qk_clip/``).
"""

from __future__ import annotations

from typing import Any, Final, Literal

LOSS = "loss"
VAL_LOSS: Final = "val_loss"  # at every multiple of train.eval_every and at the last step
LR = "lr"
GRAD_NORM = "grad_norm"  # of the raw gradients, before clipping
LOGITS_MAX_ABS = "logits/max_abs"
LOGITS_STD = "logits/std"
STEP_TIME_MS = "step_time_ms"
TOKENS_PER_S = "tokens_per_s"
ELAPSED_S = "elapsed_s"  # the run's wall time, attempts end to end
UPDATE_RMS = "update_rms"  # RMS of the applied Muon updates
ATTN_MAX_LOGIT = "attn_max_logit"  # max over layers and heads
QK_CLIP_HEADS_CLIPPED = "qk_clip/heads_clipped"
QK_CLIP_MIN_GAMMA = "qk_clip/min_gamma"
NORMUON_SCALE_SPREAD = "normuon/scale_spread"  # NorMuon: mean over matrices of max / min row scale
ROUTER_AUX_LOSS = "router/aux_loss"
ROUTER_ENTROPY = "router/entropy"
ROUTER_LOAD_MAX = "router/load_max"  # 1.0: perfectly even
ROUTER_LOAD_MIN = "router/load_min"
OPTIM_PREFIX = "optim/"
# What early stopping and a sweep's ASHA may judge: an evaluation's metric.
EvaluationMetric = Literal["val_loss"]


def layer_max_logit(layer: int) -> str:
    """The max attention logit of one layer (layers count from 0)."""
    return f"{ATTN_MAX_LOGIT}/l{layer}"


def head_max_logit(layer: int, head: int) -> str:
    """The max attention logit of one head of one layer."""
    return f"{ATTN_MAX_LOGIT}/l{layer}h{head}"


def expert_load(layer: int, expert: int) -> str:
    """The share of tokens routed to one expert of one MoE layer (times the number of experts)."""
    return f"router/load/l{layer}e{expert}"


def optimizer_series(stat: str) -> str:
    """The series an optimizer statistic (a key of ``last_step_stats()``) is reported as."""
    return stat if stat == UPDATE_RMS or "/" in stat else OPTIM_PREFIX + stat


# Reported by every run at each telemetry step (val_loss at evaluations).
GLOBAL = (LOSS, VAL_LOSS, LR, GRAD_NORM, LOGITS_MAX_ABS, LOGITS_STD, STEP_TIME_MS, TOKENS_PER_S, ELAPSED_S)
# Each optimizer's own series: Muon's (and NorMuon's) step statistics, the clip's on top.
MUON_STATS = (UPDATE_RMS, f"{OPTIM_PREFIX}ns_time_ms", f"{OPTIM_PREFIX}nonfinite_skipped")
CLIP_STATS = (*MUON_STATS, QK_CLIP_HEADS_CLIPPED, QK_CLIP_MIN_GAMMA)
OPTIMIZER = {
    "adamw": (),
    "muon": MUON_STATS,
    "muonclip": CLIP_STATS,
    "normuon": (*MUON_STATS, NORMUON_SCALE_SPREAD),
    "normuonclip": (*CLIP_STATS, NORMUON_SCALE_SPREAD),
}
ROUTER = (ROUTER_AUX_LOSS, ROUTER_ENTROPY, ROUTER_LOAD_MAX, ROUTER_LOAD_MIN)
# The series of a whole run (none per layer, head or expert): what the compare page offers.
COMPARABLE = (
    LOSS,
    VAL_LOSS,
    ATTN_MAX_LOGIT,
    QK_CLIP_HEADS_CLIPPED,
    QK_CLIP_MIN_GAMMA,
    LR,
    GRAD_NORM,
    UPDATE_RMS,
    TOKENS_PER_S,
    LOGITS_MAX_ABS,
    LOGITS_STD,
    STEP_TIME_MS,
    ELAPSED_S,
)
# The run's summary: the latest value of each (summary.json, a service job's summary).
SUMMARY = (LOSS, VAL_LOSS, ATTN_MAX_LOGIT, TOKENS_PER_S, LR, GRAD_NORM, UPDATE_RMS)


def as_json() -> dict[str, Any]:
    """Every name by its constant's name, and the per-unit names as templates (``{layer}``,
    ``{head}``, ``{expert}``): what the web pages embed."""
    names = {k: v for k, v in globals().items() if k.isupper() and isinstance(v, str)}
    templates = {
        "layer_max_logit": layer_max_logit(0).replace("0", "{layer}"),
        "head_max_logit": head_max_logit(0, 1).replace("l0", "l{layer}").replace("h1", "h{head}"),
        "expert_load": expert_load(0, 1).replace("l0", "l{layer}").replace("e1", "e{expert}"),
    }
    return {"names": names, "templates": templates, "comparable": list(COMPARABLE)}
