"""Stored telemetry: ingest (idempotent per point), downsampled history, and steps for replay.

A job's metrics are stored per series (one metric name) in columnar chunks of up to
CHUNK_POINTS points: packed arrays of steps and values plus the chunk's min, max and last point.
Counting points, not rows: the telemetry of a step (about 40 values for a 4-layer, 4-head gpt)
costs no row of its own, and a series of 1,000,000 points (about 2,000 chunks) is downsampled
from its chunk summaries without reading the points of the chunks that lie within one bucket.
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
        parts = [chunk_row(job_id, name, all_steps[i : i + CHUNK_POINTS], all_values[i : i + CHUNK_POINTS])
                 for i in range(0, len(all_steps), CHUNK_POINTS)]  # fmt: skip
        chunks += parts
        updates.append({
            "job_id": job_id, "name": name, "points": len(new_steps), "first_step": int(all_steps[0]),
            "last_step": int(new_steps[-1]), "tail_step": parts[-1]["first_step"], "tail_points": parts[-1]["n"],
        })  # fmt: skip
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
        "job_id": job_id, "name": name, "first_step": int(steps[0]), "last_step": int(steps[-1]), "n": len(steps),
        "steps": steps.astype(STEP_DTYPE).tobytes(), "values": values.astype(VALUE_DTYPE).tobytes(),
        "min_step": int(steps[lo]), "min_value": float(values[lo]), "max_step": int(steps[hi]),
        "max_value": float(values[hi]), "last_value": float(values[-1]),
    }  # fmt: skip


def unpack(steps: bytes, values: bytes) -> tuple[np.ndarray, np.ndarray]:
    return np.frombuffer(steps, STEP_DTYPE), np.frombuffer(values, VALUE_DTYPE)


# -- history -----------------------------------------------------------------------------------
def history(
    session: Session, job_id: str, names: Sequence[str] | None, max_points: int, from_step: int | None,
    to_step: int | None,
) -> list[dict[str, Any]]:  # fmt: skip
    """Every requested series over [from_step, to_step] as at most ``max_points`` real points:
    all of them when they fit, else the step axis cut into max_points // 3 buckets, each keeping
    its min, max and last point (spikes survive)."""
    repo = MetricRepository(session)
    out = []
    for series in repo.series(job_id, names):
        lo = series.first_step if from_step is None else max(from_step, series.first_step)
        hi = series.last_step if to_step is None else min(to_step, series.last_step)
        points = downsample(repo, job_id, series.name, lo, hi, max_points) if lo <= hi else []
        out.append({"name": series.name, "points": points})
    return out


def downsample(repo: MetricRepository, job_id: str, name: str, lo: int, hi: int, max_points: int) -> list[Point]:
    buckets = max(1, max_points // 3)
    width = max(1, math.ceil((hi - lo + 1) / buckets))
    edges = [unpack(s, v) for s, v in repo.edge_chunks(job_id, name, lo, hi, width)]
    edge_points = sum(int(((s >= lo) & (s <= hi)).sum()) for s, _ in edges)
    if repo.points_within(job_id, name, lo, hi) + edge_points <= max_points:
        rows = repo.chunks(job_id, [name], lo, hi)
        return in_range([unpack(s, v) for _, s, v in rows], lo, hi)
    best: dict[int, dict[str, Point]] = defaultdict(dict)
    for row in repo.bucket_extremes(job_id, name, lo, hi, width):  # chunks inside one bucket: their summaries
        if row.rmin == 1:
            keep(best[row.b], "min", [row.min_step, row.min_value])
        if row.rmax == 1:
            keep(best[row.b], "max", [row.max_step, row.max_value])
        if row.rlast == 1:
            keep(best[row.b], "last", [row.last_step, row.last_value])
    for steps, values in edges:  # chunks across a boundary: their points
        inside = (steps >= lo) & (steps <= hi)
        for bucket, extremes in bucket_points(steps[inside], values[inside], lo, width).items():
            for kind, point in extremes.items():
                keep(best[bucket], kind, point)
    points = {tuple(p) for extremes in best.values() for p in extremes.values()}
    return [list(p) for p in sorted(points)]


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


def bucket_points(steps: np.ndarray, values: np.ndarray, lo: int, width: int) -> dict[int, dict[str, Point]]:
    """min, max and last point of every bucket of ``width`` steps from ``lo`` (steps ascending)."""
    out: dict[int, dict[str, Point]] = {}
    if len(steps) == 0:
        return out
    buckets = (steps.astype(np.int64) - lo) // width
    starts = np.flatnonzero(np.r_[True, buckets[1:] != buckets[:-1]])
    for start, stop in zip(starts, np.r_[starts[1:], len(steps)]):
        s, v = steps[start:stop], values[start:stop]
        i, j = int(v.argmin()), int(v.argmax())
        out[int(buckets[start])] = {
            "min": [int(s[i]), float(v[i])], "max": [int(s[j]), float(v[j])], "last": [int(s[-1]), float(v[-1])]
        }  # fmt: skip
    return out


def in_range(chunks: Iterable[tuple[np.ndarray, np.ndarray]], lo: int, hi: int) -> list[Point]:
    points = []
    for steps, values in chunks:
        inside = (steps >= lo) & (steps <= hi)
        points += [[int(s), float(v)] for s, v in zip(steps[inside], values[inside])]
    return points


# -- replay ------------------------------------------------------------------------------------
def steps_from(session: Session, job_id: str, first: int, count: int) -> list[tuple[int, dict[str, float]]]:
    """The stored telemetry steps in [first, first + count), as (step, {name: value}) in step order."""
    by_step: dict[int, dict[str, float]] = defaultdict(dict)
    for name, steps, values in MetricRepository(session).chunks(job_id, None, first, first + count - 1):
        s, v = unpack(steps, values)
        inside = (s >= first) & (s < first + count)
        for step, value in zip(s[inside].tolist(), v[inside].tolist()):
            by_step[step][name] = value
    return sorted(by_step.items())
