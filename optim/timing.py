"""Wall time of an optimizer phase without forcing a device sync on the hot path."""

from __future__ import annotations

import time

import torch


class PhaseTimer:
    """Accumulates the time spent inside ``with timer:`` blocks.

    On CUDA it records events and reads them only in :meth:`elapsed_ms` (one sync, when
    telemetry asks); elsewhere it uses the host clock.
    """

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._seconds = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._start: float | torch.cuda.Event | None = None

    def __enter__(self) -> PhaseTimer:
        if self._cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self._cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((self._start, end))
        else:
            self._seconds += time.perf_counter() - self._start

    def elapsed_ms(self) -> float:
        if self._events:
            self._events[-1][1].synchronize()
            self._seconds += sum(s.elapsed_time(e) for s, e in self._events) / 1e3
            self._events.clear()
        return self._seconds * 1e3
