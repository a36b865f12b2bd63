"""Newton–Schulz orthogonalization: U S V^T -> U S' V^T with S' close to 1.

Two equivalent forms of the quintic iteration X <- a X + (b A + c A^2) X, A = X X^T:

* ``standard``: the iteration as written, on the m x n iterate (m <= n).
* ``gram``: every iterate is X_k = Q_k X_0 with Q_k a polynomial in R = X_0 X_0^T, so the
  loop runs on m x m matrices only and touches the m x n data twice (R once, Q_K X_0 once).
  Fewer flops for wide (or, transposed, tall) matrices; see docs/optimizer.md.

Every product writes into scratch carved once per call (:class:`Scratch`): given one that lives
across calls, as the optimizer's does, a step allocates nothing. The Gram form needs four m x m
matrices and computes its result in place, a block of m columns at a time; the standard form
two m x m matrices and one m x n.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from .coefficients import Triple, resolve_coefficients
from .precision import default_dtype
from .scratch import Scratch, fit

METHODS = ("auto", "standard", "gram")

# "auto" picks gram once n >= GRAM_MIN_ASPECT * m: 5 steps cost 10 m^2 n + 5 m^3 multiply-adds in the
# standard form and 2 m^2 n + 17 m^3 in the gram form, even at n = 1.5 m (and measured so on CPU fp32).
GRAM_MIN_ASPECT = 1.5
# On CUDA the gram form's extra, smaller products cost launches the host must issue: "auto" takes it
# there only from this many rows. Measured on an H100 (docs/optimizer.md): with m = 384 it lost in
# every precision (the GPT-shaped set's stacks in fp16: 3.4 against 2.2 ms), with m = 1024 and
# batches of 12 it won where the matrix is 4x wider (2.5 against 3.2 ms in fp16) and tied at 3x.
GRAM_MIN_ROWS_CUDA = 1024
# The gram form needs fp16's 10-bit mantissa or more: in bf16 (7 bits) it left the T2/T3 bands by a
# few 1e-3 on every shape measured, in fp16 it stays inside with one restart (docs/optimizer.md).
GRAM_MIN_MANTISSA_BITS = 10
# 16 bits drift in the gram form: R is rebuilt from a fresh X = Q X_0 every this many iterations
# (the restart of Dao-AILab/gram-newton-schulz; once in five steps for fp16, twice for bf16).
GRAM_RESTART_EVERY = {torch.float16: 3, torch.bfloat16: 2}
# From this size on a symmetric product is computed as three blocks (3/4 of the flops); below it
# as one plain GEMM. On CPU fp32 the half-size GEMMs of m = 128 ran no faster than the plain one
# at 1 thread and slower at 2; from m = 256 the blocks gained a few per cent (docs/optimizer.md).
SYMMETRIC_BLOCK_MIN = 256
# ... and for elements of this many bytes or more: in 16 bits the three smaller GEMMs cost more than
# they save, in bf16 on CPU and in fp16 on an H100 (a 151 M-parameter step 14.5 against 13.0 ms;
# docs/optimizer.md, "Symmetric products").
SYMMETRIC_BLOCK_MIN_BYTES = 4
# The Gram form's final product Q X_0 of a batch up to this many bytes goes into a matrix of its own
# in one product; a larger one runs in place, a block of m columns at a time, so that its scratch
# stays four m x m matrices. On CPU fp32 (2 threads) one product of 4 x 128 x 512 took 0.53 ms
# against 0.79 ms in blocks; at 1 x 384 x 1536 the two were within 5%.
GRAM_WHOLE_PRODUCT_BYTES = 1 << 20
# Clamp for the normaliser; the references' "+ 1e-7" collapses inputs with a tiny norm.
TINY = 1e-30
# A norm in this range was summed without a square leaving fp32's range (:func:`normalize`).
SAFE_NORM_LOW, SAFE_NORM_HIGH = 2.0**-40, 2.0**40


def choose_method(
    m: int, n: int, method: str = "auto", dtype: torch.dtype = torch.float32, device_type: str = "cpu"
) -> str:
    """The NS form for an m x n iterate (m <= n) in ``dtype`` on a ``device_type`` device.

    ``auto`` takes gram where it needs fewer flops and the precision has fp16's mantissa or a
    longer one (fp16, fp32, fp64); on CUDA only from GRAM_MIN_ROWS_CUDA rows, where the flops
    saved outweigh the launches added. In bf16 the gram form (even with restarts) leaves the
    T2/T3 bands by a few 1e-3 on every shape measured, the standard form stays inside.
    """
    if method not in METHODS:
        raise ValueError(f"ns_method must be one of {METHODS}, got {method!r}")
    if method != "auto":
        return method
    wide_enough = n >= GRAM_MIN_ASPECT * m and (device_type != "cuda" or m >= GRAM_MIN_ROWS_CUDA)
    return "gram" if wide_enough and mantissa_bits(dtype) >= GRAM_MIN_MANTISSA_BITS else "standard"


def mantissa_bits(dtype: torch.dtype) -> int:
    """The explicit mantissa bits of a floating-point dtype: bf16 7, fp16 10, fp32 23, fp64 52."""
    return -round(math.log2(torch.finfo(dtype).eps))


def orthogonalize(
    G: Tensor,
    steps: int = 5,
    coefficients: str | Sequence = "keller",
    method: str = "auto",
    dtype: torch.dtype | None = None,
    *,
    overwrite_input: bool = False,
    out_dtype: torch.dtype | None = None,
    scratch: Scratch | None = None,
) -> Tensor:
    """Approximate the orthogonal polar factor of G over its last two dims.

    G: [..., rows, cols], any leading batch dims. Returns a tensor of G's shape and dtype whose
    singular values lie in the coefficient set's band (Keller about [0.68, 1.14], Polar Express
    about [0.855, 1.143]) with G's singular vectors. Zero input gives exact zeros. Runs in
    ``dtype``; None is the automatic choice (fp64 for fp64 input, else :func:`auto_dtype`: fp16
    on CUDA and bf16 on CPU where the device measures it faster, fp32 elsewhere). The norm is
    always taken in fp32 or wider. ``out_dtype`` is the result's dtype (default G's).
    ``overwrite_input=True`` lets it use G's memory: to normalise G in place (one copy less: the
    optimizer's own stacked batch) and to hold the result. With a ``scratch`` the work allocates
    nothing once the scratch has grown, and the result may be a view into the scratch or into G
    (valid until the scratch's next use); without one the result is a tensor of its own.
    """
    if G.ndim < 2:
        raise ValueError(f"orthogonalize needs at least 2 dims, got shape {tuple(G.shape)}")
    schedule = resolve_coefficients(coefficients, steps)
    work_dtype = dtype or default_dtype(G)
    rows, cols = G.shape[-2:]
    m, n = min(rows, cols), max(rows, cols)
    form = choose_method(m, n, method, work_dtype, G.device.type)
    # The standard form runs in the input's own orientation (a tall batch as X <- a X + X (b A + c A^2),
    # A = X^T X), so no transposed copy is ever made; the gram form works on the wide view.
    transposed = rows > cols and form == "gram"
    X = G.mT if transposed else G
    X = X.reshape(-1, *X.shape[-2:])  # [B, r, c]
    own_scratch = scratch is None
    out_dtype = out_dtype or G.dtype
    # A lower working precision reads the input once (into its own copy), so G's memory is free
    # until the result is converted back into it: it holds what of the iteration's matrices fits.
    narrower = torch.finfo(work_dtype).bits < torch.finfo(G.dtype).bits
    reuse = overwrite_input and not own_scratch and narrower and out_dtype == G.dtype and X.data_ptr() == G.data_ptr()
    X, mats = _carve(
        X, schedule.norm_factor, work_dtype, form, scratch or Scratch(), in_place=overwrite_input, reuse_input=reuse
    )
    first = X
    if form == "gram":
        restart = GRAM_RESTART_EVERY.get(work_dtype)
        X = _gram_newton_schulz(X, schedule.steps, restart, mats)
    else:
        X = _standard_newton_schulz(X, schedule.steps, mats)
    if reuse and X.data_ptr() != first.data_ptr():  # the result lies in G's memory: out of it before G is written
        X = first.copy_(X)
    X = X.reshape(*G.shape[:-2], *X.shape[-2:])
    out = X.mT if transposed else X
    if own_scratch:  # a tensor of its own, not a view that keeps the scratch alive
        return torch.empty(out.shape, dtype=out_dtype, device=out.device).copy_(out)
    if out.dtype != out_dtype and overwrite_input and G.dtype == out_dtype:
        return G.copy_(out)  # converted into G's own memory rather than a new tensor
    return out.to(out_dtype)


def _carve(
    X: Tensor,
    factor: float,
    work_dtype: torch.dtype,
    form: str,
    scratch: Scratch,
    in_place: bool,
    reuse_input: bool = False,
) -> tuple[Tensor, list]:
    """The iterate [B, r, c] normalised (by ``factor`` x its norm) in the working precision, and
    the form's matrices: S, P, Q, W [B, m, m] for gram (and the result [B, r, c] when it is
    small); A, P [B, m, m] and the next iterate [B, r, c] for standard (m = min(r, c)).

    The input is converted to the working precision and normalised there (:func:`normalize`: the
    norm is summed in fp32 or wider): in X itself where allowed and X is in that precision, else
    in the scratch. fp16, whose range cannot hold an unnormalised gradient, is the exception: the
    input is normalised in fp32 first, then converted. With ``reuse_input`` (X contiguous, wider
    than the working precision and free once converted) the form's matrices go into X's own
    memory as far as they fit (standard form in bf16: A and P always, the next iterate too from
    n >= 2m)."""
    B, r, c = X.shape
    mats = _form_shapes(B, r, c, form, work_dtype)
    norm_dtype = normalizing_dtype(X.dtype, work_dtype)
    if in_place and X.dtype == norm_dtype:
        X = normalize(X, factor)
        if norm_dtype == work_dtype:
            return X, scratch.carve(work_dtype, X.device, *mats)
    elif norm_dtype != work_dtype:  # fp16 work: normalised in fp32 first
        (normalized,) = scratch.carve(norm_dtype, X.device, X.shape)
        X = normalize(X, factor, dst=normalized)
    elif torch.finfo(work_dtype).bits >= 32:  # straight into the scratch, one pass
        normalized, *views = scratch.carve(work_dtype, X.device, X.shape, *mats)
        return normalize(X, factor, dst=normalized), views
    # Convert into the working precision (then normalise there, unless that was done above).
    if reuse_input and X.is_contiguous():
        inside, rest = fit(X.view(-1).view(work_dtype), mats)
        low, *outside = scratch.carve(work_dtype, X.device, X.shape, *rest)
        low.copy_(X)  # from here on X's memory is free
        views = inside + outside
    else:
        low, *views = scratch.carve(work_dtype, X.device, X.shape, *mats)
        low.copy_(X)
    return (low if norm_dtype != work_dtype else normalize(low, factor)), views


def _form_shapes(B: int, r: int, c: int, form: str, work_dtype: torch.dtype) -> list[tuple[int, int, int]]:
    """The matrices the form iterates with on a [B, r, c] batch (:func:`_carve`)."""
    m = min(r, c)
    if form == "gram":  # S, P, Q, W, and the result's own matrix if it is small
        whole = B * r * c * torch.finfo(work_dtype).bits // 8 <= GRAM_WHOLE_PRODUCT_BYTES
        return [(B, m, m)] * 4 + [(B, r, c)] * whole
    return [(B, m, m), (B, m, m), (B, r, c)]


def working_bytes(rows: int, cols: int, dtype: torch.dtype, method: str = "auto", device_type: str = "cpu") -> int:
    """Bytes a rows x cols matrix takes in :func:`orthogonalize`'s scratch in ``dtype``: its
    input converted to ``dtype`` and the form's matrices (as a batch of one)."""
    form = choose_method(min(rows, cols), max(rows, cols), method, dtype, device_type)
    shapes = [(1, rows, cols), *_form_shapes(1, rows, cols, form, dtype)]
    return sum(math.prod(shape) for shape in shapes) * torch.finfo(dtype).bits // 8


