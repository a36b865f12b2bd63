"""Pure helpers of bench/convergence.py: picking the tuned setting of a contender, the step and
wall-clock at which a validation curve reaches a target, the ratios against tuned AdamW, the
run plan and its time estimate, and the ideal-clip replay of MuonClip's per-step logits.

No training happens here; tests/test_convergence_protocol.py covers every function."""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

Curve = list[tuple[int, float]]  # (step, value) at ascending steps


@dataclass(frozen=True)
class Setting:
    """One point of a contender's grid: its lr and lr schedule."""

    contender: str
    lr: float
    schedule: str

    @property
    def label(self) -> str:
        return f"{self.contender} lr={self.lr:g} {self.schedule}"


@dataclass(frozen=True)
class PlannedRun:
    """A run of the protocol: stage 1 (tuning, on the first seed), stage 2 (the winners, every
    seed) or stage 3 (Muon's winner with shorter schedules: a horizon, every seed)."""

    stage: int
    contender: str
    lr: float | None  # None in stage 2: the stage-1 winner, known only once stage 1 ran
    schedule: str | None
    seed: int
    steps: int


def steps_to_reach(curve: Curve, target: float) -> float | None:
    """First step at which ``curve`` (eval points, ascending steps) is <= ``target``, linearly
    interpolated between the eval point before and the first one at or below; None if never."""
    for i, (step, value) in enumerate(curve):
        if value <= target:
            if i == 0:
                return float(step)
            prev_step, prev_value = curve[i - 1]
            return prev_step + (prev_value - target) / (prev_value - value) * (step - prev_step)
    return None


def value_at(series: Sequence[tuple[float, float]], x: float) -> float:
    """``series`` (ascending x) linearly interpolated at ``x``; clamped to its ends."""
    if not series:
        raise ValueError("empty series")
    if x <= series[0][0]:
        return float(series[0][1])
    for (x0, y0), (x1, y1) in itertools.pairwise(series):
        if x <= x1:
            return float(y0 if x1 == x0 else y0 + (x - x0) / (x1 - x0) * (y1 - y0))
    return float(series[-1][1])


def seconds_to_reach(curve: Curve, clock: Sequence[tuple[int, float]], target: float) -> float | None:
    """Training seconds at which ``curve`` first reaches ``target``: the crossing step of
    :func:`steps_to_reach`, read off ``clock`` ((step, training seconds after that many steps) at
    the same eval points) by linear interpolation; None if never reached."""
    step = steps_to_reach(curve, target)
    return None if step is None else value_at(clock, step)


def pick_winner(finals: dict[Hashable, float]) -> Hashable:
    """The key with the lowest final validation loss; non-finite values (a diverged run) never
    win; ties go to the first key. Raises if every run diverged."""
    finite = {k: v for k, v in finals.items() if math.isfinite(v)}
    if not finite:
        raise ValueError("every run of the grid diverged")
    return min(finite, key=finite.__getitem__)


def at_grid_edge(lr: float, grid: Sequence[float]) -> bool:
    """Whether ``lr`` is the smallest or largest of a grid of more than one lr (the optimum may lie outside)."""
    return len(set(grid)) > 1 and lr in (min(grid), max(grid))


def spread(values: Sequence[float]) -> dict[str, float]:
    """Mean, population std, min and max of per-seed values."""
    return {
        "mean": statistics.fmean(values),
        "std": statistics.pstdev(values),
        "min": min(values),
        "max": max(values),
    }


def mean_or_none(values: Iterable[float | None]) -> float | None:
    """Mean of the values, or None if any is None (a seed that never reached the target)."""
    values = list(values)
    return None if not values or any(v is None for v in values) else statistics.fmean(values)


def ratios_against(
    curve: Curve, clock: Sequence[tuple[int, float]], target: float, baseline_steps: int, baseline_seconds: float
) -> dict[str, float | None]:
    """Steps and training seconds at which ``curve`` reaches ``target`` (tuned AdamW's final
    validation loss), and their ratios to AdamW's whole run (``baseline_steps`` steps taking
    ``baseline_seconds`` training seconds, at whose end it reads ``target``)."""
    step = steps_to_reach(curve, target)
    seconds = None if step is None else value_at(clock, step)
    return {
        "target": target,
        "steps": step,
        "seconds": seconds,
        "step_ratio": None if step is None else step / baseline_steps,
        "wall_ratio": None if seconds is None else seconds / baseline_seconds,
    }


