"""Data-parallel Muon's two pieces that are not the optimizer: who orthogonalizes which matrix,
and how every rank gets what the owners computed.

Under data parallelism every rank holds the same gradients (DDP averaged them), so running
Newton–Schulz on every matrix on every rank repeats the same work world-size times. Instead each
Muon parameter gets one owner, which orthogonalizes it and applies its update; the owners'
results are then all-gathered so every rank ends the step with the same parameters.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor


def ns_flops(matrix_shape: Sequence[int]) -> int:
    """Flops of one Newton–Schulz iteration on k matrices of rows x cols (the [k, rows, cols]
    view of :func:`optim.muon.matrix_shape`): about 4 m^2 n + 2 m^3 per matrix, m <= n (the
    standard form; the Gram form differs by a shape-dependent factor that ownership can ignore)."""
    k, rows, cols = matrix_shape
    m, n = sorted((rows, cols))
    return k * (4 * m * m * n + 2 * m * m * m)


def assign_owners(costs: Sequence[int | float], world_size: int) -> list[int]:
    """The rank that owns each item: greedy longest-processing-time. Items are taken largest
    cost first (ties in list order) and each goes to the least-loaded rank (ties to the lowest
    rank). A pure function of the costs, so every rank computes the same assignment; its
    largest load is at most 4/3 of the optimum's (Graham's bound for LPT)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    loads = [0] * world_size
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: -costs[i]):  # sorted() is stable: ties keep order
        rank = min(range(world_size), key=loads.__getitem__)  # min() returns the first minimum
        owners[i] = rank
        loads[rank] += costs[i]
    return owners


@torch.no_grad()
def all_gather_from_owners(
    layout: Sequence[Sequence[Tensor]], local: Sequence[Tensor], group: dist.ProcessGroup | None = None
) -> list[list[Tensor]]:
    """Every rank's tensors, on every rank.

    ``layout[r]``: the tensors rank r contributes, as templates (their shape, dtype and device);
    it must be the same on every rank. ``local``: this rank's values, matching ``layout[rank]``.
    Per (dtype, device) one ``all_gather`` of flat buffers, each rank's packed in layout order
    and padded to the longest; ``all_gather`` of equal-size tensors works on gloo and nccl alike.
    Returns per rank its tensors: views into the received buffers (this rank's: ``local``).
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if len(layout) != world or len(local) != len(layout[rank]):
        raise ValueError("layout must list every rank's tensors and local must match this rank's")
    out: list[list[Tensor]] = [list(local) if r == rank else [None] * len(ts) for r, ts in enumerate(layout)]
    kinds = dict.fromkeys((t.dtype, t.device) for ts in layout for t in ts)  # first-seen order: same on all ranks
    for dtype, device in kinds:
        picked = [[i for i, t in enumerate(ts) if (t.dtype, t.device) == (dtype, device)] for ts in layout]
        sizes = [sum(layout[r][i].numel() for i in idx) for r, idx in enumerate(picked)]
        width = max(sizes)
        if width == 0:
            continue
        send = torch.empty(width, dtype=dtype, device=device)  # the padding is sent but never read
        if picked[rank]:
            torch.cat([local[i].reshape(-1) for i in picked[rank]], out=send[: sizes[rank]])
        received = [torch.empty_like(send) for _ in range(world)]
        dist.all_gather(received, send, group=group)
        for r, idx in enumerate(picked):
            if r == rank:
                continue
            offset = 0
            for i in idx:
                template = layout[r][i]
                out[r][i] = received[r][offset : offset + template.numel()].view(template.shape)
                offset += template.numel()
    return out
