"""A sweep's pure parts: a search space's trials, a value set at a JobSpec path, and the ASHA rules.

Trials are drawn as a grid or seeded at random. No database, no I/O (tests/test_search.py).

ASHA (asynchronous successive halving; Li et al., "A System for Massively Parallel Hyperparameter
Tuning", and Determined's ASHA) records a trial's metric when it reaches a rung and keeps about
one trial in ``eta`` (the reduction factor) going past it. "Within the top k" of a rung's results
means fewer than k of them are strictly better (ties go on); a non-finite value ranks below every
finite one. Two forms:

* promote (the paper's, and the default: ``stop_once: false``): a trial goes on at once only if
  it is within the top ``floor(n / eta)`` of the ``n`` results recorded at the rung so far, itself
  included; else it waits there, and the best waiting trial within that top k is promoted when a
  slot is free.
  A rung promotes nobody until ``eta`` results are in; once nothing runs and nothing waits to
  start, the best waiting trial of a rung with fewer results is promoted too (k at least 1).
* stop (``stop_once: true``): a trial goes on iff it is within the top ``max(1, floor(n / eta))``
  of the ``n`` results so far, else it stops there; the first trial at a rung always goes on.

docs/service.md, "Sweeps", describes how a sweep applies them (waits, promotions, the end).
"""

from __future__ import annotations

import copy
import itertools
import math
import random
from collections.abc import Mapping, Sequence
from typing import Any

Params = dict[str, Any]  # {spec path ("optimizer.lr"): value}


class BadPath(ValueError):
    """A path that names no place in a spec (it goes through a value that is not an object)."""


def grid(space: Mapping[str, Mapping[str, Any]]) -> list[Params]:
    """Every combination of the ``values`` of each path, the first path varying slowest (the
    space's order); the caller checks that every parameter is a ``values`` list."""
    paths = list(space)
    return [dict(zip(paths, combo)) for combo in itertools.product(*(space[p]["values"] for p in paths))]


def sample(space: Mapping[str, Mapping[str, Any]], n: int, seed: int) -> list[Params]:
    """``n`` trials drawn at random with ``seed``: the same space and seed give the same trials
    whatever the order of its keys (paths are drawn in sorted order)."""
    rng = random.Random(seed)
    trials = []
    for _ in range(n):
        trial = {path: draw(space[path], rng) for path in sorted(space)}
        trials.append({path: trial[path] for path in space})  # shown in the space's order
    return trials


def draw(param: Mapping[str, Any], rng: random.Random) -> Any:
    """One value of a parameter: {values: [...]}, {uniform: [lo, hi]}, {log_uniform: [lo, hi]}
    (lo > 0; uniform in log space) or {int_uniform: [lo, hi]} (both ends included)."""
    if param.get("values") is not None:
        return copy.deepcopy(rng.choice(param["values"]))
    if param.get("uniform") is not None:
        lo, hi = param["uniform"]
        return rng.uniform(lo, hi)
    if param.get("log_uniform") is not None:
        lo, hi = param["log_uniform"]
        return math.exp(rng.uniform(math.log(lo), math.log(hi)))
    if param.get("int_uniform") is not None:
        lo, hi = param["int_uniform"]
        return rng.randint(int(lo), int(hi))
    raise ValueError(f"a parameter needs one of values, uniform, log_uniform, int_uniform (got {sorted(param)})")


def with_params(base: Mapping[str, Any], params: Params) -> dict[str, Any]:
    """A copy of ``base`` with each path set to its value (objects created on the way)."""
    spec = copy.deepcopy(dict(base))
    for path, value in params.items():
        node = spec
        *parents, leaf = path.split(".")
        for key in parents:
            child = node.setdefault(key, {})
            if child is None:
                child = node[key] = {}
            if not isinstance(child, dict):
                raise BadPath(f"{path}: {key} is not an object in the spec")
            node = child
        node[leaf] = copy.deepcopy(value)
    return spec


def rank_key(value: float, mode: str) -> float:
    """Smaller is better; a non-finite value is the worst."""
    if not math.isfinite(value):
        return math.inf
    return value if mode == "min" else -value


def asha_keep(n: int, eta: int, at_least_one: bool = True) -> int:
    """How many of ``n`` results at a rung go on: the top floor(n / eta), at least 1 if asked
    (always in the stop form; in the promote form only once nothing else can run)."""
    return max(1, n // eta) if at_least_one else n // eta


def within_top(recorded: Sequence[float], value: float, keep: int, mode: str) -> bool:
    """Whether ``value`` (one of the results ``recorded`` at a rung) is within their top ``keep``:
    fewer than ``keep`` of them are strictly better."""
    mine = rank_key(value, mode)
    return sum(1 for other in recorded if rank_key(other, mode) < mine) < keep


def asha_continues(recorded: Sequence[float], value: float, eta: int, mode: str, stop_once: bool = True) -> bool:
    """The ASHA decision for ``value``, the newest result at a rung: whether the trial goes on at once.

    ``recorded`` holds the rung's results in the order they were recorded, ``value`` included.
    Otherwise the trial stops (``stop_once``, the stop form) or waits to be promoted (the promote
    form).
    """
    return within_top(recorded, value, asha_keep(len(recorded), eta, at_least_one=stop_once), mode)


def replay(values: Sequence[float], eta: int, mode: str, stop_once: bool = True) -> list[bool]:
    """The decisions the rule takes on the results of one rung arriving in this order."""
    return [asha_continues(values[: i + 1], v, eta, mode, stop_once) for i, v in enumerate(values)]


def promotable(recorded: Sequence[float], waiting: Sequence[int], eta: int, mode: str, at_least_one: bool) -> list[int]:
    """Which of the ``waiting`` results are within the rung's top floor(n / eta), best first.

    ``waiting`` holds indices into ``recorded``, every result of one rung; the top is at least 1
    with ``at_least_one``, and ties go in the order they were recorded.
    """
    keep = asha_keep(len(recorded), eta, at_least_one)
    chosen = [i for i in waiting if within_top(recorded, recorded[i], keep, mode)]
    return sorted(chosen, key=lambda i: (rank_key(recorded[i], mode), i))


def best(values: Mapping[str, float | None], mode: str) -> str | None:
    """The key of the best finite value (the first on a tie), or None."""
    finite = [(rank_key(v, mode), k) for k, v in values.items() if v is not None and math.isfinite(v)]
    return min(finite, key=lambda item: item[0])[1] if finite else None