def rel_diff(value: float, reference: float) -> float:
    """(value - reference) / reference: negative when ``value`` is the lower (better) loss."""
    return (value - reference) / reference


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in [0, 1]) of ``values``: the sorted value at index floor(q * n), capped."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def ideal_clip(before: Sequence[float], next_batch: Sequence[float], tau: float) -> float:
    """What a perfect QK-Clip leaves on the next batch, / tau: every head h measured at
    ``before[h]`` on batch i is scaled to exactly tau on batch i (factor min(1, tau / s_h)), no
    update follows, and batch i + 1, which reads ``next_batch[h]`` on the same weights, then
    reads max over heads of min(1, tau / s_h(i)) * s_h(i + 1)."""
    if len(before) != len(next_batch):
        raise ValueError(f"{len(before)} heads before, {len(next_batch)} on the next batch")
    return max(min(1.0, tau / s) * n for s, n in zip(before, next_batch)) / tau


def hold_stats(actual: Sequence[float], ideal: Sequence[float], median_target: float, p95_factor: float) -> dict:
    """MuonClip's max logit / tau per step after its first clip (``actual``) against the ideal
    clip's reading on the same weights and batches (``ideal``): medians, p95s and the two
    targets (median of actual <= ``median_target``; p95 of actual <= ``p95_factor`` x p95 of ideal)."""
    if not actual or not ideal:
        return {"steps": 0, "median_ok": False, "p95_ok": False}
    out = {
        "steps": len(actual),
        "median": statistics.median(actual),
        "p95": percentile(actual, 0.95),
        "max": max(actual),
        "ideal_median": statistics.median(ideal),
        "ideal_p95": percentile(ideal, 0.95),
        "ideal_max": max(ideal),
    }
    out["p95_over_ideal_p95"] = out["p95"] / out["ideal_p95"]
    out["median_ok"] = out["median"] <= median_target
    out["p95_ok"] = out["p95_over_ideal_p95"] <= p95_factor
    return out


def plan_runs(
    grids: dict[str, Sequence[float]],
    schedules: Sequence[str],
    seeds: Sequence[int],
    steps: int,
    horizons: Sequence[int] = (),
    challengers: Sequence[str] = ("muon",),
) -> list[PlannedRun]:
    """Every run of the protocol, in order: stage 1 tunes each contender (grid order, AdamW
    first since the others' AdamW part takes its tuned lr) over lr x schedule on ``seeds[0]``;
    stage 2 runs each contender's winner on every seed, seed-major (for each seed, every
    contender, then stage 3: each of ``challengers``' winners scheduled to end at each of ``horizons`` steps), so
    that load drift on the machine hits all of them alike. A contender with a single setting is
    not tuned: its stage-1 run is its stage-2 run of the first seed."""
    runs = [
        PlannedRun(1, contender, lr, schedule, seeds[0], steps)
        for contender, grid in grids.items()
        for schedule in schedules
        for lr in grid
    ]
    tuned = {c for c, grid in grids.items() if len(grid) * len(schedules) > 1}  # the others' stage-1 run is seed 0's
    for seed in seeds:
        runs += [PlannedRun(2, c, None, None, seed, steps) for c in grids if c in tuned or seed != seeds[0]]
        runs += [PlannedRun(3, c, None, None, seed, h) for c in challengers for h in horizons]
    return runs


def horizon_steps(fractions: Iterable[float], steps: int, every: int) -> list[int]:
    """Run lengths for stage 3: each fraction of ``steps`` rounded to a multiple of ``every`` (an
    evaluation point of the full run), shorter than ``steps``, ascending, no repeats."""
    out = {every * round(f * steps / every) for f in fractions}
    return sorted(h for h in out if 0 < h < steps)


def horizon_ratios(
    runs: Sequence[tuple[int, float, float]], target: float, baseline_steps: int, baseline_seconds: float
) -> dict[str, float | None]:
    """Muon's steps and seconds to ``target`` with a schedule that ends there: ``runs`` are
    (steps, final validation loss, training seconds) of runs each scheduled over its own length
    (the full run among them). The shortest length whose final loss is at or below ``target``,
    interpolated linearly between the lengths around it (:func:`ratios_against` over the final
    losses; a target the shortest run already reaches gives that run: an upper bound)."""
    ordered = sorted(runs)
    return ratios_against(
        [(h, v) for h, v, _ in ordered], [(h, s) for h, _, s in ordered], target, baseline_steps, baseline_seconds
    )


def estimate_seconds(runs: Sequence[PlannedRun], seconds_per_step: dict[str, float], overhead_s: float = 0.0) -> float:
    """Estimated duration of ``runs``: steps x the contender's measured seconds per step (eval
    included; a contender without one takes Muon's), plus ``overhead_s`` per run (model build)."""
    return sum(r.steps * seconds_per_step.get(r.contender, seconds_per_step["muon"]) + overhead_s for r in runs)


def describe(value: Any, spec: str = ".3f") -> str:
    """A number for a table, or "-" for None."""
    return "-" if value is None else format(value, spec)
