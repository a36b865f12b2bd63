"""One rank of a job's torch.distributed group: its place in the group and the collectives it needs.

Its place comes from the environment torchrun gives each rank; the collectives are the few the
trainer needs beyond DDP's gradient all-reduce. A job of one process has no group, and none of
this runs.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass(frozen=True)
class Group:
    rank: int
    world: int
    local_rank: int  # on its node: the CUDA device it drives
    device: torch.device

    @property
    def lead(self) -> bool:
        """Rank 0: the one that reports telemetry and writes checkpoints."""
        return self.rank == 0

    def mean(self, t: Tensor) -> Tensor:
        """The mean of ``t`` over the ranks (a copy; ``t`` is left alone).

        Each rank's share of a batch is the same size, so the mean of their mean losses is the
        global batch's.
        """
        out = t.detach().clone()
        dist.all_reduce(out)
        return out / self.world

    def max_(self, tensors: list[Tensor]) -> None:
        """Each tensor, in place, to its element-wise maximum over the ranks (in one all-reduce)."""
        if not tensors:
            return
        flat = torch.cat([t.reshape(-1) for t in tensors])
        dist.all_reduce(flat, op=dist.ReduceOp.MAX)
        for t, part in zip(tensors, flat.split([t.numel() for t in tensors])):
            t.copy_(part.view_as(t))

    def decide(self, choice: int) -> int:
        """Rank 0's ``choice`` on every rank.

        A decision that ends the loop (a cancel, the time limit) has to be taken at the same step
        everywhere, or the others wait in a collective for a rank that left.
        """
        t = torch.tensor([choice], dtype=torch.int64, device=self.device)  # nccl takes device tensors
        dist.broadcast(t, src=0)
        return int(t.item())

    @contextmanager
    def lead_first(self) -> Iterator[None]:
        """Rank 0 runs the block before the others (it fills a cache they then read)."""
        if not self.lead:
            dist.barrier()
        yield
        if self.lead:
            dist.barrier()


def join_group(cuda: bool) -> Group:
    """Join the group torchrun started this process in: nccl with the device LOCAL_RANK names on
    CUDA, gloo on the CPU."""
    rank, world, local = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    if cuda:
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return Group(rank, world, local, device)


def leave_group(together: bool = False) -> None:
    """Leave the group. ``together``: first wait until every rank is here, each having said it is
    done, so that no rank tears down before the others have reported: gloo's teardown can abort a
    process, and torchrun then stops the others, rank 0 perhaps before its outcome is out."""
    if dist.is_initialized():
        if together:
            dist.barrier()
        dist.destroy_process_group()
