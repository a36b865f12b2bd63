"""What an optimizer step did, for telemetry: its statistics and the wall time of its phases.

A phase is timed without forcing a device sync on the hot path.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor


def small_floats(values: list, like: Tensor) -> Tensor:
    """A few host numbers as a tensor on ``like``'s device and dtype, without a device sync.

    The numbers are a list, or a list of equal lists. On CUDA they go through pinned memory and an
    asynchronous copy (a pageable copy would wait).
    """
    host = torch.tensor(values, dtype=like.dtype, pin_memory=like.is_cuda)
    return host.to(like.device, non_blocking=True)


class PhaseTimer:
    """Accumulates the time spent inside ``with timer:`` blocks.

    On CUDA it records events and reads them only in :meth:`elapsed_ms` (one sync, when
    telemetry asks); elsewhere it uses the host clock.
    """

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._seconds = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._start_event: torch.cuda.Event | None = None  # on CUDA
        self._start_s = 0.0  # elsewhere

    def __enter__(self) -> PhaseTimer:
        if self._cuda:
            self._start_event = torch.cuda.Event(enable_timing=True)
            self._start_event.record()
        else:
            self._start_s = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self._start_event is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((self._start_event, end))
            self._start_event = None
        else:
            self._seconds += time.perf_counter() - self._start_s

    def elapsed_ms(self) -> float:
        if self._events:
            self._events[-1][1].synchronize()
            self._seconds += sum(s.elapsed_time(e) for s, e in self._events) / 1e3
            self._events.clear()
        return self._seconds * 1e3


@dataclass
class StepStats:
    """What one step did, for telemetry; tensors are read (and synced) only when asked for."""

    update_sq_sum: Tensor | float = 0.0
    update_numel: Tensor | float = 0
    nonfinite_skipped: Tensor | float = 0
    ns_timer: PhaseTimer | None = None
    extra: dict[str, Tensor | float] = field(default_factory=dict)
    # Means over the step's matrices of what an update rule measures (NorMuon's scale spread):
    # name -> [sum, count], summed over the ranks under data parallelism, reported as sum / count.
    means: dict[str, list[Tensor | float]] = field(default_factory=dict)
    # Per device and dtype, until settle() sums them for the step: each batch's squared update
    # norm and finite flag per matrix (device tensors) and, per matrix, (lr x scale)^2, 1 / k and
    # its entry count (host numbers).
    _pending: dict[tuple, tuple[list[Tensor], list[Tensor], list[float], list[float], list[float]]] = field(
        default_factory=dict
    )
    # Per mean's name and device, until settle(): each batch's values (one per matrix).
    _pending_means: dict[tuple[str, torch.device], list[Tensor]] = field(default_factory=dict)

    def record(self, sq: Tensor, keep: Tensor, weights: list[float], shares: list[float], numel: int) -> None:
        """One batch of updates: ``sq`` and ``keep`` per matrix, ``weights`` and ``shares`` per
        matrix, ``numel`` entries in each of its matrices."""
        sqs, keeps, all_weights, all_shares, numels = self._pending.setdefault(
            (sq.device, sq.dtype), ([], [], [], [], [])
        )
        sqs.append(sq)
        keeps.append(keep)
        all_weights += weights
        all_shares += shares
        numels += [float(numel)] * len(weights)

    def add_to_mean(self, name: str, values: Tensor) -> None:
        """Values (one per matrix, on the device) toward the step's mean of ``name``; those that are
        not finite (a skipped update's) are left out. Kept until :meth:`settle`, which sums them
        once per step (a handful of ops a step, not a handful a batch); no host sync."""
        self.means.setdefault(name, [0.0, 0.0])
        self._pending_means.setdefault((name, values.device), []).append(values)

    def settle(self) -> None:
        """Fold the recorded batches into update_sq_sum, update_numel and nonfinite_skipped (and the
        means' sums and counts): a few device ops per device and dtype for the whole step instead
        of per batch, no host sync."""
        for sqs, keeps, weights, shares, numels in self._pending.values():
            sq, keep = torch.cat(sqs), torch.cat(keeps)
            w, s, n = small_floats([weights, shares, numels], sq)  # one copy for the three
            applied = keep.to(sq.dtype)
            self.update_sq_sum = self.update_sq_sum + sq.where(keep, 0.0).dot(w)
            self.update_numel = self.update_numel + applied.dot(n)
            self.nonfinite_skipped = self.nonfinite_skipped + (1.0 - applied).dot(s)
        self._pending.clear()
        for (name, _), parts in self._pending_means.items():
            values = torch.cat(parts)
            kept = values.isfinite()
            total = self.means[name]
            total[0] = total[0] + values.where(kept, 0.0).sum()
            total[1] = total[1] + kept.sum()
        self._pending_means.clear()

    def as_dict(self) -> dict[str, float]:
        """update_rms: RMS of the applied Muon updates (parameter change, decay excluded);
        ns_time_ms: wall time of the orthogonalization phase; nonfinite_skipped: parameters
        whose gradient or update was not finite, so they were left unchanged this step."""
        numel = float(self.update_numel)
        rms = math.sqrt(float(self.update_sq_sum) / numel) if numel else 0.0
        out = {
            "update_rms": rms,
            "ns_time_ms": self.ns_timer.elapsed_ms() if self.ns_timer else 0.0,
            "nonfinite_skipped": float(self.nonfinite_skipped),
        }
        out.update({k: float(v) for k, v in self.extra.items()})
        for name, (total, count) in self.means.items():
            out[name] = float(total) / float(count) if float(count) else 0.0
        return out
