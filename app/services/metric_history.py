"""Stored telemetry: ingest (idempotent per point), downsampled history, and steps for replay.

A job's metrics are stored per series (one metric name) in columnar chunks of up to
CHUNK_POINTS points: packed arrays of steps and values plus the chunk's min, max and last point.
Counting points, not rows: the telemetry of a step (about 40 values for a 4-layer, 4-head gpt)
costs no row of its own, and a series of 1,000,000 points (about 2,000 chunks) is downsampled
from its chunk summaries without reading the points of its chunks.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from sqlalchemy.orm import Session

from app.repositories.metrics import MetricRepository

STEP_DTYPE, VALUE_DTYPE = np.dtype("<i4"), np.dtype("<f8")
CHUNK_POINTS = 512  # a full chunk: 6 KiB of points behind one row and one summary

Point = list  # [step, value]


# -- ingest ------------------------------------------------------------------------------------
def store_metrics(
    session: Session, job_id: str, steps: Sequence[tuple[int, dict[str, float]]], mark: str | None = None
) -> int:
    """Store telemetry steps ``(step, {name: value})`` of one job; returns the points stored.

    Idempotent per point (job, name, step): a point at or before its series' last stored step is
    a repeat (a resumed or redelivered attempt sends steps again) and is dropped, so the first
    stored value stays; a new name at a stored step starts a series and is kept. Non-finite
    values are dropped. Writers of one job are serialised by a lock on the job's row. ``mark``:
    the live-bus position of the last step, recorded as the point up to which the job's metrics
    are stored."""
    repo = MetricRepository(session)
    if not repo.lock_job(job_id):
        return 0
    state = repo.series_state(job_id)
    series = new_points(steps, {name: row.last_step for name, row in state.items()})
    # A series' last chunk grows until it holds CHUNK_POINTS points: it is taken out, and written
    # back with the new points, so a series of n points has about n / CHUNK_POINTS chunks however
    # often it is written.
    open_tails = [
        (name, state[name].tail_step) for name in series if name in state and state[name].tail_points < CHUNK_POINTS
    ]
    tails = repo.take_chunks(job_id, open_tails)
    chunks, updates = [], []
    for name, (new_steps, new_values) in series.items():
        all_steps, all_values = new_steps, new_values
        if name in tails:
            old_steps, old_values = unpack(*tails[name])
            all_steps, all_values = np.concatenate([old_steps, new_steps]), np.concatenate([old_values, new_values])
        parts = [
            chunk_row(job_id, name, all_steps[i : i + CHUNK_POINTS], all_values[i : i + CHUNK_POINTS])
            for i in range(0, len(all_steps), CHUNK_POINTS)
        ]
        chunks += parts
        series_row = {
            "job_id": job_id,
            "name": name,
            "points": len(new_steps),
            "first_step": int(all_steps[0]),
            "last_step": int(new_steps[-1]),
            "tail_step": parts[-1]["first_step"],
            "tail_points": parts[-1]["n"],
        }
        updates.append(series_row)
    repo.add_chunks(chunks)
    repo.update_series(updates)
    if mark is not None:
        repo.set_mark(job_id, mark)
    return sum(u["points"] for u in updates)


def new_points(
    steps: Iterable[tuple[int, dict[str, float]]], last_steps: dict[str, int]
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per series, the (steps, values) arrays of the points after its last stored step, in step
    order; a step repeated within ``steps`` keeps its first value."""
    columns: dict[str, tuple[list[int], list[float]]] = {}
    last = dict(last_steps)
    for step, values in steps:
        for name, value in values.items():
            if step > last.get(name, -1) and math.isfinite(value):
                if name not in columns:
                    columns[name] = ([], [])
                columns[name][0].append(step)
                columns[name][1].append(value)
                last[name] = step
    return {name: (np.asarray(s, STEP_DTYPE), np.asarray(v, VALUE_DTYPE)) for name, (s, v) in columns.items()}


