"""Draining a work queue in batches, for the API's background writer threads."""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator
from typing import TypeVar

T = TypeVar("T")


def batches(pending: queue.SimpleQueue[T | None], linger: float, size: int) -> Iterator[list[T]]:
    """Batches of what ``pending`` holds: wait for an item, ``linger`` seconds more so that a
    burst shares the batch, then take up to ``size`` items. Ends after the None sentinel (the
    items before it are yielded first)."""
    while True:
        batch: list[T] = []
        item = pending.get()
        time.sleep(linger)
        while item is not None:
            batch.append(item)
            if len(batch) >= size or pending.empty():
                break
            item = pending.get()
        if batch:
            yield batch
        if item is None:
            return
