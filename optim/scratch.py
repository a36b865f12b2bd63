"""Scratch memory kept across calls: one flat buffer per dtype and device, carved into views.

A call carves the views it needs, so that work repeated every step allocates nothing once the
buffer has grown.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

# Views start at multiples of this many elements (256 bytes in fp32): every matrix a product reads
# or writes is aligned as a fresh allocation would be.
SCRATCH_ALIGN = 64


class Scratch:
    """Reusable scratch memory: one flat buffer per (dtype, device), grown to the largest request.

    The buffer is carved into the views one call needs. A carve invalidates the views of the
    previous carve of the same dtype and device, so each user of scratch owns its own instance.
    """

    def __init__(self) -> None:
        self._flat: dict[tuple[torch.dtype, torch.device], Tensor] = {}

    def carve(self, dtype: torch.dtype, device: torch.device, *shapes: tuple[int, ...]) -> list[Tensor]:
        """Contiguous views of the given shapes, side by side in this dtype and device's buffer."""
        sizes = [math.prod(shape) for shape in shapes]
        spans = [_aligned(size) for size in sizes]
        key = (dtype, torch.device(device))
        flat = self._flat.get(key)
        if flat is None or flat.numel() < sum(spans):
            self._flat.pop(key, None)  # free the smaller buffer before allocating its successor
            flat = self._flat[key] = torch.empty(sum(spans), dtype=dtype, device=device)
        views, offset = [], 0
        for shape, size, span in zip(shapes, sizes, spans):
            views.append(flat[offset : offset + size].view(shape))
            offset += span
        return views

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._flat.values())


def fit(flat: Tensor, shapes: Sequence[tuple[int, ...]]) -> tuple[list[Tensor], Sequence[tuple[int, ...]]]:
    """Views of ``flat`` for the leading ``shapes`` that fit in it one after another (each started
    at a multiple of SCRATCH_ALIGN elements), and the shapes that did not fit."""
    views: list[Tensor] = []
    offset = 0
    for i, shape in enumerate(shapes):
        size = math.prod(shape)
        if offset + size > flat.numel():
            return views, shapes[i:]
        views.append(flat[offset : offset + size].view(shape))
        offset += _aligned(size)
    return views, []


def _aligned(size: int) -> int:
    """``size`` rounded up to a multiple of SCRATCH_ALIGN."""
    return -(-size // SCRATCH_ALIGN) * SCRATCH_ALIGN