def chunk_row(job_id: str, name: str, steps: np.ndarray, values: np.ndarray) -> dict[str, Any]:
    """One chunk: the points packed little-endian, and its min, max and last point."""
    lo, hi = int(values.argmin()), int(values.argmax())
    return {
        "job_id": job_id,
        "name": name,
        "first_step": int(steps[0]),
        "last_step": int(steps[-1]),
        "n": len(steps),
        "steps": steps.astype(STEP_DTYPE).tobytes(),
        "values": values.astype(VALUE_DTYPE).tobytes(),
        "min_step": int(steps[lo]),
        "min_value": float(values[lo]),
        "max_step": int(steps[hi]),
        "max_value": float(values[hi]),
        "last_value": float(values[-1]),
    }


def unpack(steps: bytes, values: bytes) -> tuple[np.ndarray, np.ndarray]:
    return np.frombuffer(steps, STEP_DTYPE), np.frombuffer(values, VALUE_DTYPE)


# -- history -----------------------------------------------------------------------------------
MAX_STEP = 2**31 - 1  # steps are int32


def history(
    session: Session,
    job_id: str,
    names: Sequence[str] | None,
    max_points: int,
    from_step: int | None,
    to_step: int | None,
) -> list[dict[str, Any]]:
    """Every requested series over [from_step, to_step] as at most ``max_points`` real points.

    All of them when they fit; else the steps are cut into about max_points // 3 buckets, each
    keeping its min, max and last point (spikes survive).

    Where a series' chunks are no wider than a bucket (a coarse view of a long series), buckets
    follow chunk boundaries (a chunk belongs to the bucket of its first step), so the buckets
    come from the chunk summaries alone; only the chunks cut by the range's ends are unpacked.
    Where chunks are wider (a zoom), the chunks in the range are unpacked and bucketed by step.
    Whatever the number of series, this is a handful of queries.
    """
    repo = MetricRepository(session)
    lo_q, hi_q = from_step or 0, MAX_STEP if to_step is None else to_step
    series = repo.series(job_id, names)
    stats = {row.name: row for row in repo.range_stats(job_id, [s.name for s in series], lo_q, hi_q)}
    points: dict[str, list[Point]] = {}
    unpacked, summarized = [], defaultdict(list)  # names; (lo, hi, width) -> names
    for s in series:
        lo, hi, row = max(lo_q, s.first_step), min(hi_q, s.last_step), stats.get(s.name)
        if lo > hi or row is None:
            points[s.name] = []
            continue
        width = max(1, math.ceil((hi - lo + 1) / max(1, max_points // 3)))
        if row.points > max_points and (hi - lo + 1) / row.chunks <= width:
            summarized[(lo, hi, width)].append(s.name)
        else:
            unpacked.append(s.name)
    # Series whose points fit, and zoomed ones: their points, bucketed when they do not fit.
    by_name: dict[str, list[tuple[np.ndarray, np.ndarray]]] = defaultdict(list)
    for name, steps, values in repo.chunks(job_id, unpacked, lo_q, hi_q) if unpacked else ():
        by_name[name].append(unpack(steps, values))
    for s in series:
        if s.name in unpacked:
            lo, hi = max(lo_q, s.first_step), min(hi_q, s.last_step)
            steps, values = in_range(by_name[s.name], lo, hi)
            if len(steps) <= max_points:
                points[s.name] = [[int(a), float(b)] for a, b in zip(steps.tolist(), values.tolist())]
            else:
                width = max(1, math.ceil((hi - lo + 1) / max(1, max_points // 3)))
                points[s.name] = merge_extremes({}, steps, values, lo, width)
    # Long series seen coarsely: bucket extremes from chunk summaries, plus the cut chunks' points.
    for (lo, hi, width), group in summarized.items():
        best: dict[str, dict[int, dict[str, Point]]] = {name: defaultdict(dict) for name in group}
        for row in repo.bucket_summaries(job_id, group, lo, hi, width):
            extremes = best[row.name][row.b]
            if row.rmin == 1:
                keep(extremes, "min", [row.min_step, row.min_value])
            if row.rmax == 1:
                keep(extremes, "max", [row.max_step, row.max_value])
            if row.rlast == 1:
                keep(extremes, "last", [row.last_step, row.last_value])
        cut: dict[str, list[tuple[np.ndarray, np.ndarray]]] = defaultdict(list)
        for name, steps, values in repo.chunks(job_id, group, lo, hi, cut_by_range=True):
            cut[name].append(unpack(steps, values))
        for name in group:
            steps, values = in_range(cut[name], lo, hi)
            points[name] = merge_extremes(best[name], steps, values, lo, width)
    return [{"name": s.name, "points": points[s.name]} for s in series]


def keep(extremes: dict[str, Point], kind: str, point: Point) -> None:
    """Keep ``point`` as the bucket's min, max or last if it beats the current one."""
    current = extremes.get(kind)
    if (
        current is None
        or (kind == "min" and (point[1], point[0]) < (current[1], current[0]))
        or (kind == "max" and (-point[1], point[0]) < (-current[1], current[0]))
        or (kind == "last" and point[0] > current[0])
    ):
        extremes[kind] = point


def bucket_extremes(steps: np.ndarray, values: np.ndarray, lo: int, width: int) -> dict[int, dict[str, Point]]:
    """min, max and last point of every bucket of ``width`` steps from ``lo`` (steps ascending);
    a tie goes to the earliest step, NaN loses to any number. Linear: one reduction per kind."""
    if len(steps) == 0:
        return {}
    buckets = (steps.astype(np.int64) - lo) // width
    starts = np.flatnonzero(np.r_[True, buckets[1:] != buckets[:-1]])
    ends = np.r_[starts[1:], len(steps)] - 1
    owner = np.repeat(np.arange(len(starts)), ends - starts + 1)  # each point's bucket, 0..len(starts)-1

    def first_equal(target: np.ndarray) -> np.ndarray:
        """Per bucket, the first point whose value is the bucket's target (its start if none: all NaN)."""
        hits = np.flatnonzero(values == target[owner])
        first = starts.copy()
        leads = np.r_[True, owner[hits][1:] != owner[hits][:-1]] if len(hits) else np.empty(0, bool)
        first[owner[hits][leads]] = hits[leads]
        return first

    with np.errstate(invalid="ignore"):
        mins, maxs = first_equal(np.fmin.reduceat(values, starts)), first_equal(np.fmax.reduceat(values, starts))
    out = {}
    for b, i, j, k in zip(buckets[starts].tolist(), mins.tolist(), maxs.tolist(), ends.tolist()):
        out[b] = {
            "min": [int(steps[i]), float(values[i])],
            "max": [int(steps[j]), float(values[j])],
            "last": [int(steps[k]), float(values[k])],
        }
    return out


def merge_extremes(
    best: dict[int, dict[str, Point]], steps: np.ndarray, values: np.ndarray, lo: int, width: int
) -> list[Point]:
    """The buckets' extremes so far with those of these points, as sorted, distinct points."""
    for bucket, extremes in bucket_extremes(steps, values, lo, width).items():
        for kind, point in extremes.items():
            keep(best.setdefault(bucket, {}), kind, point)
    return [list(p) for p in sorted({tuple(p) for extremes in best.values() for p in extremes.values()})]


def in_range(chunks: Iterable[tuple[np.ndarray, np.ndarray]], lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
    """The points of ``chunks`` (in step order) with lo <= step <= hi, as two arrays."""
    chunks = list(chunks)
    if not chunks:
        return np.empty(0, STEP_DTYPE), np.empty(0, VALUE_DTYPE)
    steps, values = np.concatenate([c[0] for c in chunks]), np.concatenate([c[1] for c in chunks])
    inside = (steps >= lo) & (steps <= hi)
    return steps[inside], values[inside]


# -- replay ------------------------------------------------------------------------------------
def steps_from(session: Session, job_id: str, first: int, count: int) -> list[tuple[int, dict[str, float]]]:
    """The stored telemetry steps in [first, first + count), as (step, {name: value}) in step order."""
    by_step: dict[int, dict[str, float]] = defaultdict(dict)
    last = min(first + count - 1, MAX_STEP)  # a bound past int32 would be out of range for the columns
    for name, steps, values in MetricRepository(session).chunks(job_id, None, first, last):
        s, v = unpack(steps, values)
        inside = (s >= first) & (s < first + count)
        for step, value in zip(s[inside].tolist(), v[inside].tolist()):
            by_step[step][name] = value
    return sorted(by_step.items())
