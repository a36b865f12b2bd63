"""Newton–Schulz orthogonalization: U S V^T -> U S' V^T with S' close to 1.

Two equivalent forms of the quintic iteration X <- a X + (b A + c A^2) X, A = X X^T:

* ``standard``: the iteration as written, on the m x n iterate (m <= n).
* ``gram``: every iterate is X_k = Q_k X_0 with Q_k a polynomial in R = X_0 X_0^T, so the
  loop runs on m x m matrices only and touches the m x n data twice (R once, Q_K X_0 once).
  Fewer flops for wide (or, transposed, tall) matrices; see docs/optimizer.md.

Every m x m product in both forms is symmetric (polynomials in one symmetric matrix commute),
so it is computed from three of its four half-size blocks: 3/4 of the flops.
"""

from __future__ import annotations

import functools
import math
import time
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

METHODS = ("auto", "standard", "gram")
COEFFICIENT_SETS = ("keller", "polar_express")

# "auto" picks gram once n >= GRAM_MIN_ASPECT * m: the flop model (3/4-cost symmetric
# products, 5 steps) breaks even near n = 1.3 m; measured on CPU fp32 the gain starts near 1.5.
GRAM_MIN_ASPECT = 1.5
# Low precision drifts in the gram form: rebuild R from a fresh X every 2 iterations
# (the restart of Dao-AILab/gram-newton-schulz).
GRAM_RESTART_EVERY_LOW_PRECISION = 2
# bf16 is the automatic choice only where a probe measures bf16 matrix products at least this
# much faster than fp32 (a margin against timing noise).
BF16_MIN_SPEEDUP = 1.25
# The probe: PROBE_REPEATS interleaved fp32 / bf16 products of two PROBE_SIZE^2 matrices, best of each.
PROBE_SIZE = 512
PROBE_REPEATS = 10
# /proc/cpuinfo flags of CPUs with native bf16 matrix instructions.
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
# Below this size a symmetric product is cheaper as one plain GEMM than as three blocks. In bf16
# (CPU, AVX512-BF16) the three smaller GEMMs and the copies cost more than the flops saved:
# 384 x 1536 standard iterations took 11.6 ms blocked against 9.1 ms plain, so bf16 stays plain.
SYMMETRIC_BLOCK_MIN = 128
# Clamp for the normaliser; the references' "+ 1e-7" collapses inputs with a tiny norm.
TINY = 1e-30


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
    if len(rows) == 1:
        return Schedule((rows[0],) * steps)
    if len(rows) != steps:
        raise ValueError(
            f"ns_coefficients has {len(rows)} triples but ns_steps is {steps}: give one triple or one per step"
        )
    return Schedule(tuple(rows))


def cpu_has_bf16() -> bool | None:
    """Whether /proc/cpuinfo lists a native bf16 matrix instruction set (AVX512-BF16 or AMX);
    None where there is no /proc/cpuinfo to read."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return None
    return any(flag in flags for flag in CPU_BF16_FLAGS)


def bf16_capable(device: torch.device) -> bool:
    """Whether the device has native bf16 matrix products: CUDA that supports bf16, or a CPU
    with AVX512-BF16 / AMX (a CPU whose flags cannot be read is left to the probe)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return cpu_has_bf16() is not False
    return False


def bf16_speedup(device: torch.device) -> float:
    """fp32 time / bf16 time of a PROBE_SIZE^3 matrix product on the device, best of
    PROBE_REPEATS interleaved runs each (after one warm-up); > 1 means bf16 is faster."""
    a = torch.randn(PROBE_SIZE, PROBE_SIZE, device=device)
    operands = {dtype: a.to(dtype) for dtype in (torch.float32, torch.bfloat16)}
    best = {dtype: math.inf for dtype in operands}
    for repeat in range(PROBE_REPEATS + 1):
        for dtype, x in operands.items():
            _sync(device)
            start = time.perf_counter()
            torch.mm(x, x)
            _sync(device)
            if repeat:  # the first round warms up kernels and caches
                best[dtype] = min(best[dtype], time.perf_counter() - start)
    return best[torch.float32] / best[torch.bfloat16]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@functools.cache
def auto_dtype(device: torch.device) -> torch.dtype:
    """The Newton–Schulz precision for fp32/fp16/bf16 input on a device, decided once per process:
    bf16 where the device has native bf16 products and the probe measures them at least
    BF16_MIN_SPEEDUP faster than fp32; fp32 everywhere else."""
    if bf16_capable(device) and bf16_speedup(device) >= BF16_MIN_SPEEDUP:
        return torch.bfloat16
    return torch.float32


def default_dtype(G: Tensor) -> torch.dtype:
    """The working precision for G when none is given: fp64 for fp64 input, else auto_dtype."""
    if G.dtype == torch.float64:
        return torch.float64
    return auto_dtype(G.device)


def choose_method(m: int, n: int, method: str = "auto", dtype: torch.dtype = torch.float32) -> str:
    """The NS form for an m x n iterate (m <= n) in ``dtype``: ``auto`` takes gram where it needs
    fewer flops and the precision is 32 bits or more. In bf16 the gram form (even with restarts)
    leaves the T2/T3 bands by a few 1e-3 on every shape measured, the standard form stays inside."""
    if method not in METHODS:
        raise ValueError(f"ns_method must be one of {METHODS}, got {method!r}")
    if method != "auto":
        return method
    wide_enough = n >= GRAM_MIN_ASPECT * m
    return "gram" if wide_enough and torch.finfo(dtype).bits >= 32 else "standard"


