"""Newton–Schulz coefficients: the named sets, their resolution into one (a, b, c) per iteration,
and what an iteration does to one singular value (the scalar map and its output band)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

Triple = tuple[float, float, float]

# Keller Jordan, "Muon: an optimizer for hidden layers" (KellerJordan/Muon): maximal slope at 0.
KELLER: Triple = (3.4445, -4.7750, 2.0315)

# Polar Express (arXiv 2505.16932), the 5-iteration table of modded-nanogpt and microsoft/dion
# (safety factor 2e-2, cushion 2); inputs are normalised by 1.02 x the Frobenius norm.
POLAR_EXPRESS: tuple[Triple, ...] = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
POLAR_EXPRESS_NORM_FACTOR = 1.02

COEFFICIENT_SETS = ("keller", "polar_express")


@dataclass(frozen=True)
class Schedule:
    """Resolved coefficients: one (a, b, c) per iteration and the normalisation factor."""

    steps: tuple[Triple, ...]
    norm_factor: float = 1.0


def resolve_coefficients(coefficients: str | Sequence, steps: int) -> Schedule:
    """Turn a coefficient name or explicit triples into one (a, b, c) per iteration.

    ``"keller"`` repeats one triple; ``"polar_express"`` takes its table (repeating the last
    row past 5 steps); an explicit sequence is either one triple (repeated) or one per step.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"ns_steps must be a positive integer, got {steps!r}")
    if isinstance(coefficients, str):
        if coefficients == "keller":
            return Schedule((KELLER,) * steps)
        if coefficients == "polar_express":
            table = POLAR_EXPRESS[:steps] + (POLAR_EXPRESS[-1],) * max(0, steps - len(POLAR_EXPRESS))
            return Schedule(table, POLAR_EXPRESS_NORM_FACTOR)
        raise ValueError(
            f"ns_coefficients must be one of {COEFFICIENT_SETS} or a sequence of (a, b, c), got {coefficients!r}"
        )
    try:
        rows = [tuple(float(v) for v in row) for row in coefficients]
    except TypeError:
        rows = None  # a flat triple (a, b, c): its items are numbers, not rows
    if rows is None:
        try:
            rows = [tuple(float(v) for v in coefficients)]
        except (TypeError, ValueError):
            raise ValueError(f"ns_coefficients is not a sequence of (a, b, c): {coefficients!r}") from None
    if not rows or any(len(r) != 3 or not all(math.isfinite(v) for v in r) for r in rows):
        raise ValueError(f"ns_coefficients must be finite (a, b, c) triples, got {coefficients!r}")
    triples = [(a, b, c) for a, b, c in rows]
    if len(triples) == 1:
        return Schedule((triples[0],) * steps)
    if len(triples) != steps:
        raise ValueError(
            f"ns_coefficients has {len(triples)} triples but ns_steps is {steps}: give one triple or one per step"
        )
    return Schedule(tuple(triples))


def scalar_map(x: Tensor, coefficients: str | Sequence = "keller", steps: int = 5) -> Tensor:
    """What the iteration does to one singular value: x <- a x + b x^3 + c x^5, per step.

    x is a singular value of the normalised input (in [0, 1]); use it to read a coefficient
    set's output band without building matrices.
    """
    for a, b, c in resolve_coefficients(coefficients, steps).steps:
        x2 = x * x
        x = x * (a + x2 * (b + c * x2))
    return x


def singular_value_band(
    coefficients: str | Sequence = "keller", steps: int = 5, low: float = 1e-3, points: int = 100_001
) -> tuple[float, float]:
    """(min, max) of the scalar map over normalised singular values in [low, 1], in float64."""
    norm_factor = resolve_coefficients(coefficients, steps).norm_factor
    x = torch.linspace(low, 1.0, points, dtype=torch.float64) / norm_factor
    y = scalar_map(x, coefficients, steps)
    return float(y.min()), float(y.max())
