"""One Muon step's batches: each parameter viewed as matrices, same-shape matrices stacked into
one Newton–Schulz input.

A parameter is its matrices (:func:`as_matrices`) or, split by attention heads, blocks of its rows
(:func:`row_blocks`): each block is orthogonalized on its own.

Each matrix is stacked in its own orientation and in the Newton–Schulz working precision, and
batches are bounded in bytes. The orthogonalized updates are applied back to each parameter,
with the finite check decided on the device.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .hyperparams import update_scale
from .scratch import Scratch
from .stats import StepStats

# An op that mixes precisions (an fp32 gradient lerped into a bf16 stack, a bf16 update added to
# an fp32 parameter) converts through a temporary as large as its operands. On CPU such ops run
# on blocks of rows of about this many elements, so that the temporaries stay small (256 KiB in
# fp32) and in cache; on CUDA memory is not the bound but launches are: one op per matrix.
MIXED_BLOCK = 1 << 16


def matrix_shape(shape: Sequence[int], experts: bool) -> tuple[int, int, int]:
    """The batch of matrices [k, rows, cols] a Muon parameter of this shape is orthogonalized as.

    2D -> [1, out, in]; experts [E, out, in] -> itself (one matrix per expert);
    any other >2D weight (conv) -> [1, out, prod(rest)].
    """
    if experts:
        k, rows, cols = shape
        return k, rows, cols
    return 1, shape[0], math.prod(shape[1:])


def grad_of(p: Tensor) -> Tensor:
    """The gradient of a parameter the step works on (it keeps only the parameters that have one)."""
    grad = p.grad
    if grad is None:
        raise RuntimeError("a parameter without a gradient reached the optimizer step")
    return grad


def as_matrices(t: Tensor, experts: bool) -> Tensor:
    """View a Muon parameter (or its gradient) as its batch of matrices (:func:`matrix_shape`)."""
    if experts:
        return t
    if t.ndim == 2:
        return t.unsqueeze(0)  # the same view as the reshape below, at half its cost (twice per matrix per step)
    return t.reshape(matrix_shape(t.shape, experts))


def row_blocks(matrices: Tensor, heights: Sequence[int]) -> list[tuple[slice, Tensor]]:
    """A [1, rows, cols] matrix view cut into blocks of rows of the given ``heights`` (summing to
    rows), each run of equal heights as one [k, height, cols] view (no copy) with the rows it covers."""
    cols, out, start = matrices.shape[-1], [], 0
    for height, run in itertools.groupby(heights):
        k = len(list(run))
        out.append((slice(start, start + k * height), matrices[0, start : start + k * height].view(k, height, cols)))
        start += k * height
    return out


@dataclass
class Entry:
    """Matrices [k, rows, cols] of one Muon parameter, orthogonalized in one batch: the whole
    parameter (k = E for expert weights) or a run of its row blocks (split by heads)."""

    param: Tensor  # the parameter itself: its optimizer state's key
    weight: Tensor  # the matrices, a view into param
    grad: Tensor
    buf: Tensor
    scale: float  # lr multiplier from the matrix shape (adjust_lr)
    share: float  # each matrix's share of the parameter (1 / its matrices): update_rms counts a parameter once
    rows: slice  # the rows of the parameter's matrix view these matrices hold (slice(None): all)


def entries_of(p: Tensor, buf: Tensor, experts: bool, heights: Sequence[int] | None, adjust_lr: str) -> list[Entry]:
    """A parameter (with its momentum ``buf``) as the step orthogonalizes it: its matrices whole
    (:func:`as_matrices`), or cut into row blocks of ``heights``, each run of equal blocks an entry
    with the lr scale of its own shape."""
    w, g, b = (as_matrices(t, experts) for t in (p, grad_of(p), buf))
    parts: list[tuple[slice, Tensor, Tensor, Tensor]] = [(slice(None), w, g, b)]
    if heights is not None:
        cut = zip(row_blocks(w, heights), row_blocks(g, heights), row_blocks(b, heights))
        parts = [(rows, wk, gk, bk) for (rows, wk), (_, gk), (_, bk) in cut]
    share = 1.0 / sum(part[1].shape[0] for part in parts)
    return [
        Entry(p, wk, gk, bk, update_scale(wk.shape[-2], wk.shape[-1], adjust_lr), share, rows)
        for rows, wk, gk, bk in parts
    ]


def nesterov_input(entries: list[Entry], beta: float, nesterov: bool, stack: Scratch, dtype: torch.dtype) -> Tensor:
    """Stack the entries' NS inputs into a [B, rows, cols] view of ``stack`` in ``dtype``."""
    first = entries[0].grad
    batch = sum(e.grad.shape[0] for e in entries)
    (X,) = stack.carve(dtype, first.device, (batch, *first.shape[-2:]))
    i = 0
    for e in entries:
        k = e.grad.shape[0]
        if nesterov:  # (1 - beta) g + beta m
            in_blocks(X[i : i + k], lambda out, g, m: torch.lerp(g, m, beta, out=out), e.grad, e.buf)
        else:
            X[i : i + k].copy_(e.buf)
        i += k
    return X