def orthogonalize(
    G: Tensor,
    steps: int = 5,
    coefficients: str | Sequence = "keller",
    method: str = "auto",
    dtype: torch.dtype | None = None,
    *,
    overwrite_input: bool = False,
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """Approximate the orthogonal polar factor of G over its last two dims.

    G: [..., rows, cols], any leading batch dims. Returns a tensor of G's shape and dtype whose
    singular values lie in the coefficient set's band (Keller about [0.68, 1.14], Polar Express
    about [0.855, 1.143]) with G's singular vectors. Zero input gives exact zeros. Runs in
    ``dtype``; None is the automatic choice (fp64 for fp64 input, else :func:`auto_dtype`: bf16
    where the device measures faster in bf16, fp32 elsewhere). The norm is always taken in fp32
    or wider. ``overwrite_input=True`` lets it normalise G in place (one copy less: the
    optimizer's own stacked batch); ``out_dtype`` (default G's dtype) saves the optimizer a
    conversion.
    """
    if G.ndim < 2:
        raise ValueError(f"orthogonalize needs at least 2 dims, got shape {tuple(G.shape)}")
    schedule = resolve_coefficients(coefficients, steps)
    work_dtype = dtype or default_dtype(G)
    rows, cols = G.shape[-2:]
    tall = rows > cols
    X = G.mT if tall else G
    m, n = X.shape[-2:]
    X = X.reshape(-1, m, n)  # [B, m, n], m <= n
    X = normalize(X, schedule.norm_factor, in_place=overwrite_input).to(work_dtype)
    form = choose_method(m, n, method, work_dtype)
    if form == "gram":
        restart = GRAM_RESTART_EVERY_LOW_PRECISION if torch.finfo(work_dtype).bits < 32 else None
        X = _gram_newton_schulz(X, schedule.steps, restart)
    else:
        X = _standard_newton_schulz(X, schedule.steps)
    X = X.reshape(*G.shape[:-2], m, n)
    return (X.mT if tall else X).to(out_dtype or G.dtype)


def normalize(X: Tensor, factor: float = 1.0, in_place: bool = False) -> Tensor:
    """X / (factor * ||X||_F) per matrix of a [B, m, n] batch, computed in fp32 (or fp64).

    Scaling by the max-abs entry first keeps the norm free of underflow (a matrix with
    Frobenius norm 1e-20 has squares below fp32's range) and of overflow; zero stays zero.
    """
    wide = torch.float64 if X.dtype == torch.float64 else torch.float32
    peak = torch.linalg.vector_norm(X, ord=float("inf"), dim=(-2, -1), keepdim=True, dtype=wide)
    peak = peak.clamp_min(TINY)
    Y = X.div_(peak) if in_place and X.dtype == wide else X.to(wide) / peak  # entries in [-1, 1]
    norm = torch.linalg.vector_norm(Y, dim=(-2, -1), keepdim=True)
    return Y.div_((norm * factor).clamp_min(TINY))


def _standard_newton_schulz(X: Tensor, steps: Sequence[Triple]) -> Tensor:
    # X: [B, m, n], m <= n. Per step: A = X X^T, B = b A + c A^2, X = a X + B X.
    for a, b, c in steps:
        A = symmetric_matmul(X, X.mT)  # [B, m, m]
        B = symmetric_matmul(A, A, add=A, alpha=c, beta=b)  # [B, m, m]
        X = torch.baddbmm(X, B, X, beta=a)  # [B, m, n]
    return X


def _gram_newton_schulz(X: Tensor, steps: Sequence[Triple], restart: int | None) -> Tensor:
    # X: [B, m, n], m <= n. S_k = X_k X_k^T, P_k = a I + b S_k + c S_k^2,
    # Q_{k+1} = P_k Q_k, S_{k+1} = P_k S_k P_k; X_K = Q_K X_0 (all m x m but the ends).
    S = symmetric_matmul(X, X.mT)  # [B, m, m]
    Q = None
    last = len(steps) - 1
    for k, (a, b, c) in enumerate(steps):
        P = symmetric_matmul(S, S, add=S, alpha=c, beta=b)
        P.diagonal(dim1=-2, dim2=-1).add_(a)
        Q = P if Q is None else symmetric_matmul(P, Q)
        if k == last:
            break
        if restart and (k + 1) % restart == 0:
            X = torch.bmm(Q, X)
            S, Q = symmetric_matmul(X, X.mT), None
        else:
            S = symmetric_matmul(P, symmetric_matmul(P, S))
    return torch.bmm(Q, X)


def symmetric_matmul(A: Tensor, B: Tensor, add: Tensor | None = None, alpha: float = 1.0, beta: float = 0.0) -> Tensor:
    """beta * add + alpha * (A @ B) for [B, m, k] x [B, k, m] whose result is symmetric.

    Computes the top half-rows and the bottom-right block (3/4 of the GEMM flops) and mirrors
    the bottom-left block, so the result is exactly symmetric; small or 16-bit products are one
    plain GEMM.
    """
    m = A.shape[-2]
    if m < SYMMETRIC_BLOCK_MIN or A.element_size() < 4:
        if add is None:
            return torch.bmm(A, B) if alpha == 1.0 else torch.bmm(A, B).mul_(alpha)
        return torch.baddbmm(add, A, B, beta=beta, alpha=alpha)
    h = m // 2
    if add is None:
        upper = torch.bmm(A[:, :h], B)  # [B, h, m]
        lower = torch.bmm(A[:, h:], B[:, :, h:])  # [B, m-h, m-h]
        if alpha != 1.0:
            upper.mul_(alpha)
            lower.mul_(alpha)
    else:
        upper = torch.baddbmm(add[:, :h], A[:, :h], B, beta=beta, alpha=alpha)
        lower = torch.baddbmm(add[:, h:, h:], A[:, h:], B[:, :, h:], beta=beta, alpha=alpha)
    return torch.cat([upper, torch.cat([upper[:, :, h:].mT, lower], dim=2)], dim=1)


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
