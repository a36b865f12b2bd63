"""Data-parallel Muon outside the optimizer: matrix owners, the all-gather, sharded momentum.

These pieces say who orthogonalizes which matrix, how every rank gets what the owners computed,
and how sharded momentum is gathered and dropped.

Under data parallelism every rank holds the same gradients (DDP averaged them), so running
Newton–Schulz on every matrix on every rank repeats the same work world-size times. Instead each
Muon parameter gets one owner, which orthogonalizes it and applies its update; the owners'
results are then all-gathered so every rank ends the step with the same parameters.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


def ns_flops(matrix_shape: Sequence[int]) -> int:
    """Flops of one Newton–Schulz iteration on k matrices of rows x cols.

    The shape is the [k, rows, cols] view of :func:`optim.batches.matrix_shape`: about 4 m^2 n + 2 m^3
    per matrix, m <= n (the standard form; the Gram form differs by a shape-dependent factor that
    ownership can ignore).
    """
    k, rows, cols = matrix_shape
    m, n = sorted((rows, cols))
    return k * (4 * m * m * n + 2 * m * m * m)


def assign_owners(costs: Sequence[int | float], world_size: int) -> list[int]:
    """The rank that owns each item: greedy longest-processing-time.

    Items are taken largest cost first (ties in list order) and each goes to the least-loaded rank
    (ties to the lowest rank). A pure function of the costs, so every rank computes the same
    assignment; its largest load is at most 4/3 of the optimum's (Graham's bound for LPT).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    loads: list[float] = [0] * world_size  # ints stay exact sums of int costs
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
    # Another rank's slots are replaced by their received views below, bar a kind whose tensors have
    # no elements at all: their templates stand for them (there are no values to receive).
    out = [list(local) if r == rank else list(ts) for r, ts in enumerate(layout)]
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


@dataclass
class Ownership:
    """Each Muon parameter's owning rank, and per rank the parameters it owns (in param order)."""

    rank_of: dict[Tensor, int]
    shards: list[list[Tensor]]

    @classmethod
    def deal(cls, params: Sequence[tuple[Tensor, Any]], costs: Sequence[int | float], world_size: int) -> Ownership:
        """Owners for ``params`` (each with anything beside it, e.g. its group's experts flag)
        by :func:`assign_owners` on ``costs``."""
        ranks = assign_owners(costs, world_size)
        shards: list[list[Tensor]] = [[] for _ in range(world_size)]
        for (p, _), r in zip(params, ranks):
            shards[r].append(p)
        return cls(dict(zip((p for p, _ in params), ranks)), shards)

    @property
    def device(self) -> torch.device:
        """Where the collectives' small tensors live: nccl takes CUDA tensors only."""
        return next(iter(self.rank_of)).device

    @torch.no_grad()
    def share_parameters(self, rank: int, group: dist.ProcessGroup | None) -> None:
        """Copy every owner's parameters into the other ranks' (one all-gather per dtype).

        Every Muon parameter is sent by its owner whether or not it had a gradient, so the
        collective's shape never depends on the step: a gradient missing on one rank cannot hang it
        (the owner's value wins).
        """
        received = all_gather_from_owners(self.shards, self.shards[rank], group)
        for r, (params, values) in enumerate(zip(self.shards, received)):
            if r != rank and params:
                torch._foreach_copy_(params, values)

    def sum_over_ranks(self, values: Sequence[Tensor | float], group: dist.ProcessGroup | None) -> list[Tensor]:
        """Each value (a scalar tensor or a number) summed over the ranks, in one all-reduce."""
        totals = torch.zeros(len(values), dtype=torch.float64, device=self.device)
        for i, v in enumerate(values):
            totals[i] += v  # filled from scalars: no copy, no sync
        dist.all_reduce(totals, group=group)
        return list(totals.unbind())

    def gather_state(
        self,
        state: MutableMapping[Tensor, dict],
        key: str,
        rank: int,
        group: dist.ProcessGroup | None,
        like: Callable[[Tensor], Tensor] = lambda p: p,
    ) -> dict[Tensor, Tensor]:
        """The ``key`` buffers (a momentum, a second moment) the other ranks own, by parameter (a
        collective: every rank calls it); ``like(p)``: a tensor of the buffer's shape, dtype and
        device (default: the parameter's own). Parameters whose owner has no such buffer yet (no
        gradient so far) are left out."""
        params = list(self.rank_of)
        held = torch.tensor(
            [self.rank_of[p] == rank and key in state.get(p, ()) for p in params],
            dtype=torch.float32,
            device=self.device,
        )
        dist.all_reduce(held, group=group)  # which owners have a buffer
        has = dict(zip(params, held.tolist()))
        owned = [[p for p in shard if has[p]] for shard in self.shards]
        layout = [[like(p) for p in shard] for shard in owned]
        mine = [state[p][key] for p in owned[rank]]
        out: dict[Tensor, Tensor] = {}
        for r, (shard, buffers) in enumerate(zip(owned, all_gather_from_owners(layout, mine, group))):
            if r != rank:  # clones, not views: saving a view would save the whole gathered buffer
                out.update((p, buf.clone()) for p, buf in zip(shard, buffers))
        return out

    def drop_others(self, state: MutableMapping[Tensor, dict], key: str, rank: int) -> None:
        """Keep only the ``key`` buffers of the parameters ``rank`` owns (after a full load)."""
        for p, r in self.rank_of.items():
            if r != rank and p in state:
                state[p].pop(key, None)
                if not state[p]:
                    del state[p]