def apply_updates(
    entries: list[Entry], O: Tensor, lr: float, weight_decay: float, stats: StepStats, cautious: bool = False
) -> None:
    """W <- W (1 - lr wd) - lr scale O per parameter, leaving unchanged any whose update is not
    finite. Decided on the device: no host sync on an accelerator (its kernels stay queued).
    ``cautious``: the decay only where O and W agree in sign (:func:`cautious_decay`)."""
    # A bf16 update's norm is summed in fp32 and rounded to bf16 (update_rms then holds about 3
    # digits); asking for an fp32 result would first copy the whole batch into fp32.
    sq = torch.linalg.vector_norm(O, dim=(1, 2)).to(torch.promote_types(O.dtype, torch.float32)).square()
    keep = sq.isfinite()  # [B] per matrix; an entry of k > 1 matrices is kept whole or not at all
    first = 0
    for e in entries:
        k = e.grad.shape[0]
        if k > 1:
            keep[first : first + k] = keep[first : first + k].all()
        first += k
    if O.device.type != "cpu" or not bool(keep.all()):  # on CPU the check costs no wait
        O.masked_fill_(~keep.view(-1, 1, 1), 0.0)  # a skipped parameter gets a zero update
    by_scale: dict[float, tuple[list[Tensor], list[Tensor]]] = defaultdict(lambda: ([], []))
    weights, shares, first = [], [], 0  # per matrix: (lr * scale)^2, and 1 / k (so a parameter counts once)
    for e in entries:
        k = e.grad.shape[0]
        weights += [(lr * e.scale) ** 2] * k
        shares += [e.share] * k
        update = O[first : first + k]
        if weight_decay and cautious:  # a skipped update is zero: it agrees with no weight
            cautious_decay(e.weight, update, lr * weight_decay)
        elif weight_decay:  # decoupled, with the unadjusted lr; skipped with the update
            e.weight.mul_(torch.where(keep[first], 1.0 - lr * weight_decay, 1.0))
        if update.dtype != e.weight.dtype and e.weight.is_contiguous():
            alpha = -lr * e.scale
            in_blocks(e.weight, lambda p, u, alpha=alpha: p.add_(u, alpha=alpha), update)
        else:
            params, updates = by_scale[e.scale]
            params.append(e.weight)
            updates.append(update)
        first += k
    for scale, (params, updates) in by_scale.items():  # one call per lr multiplier, not one per parameter
        torch._foreach_add_(params, updates, alpha=-lr * scale)
    stats.record(sq, keep, weights, shares, O[0].numel())  # summed once per step (StepStats.settle)


def cautious_decay(param: Tensor, update: Tensor, decay: float) -> None:
    """Cautious weight decay (Chen et al., arXiv 2510.12402): W <- W (1 - decay) where the update
    (the direction subtracted from W) and W agree in sign, W unchanged elsewhere; in place."""
    in_blocks(param, lambda w, u: w.sub_(w * (u * w > 0), alpha=decay), update)


def in_blocks(out: Tensor, op: Callable[..., object], *operands: Tensor) -> None:
    """``op(out, *operands)`` on [k, rows, cols] tensors of one shape; where their precisions
    differ on CPU, on blocks of about MIXED_BLOCK elements (whole rows) at a time."""
    cols = out.shape[-1]
    tensors = [t.flatten(0, -2) for t in (out, *operands)]  # [k * rows, cols]
    mixed = any(t.dtype != out.dtype for t in operands) and out.device.type == "cpu"
    step = max(1, MIXED_BLOCK // cols) if mixed else tensors[0].shape[0]
    for start in range(0, tensors[0].shape[0], step):
        op(*(t[start : start + step] for t in tensors))


def split_batches(entries: list[Entry], sizes: list[int], max_bytes: int) -> list[list[Entry]]:
    """Split a bucket into batches whose ``sizes`` (bytes per entry) sum to at most ``max_bytes``
    (at least one entry each)."""
    batches: list[list[Entry]] = [[]]
    size = 0
    for e, n in zip(entries, sizes):
        if batches[-1] and size + n > max_bytes:
            batches.append([])
            size = 0
        batches[-1].append(e)
        size += n
    return batches
