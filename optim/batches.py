"""One Muon step's batches: each parameter viewed as matrices, same-shape matrices stacked into
one Newton–Schulz input.

Each matrix is stacked in its own orientation and in the Newton–Schulz working precision, and
batches are bounded in bytes. The orthogonalized updates are applied back to each parameter,
with the finite check decided on the device.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

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


@dataclass
class Entry:
    """One Muon parameter as a batch of matrices [k, rows, cols], k = E for expert weights."""

    param: Tensor
    grad: Tensor
    buf: Tensor
    scale: float  # lr multiplier from the matrix shape (adjust_lr)


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
    keep = sq.isfinite()  # [B] per matrix; a parameter of k > 1 matrices is kept whole or not at all
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
        shares += [1.0 / k] * k
        update = O[first : first + k]
        if weight_decay and cautious:  # a skipped update is zero: it agrees with no weight
            cautious_decay(e.param.view(update.shape), update, lr * weight_decay)
        elif weight_decay:  # decoupled, with the unadjusted lr; skipped with the update
            e.param.mul_(torch.where(keep[first], 1.0 - lr * weight_decay, 1.0))
        if update.dtype != e.param.dtype and e.param.is_contiguous():
            alpha = -lr * e.scale
            in_blocks(e.param.view(update.shape), lambda p, u, alpha=alpha: p.add_(u, alpha=alpha), update)
        else:
            params, updates = by_scale[e.scale]
            params.append(e.param)
            updates.append(update.reshape(e.param.shape))
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
