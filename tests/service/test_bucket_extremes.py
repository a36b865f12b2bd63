"""The history's per-bucket extremes against a plain reference, on any steps and values."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from app.services.metric_history import bucket_extremes


def reference(steps: list[int], values: list[float], lo: int, width: int) -> dict[int, dict[str, list]]:
    """One bucket at a time: the smallest and largest number (earliest step on a tie, NaN only
    where the bucket holds nothing else) and the last point."""
    out: dict[int, dict[str, list]] = {}
    for b in sorted({(s - lo) // width for s in steps}):
        points = [(s, v) for s, v in zip(steps, values) if (s - lo) // width == b]
        numbers = [(s, v) for s, v in points if not math.isnan(v)] or points[:1]
        low = min(numbers, key=lambda p: (p[1], p[0]))
        high = min(numbers, key=lambda p: (-p[1], p[0]))
        out[b] = {"min": list(low), "max": list(high), "last": list(points[-1])}
    return out


values = st.one_of(st.floats(-5, 5, allow_nan=False), st.just(float("nan")), st.sampled_from([0.0, 1.0]))


@given(
    gaps=st.lists(st.integers(1, 4), min_size=1, max_size=200),
    vals=st.lists(values, min_size=200, max_size=200),
    lo=st.integers(0, 5),
    width=st.integers(1, 30),
)
def test_bucket_extremes_match_the_reference(gaps, vals, lo, width):
    steps = (lo + np.cumsum(gaps) - 1).astype(np.int32)
    v = np.array(vals[: len(steps)], dtype=np.float64)
    got = bucket_extremes(steps, v, lo, width)
    want = reference(steps.tolist(), v.tolist(), lo, width)
    assert got.keys() == want.keys()
    for b, kinds in want.items():
        for kind, (step, value) in kinds.items():
            g_step, g_value = got[b][kind]
            assert g_step == step and (g_value == value or (math.isnan(g_value) and math.isnan(value))), (b, kind)