def normalizing_dtype(input_dtype: torch.dtype, work_dtype: torch.dtype) -> torch.dtype:
    """The precision an input is normalised in; the optimizer stacks its batches in it.

    The working precision where it keeps fp32's range (:func:`keeps_range`), so the input is
    converted first; else (fp16) fp32, or fp64 for fp64 input, and the normalised input is
    converted after.
    """
    return work_dtype if keeps_range(work_dtype) else torch.promote_types(input_dtype, torch.float32)


def keeps_range(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` has fp32's exponent range or a wider one (bf16, fp32, fp64).

    They have the same smallest normal number or a smaller one, so that a gradient may be converted
    to such a dtype before it is normalised; fp16's smallest normal is 6e-5.
    """
    return torch.finfo(dtype).tiny <= torch.finfo(torch.float32).tiny


def normalize(X: Tensor, factor: float = 1.0, *, dst: Tensor | None = None) -> Tensor:
    """X / (factor * ||X||_F) per matrix of a [B, m, n] batch, written into ``dst`` (default: X,
    in place). ``dst`` must be fp32 or wider, or X itself in a precision with fp32's range (bf16).

    The squares are summed in fp32 or wider (a bf16 norm is then rounded to bf16). Where that sum
    could leave fp32's range (a norm outside [2^-40, 2^40]: squares below 2^-126 would be lost,
    above 2^128 overflow), X is first divided by a power of two near its largest entry (exact in
    any binary precision) and the norm taken again; zero stays zero. On CPU that check is a host
    read of B numbers and a usual gradient is read once for its norm; on an accelerator, where a
    host read would wait for the queue, every batch is rescaled. The largest entry is
    max(max, -min): two vectorised reductions, where a max-abs norm is not vectorised on CPU
    (about 20x slower).
    """
    dst = X if dst is None else dst
    if dst.element_size() < 4 and not (dst is X and keeps_range(X.dtype)):
        raise ValueError(f"normalize writes fp32 or wider, or a {X.dtype} X in place with fp32's range")
    dims = (-2, -1)
    norm = None
    if X.device.type == "cpu":
        norm = torch.linalg.vector_norm(X, dim=dims, keepdim=True, dtype=None if dst.dtype == X.dtype else dst.dtype)
        if not bool(((norm >= SAFE_NORM_LOW) & (norm <= SAFE_NORM_HIGH)).all()):
            norm = None
    if norm is None:
        peak = torch.maximum(X.amax(dim=dims, keepdim=True), X.amin(dim=dims, keepdim=True).neg())
        wide = torch.promote_types(peak.dtype, torch.float32)
        power = torch.exp2(torch.floor(torch.log2(peak.to(wide)))).clamp_min(TINY)
        X = torch.div(X, power.to(dst.dtype), out=dst)  # largest entry in [1, 2): every bit kept
        norm = torch.linalg.vector_norm(X, dim=dims, keepdim=True)
    return torch.div(X, (norm * factor).clamp_min(TINY), out=dst)


def _standard_newton_schulz(X: Tensor, steps: Sequence[Triple], mats: list[Tensor]) -> Tensor:
    # X: [B, r, c]. Per step, wide (r <= c): A = X X^T, P = b A + c A^2, X = a X + P X; tall: A = X^T X,
    # X = a X + X P. Into Y, then swapped.
    A, P, Y = mats
    tall = X.shape[-2] > X.shape[-1]
    for a, b, c in steps:
        symmetric_product(*((X.mT, X) if tall else (X, X.mT)), A)  # [B, m, m]
        symmetric_product(A, A, P, add=A, alpha=c, beta=b)  # [B, m, m]
        torch.baddbmm(X, *((X, P) if tall else (P, X)), beta=a, out=Y)  # [B, r, c]
        X, Y = Y, X
    return X


def _gram_newton_schulz(X: Tensor, steps: Sequence[Triple], restart: int | None, mats: list[Tensor]) -> Tensor:
    # X: [B, m, n], m <= n, overwritten with the result. S_k = X_k X_k^T, P_k = a I + b S_k + c S_k^2,
    # Q_{k+1} = P_k Q_k, S_{k+1} = P_k (P_k S_k); X_K = Q_K X_0. All [B, m, m] but the ends; W is the
    # temporary every product needs (out= may not alias its inputs); a small result gets a matrix of its own.
    S, P, Q, W, *result = mats
    symmetric_product(X, X.mT, S)
    fresh = True  # Q is still the identity
    last = len(steps) - 1
    for k, (a, b, c) in enumerate(steps):
        symmetric_product(S, S, P, add=S, alpha=c, beta=b)
        P.diagonal(dim1=-2, dim2=-1).add_(a)
        if fresh:
            Q.copy_(P)
        else:
            symmetric_product(P, Q, W)
            Q, W = W, Q
        fresh = False
        if k == last:
            break
        if restart and (k + 1) % restart == 0:
            _left_multiply_(Q, X, W)
            symmetric_product(X, X.mT, S)
            fresh = True
        else:
            symmetric_product(P, S, W)
            symmetric_product(P, W, S)
    return torch.bmm(Q, X, out=result[0]) if result else _left_multiply_(Q, X, W)


def symmetric_product(
    A: Tensor, B: Tensor, out: Tensor, add: Tensor | None = None, alpha: float = 1.0, beta: float = 0.0
) -> Tensor:
    """out = beta * add + alpha * (A @ B) for [B, m, k] x [B, k, m] products known to be symmetric.

    From SYMMETRIC_BLOCK_MIN rows on, in fp32 and wider (SYMMETRIC_BLOCK_MIN_BYTES), only the top
    half-rows and the bottom-right block are multiplied (3/4 of the flops) and the bottom-left block
    is mirrored, which also makes the result exactly symmetric; smaller or 16-bit products are one
    plain GEMM. ``out`` must not alias A or B; every block is written straight into it.
    """
    m = A.shape[-2]
    if m < SYMMETRIC_BLOCK_MIN or A.element_size() < SYMMETRIC_BLOCK_MIN_BYTES:
        if add is None:
            return torch.bmm(A, B, out=out) if alpha == 1.0 else torch.bmm(A, B, out=out).mul_(alpha)
        return torch.baddbmm(add, A, B, beta=beta, alpha=alpha, out=out)
    h = m // 2
    if add is None:
        torch.bmm(A[:, :h], B, out=out[:, :h])  # [B, h, m]
        torch.bmm(A[:, h:], B[:, :, h:], out=out[:, h:, h:])  # [B, m-h, m-h]
        if alpha != 1.0:
            out[:, :h].mul_(alpha)
            out[:, h:, h:].mul_(alpha)
    else:
        torch.baddbmm(add[:, :h], A[:, :h], B, beta=beta, alpha=alpha, out=out[:, :h])
        torch.baddbmm(add[:, h:, h:], A[:, h:], B[:, :, h:], beta=beta, alpha=alpha, out=out[:, h:, h:])
    out[:, h:, :h].copy_(out[:, :h, h:].mT)
    return out


def _left_multiply_(M: Tensor, X: Tensor, W: Tensor) -> Tensor:
    """X <- M X in place ([B, m, m] x [B, m, n]), a block of W's m columns at a time through W:
    each column block of the product depends only on the same block of X."""
    n, width = X.shape[-1], W.shape[-1]
    for j in range(0, n, width):
        block = X[:, :, j : j + width]  # [B, m, w]
        tmp = W.view(-1)[: block.numel()].view(block.shape)
        torch.bmm(M, block, out=tmp)
        block.copy_(tmp)
    return X
