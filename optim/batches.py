"""One Muon step's batches: same-shape matrices stacked (oriented wide) into one Newton–Schulz
input, batches bounded in bytes, and the orthogonalized updates applied back to each parameter
with the finite check decided on the device."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import Tensor

from .scratch import Scratch
from .stats import StepStats


@dataclass
class Entry:
    """One Muon parameter as a batch of matrices [k, rows, cols], k = E for expert weights."""

    param: Tensor
    grad: Tensor
    buf: Tensor
    scale: float  # lr multiplier from the matrix shape (adjust_lr)

    @property
    def tall(self) -> bool:
        return self.grad.shape[-2] > self.grad.shape[-1]


def nesterov_input(entries: list[Entry], beta: float, nesterov: bool, stack: Scratch) -> Tensor:
    """Stack the entries' NS inputs, oriented wide (m <= n), into a [B, m, n] view of ``stack``."""
    first = entries[0].grad
    m, n = sorted(first.shape[-2:])
    batch = sum(e.grad.shape[0] for e in entries)
    (X,) = stack.carve(first.dtype, first.device, (batch, m, n))
    i = 0
    for e in entries:
        k = e.grad.shape[0]
        g, buf = (e.grad.mT, e.buf.mT) if e.tall else (e.grad, e.buf)
        if nesterov:
            torch.lerp(g, buf, beta, out=X[i : i + k])  # (1 - beta) g + beta m
        else:
            X[i : i + k].copy_(buf)
        i += k
    return X


def apply_updates(entries: list[Entry], O: Tensor, lr: float, weight_decay: float, stats: StepStats) -> None:
    """W <- W (1 - lr wd) - lr scale O per parameter, leaving unchanged any whose update is not
    finite. Decided on the device: no host sync (on CUDA the step's kernels stay queued)."""
    sq = torch.linalg.vector_norm(O, dim=(1, 2), dtype=torch.promote_types(O.dtype, torch.float32)).square()
    keep = sq.isfinite()  # [B] per matrix; a parameter of k > 1 matrices is kept whole or not at all
    first = 0
    for e in entries:
        k = e.grad.shape[0]
        if k > 1:
            keep[first : first + k] = keep[first : first + k].all()
        first += k
    O.masked_fill_(~keep.view(-1, 1, 1), 0.0)  # a skipped parameter gets a zero update
    by_scale: dict[float, tuple[list[Tensor], list[Tensor]]] = defaultdict(lambda: ([], []))
    weights, shares, first = [], [], 0  # per matrix: (lr * scale)^2, and 1 / k (so a parameter counts once)
    for e in entries:
        k = e.grad.shape[0]
        weights += [(lr * e.scale) ** 2] * k
        shares += [1.0 / k] * k
        if weight_decay:  # decoupled, with the unadjusted lr; skipped with the update
            e.param.mul_(torch.where(keep[first], 1.0 - lr * weight_decay, 1.0))
        update = O[first : first + k]
        params, updates = by_scale[e.scale]
        params.append(e.param)
        updates.append((update.mT if e.tall else update).reshape(e.param.shape))
        first += k
    for scale, (params, updates) in by_scale.items():  # one call per lr multiplier, not one per parameter
        torch._foreach_add_(params, updates, alpha=-lr * scale)
    stats.record(sq, keep, weights, shares, O[0].numel())  # summed once per step (StepStats.settle)


def split_batches(entries: list[Entry], max_bytes: int) -> list[list[Entry]]:
    """Split a bucket into batches of at most ``max_bytes`` (at least one entry each)."""
    batches: list[list[Entry]] = [[]]
    size = 0
    for e in entries:
        n = e.grad.numel() * e.grad.element_size()
        if batches[-1] and size + n > max_bytes:
            batches.append([])
            size = 0
        batches[-1].append(e)
        size += n
    return batches
