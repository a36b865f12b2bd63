"""Early stopping: the rule that ends a run whose evaluations stopped improving, and an outside hook.

Through the hook a decider outside the run (a sweep's ASHA) stops it at given steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from contract.spec import EarlyStopSpec
from contract.status import JobStatus


@dataclass
class EarlyStop:
    """The early-stopping rule's state over a run's evaluations.

    It holds the best value so far and its step, and the evaluations since that did not better it
    by more than ``min_delta`` (``stale``). The run stops once ``stale`` reaches ``patience``.

    The state goes into every checkpoint, so a resumed run goes on counting. A resumed run
    evaluates its checkpoint's step again; ``judged_step`` makes that evaluation count once.
    """

    metric: str
    mode: str
    patience: int
    min_delta: float
    best: float | None = None
    best_step: int | None = None
    stale: int = 0
    judged_step: int = -1

    @classmethod
    def of(cls, cfg: EarlyStopSpec) -> EarlyStop:
        return cls(cfg.metric, cfg.mode, cfg.patience, cfg.min_delta)

    def judge(self, step: int, value: float) -> bool:
        """Take the evaluation at ``step``; whether the run is to stop."""
        if step > self.judged_step:
            self.judged_step = step
            if self._improves(value):
                self.best, self.best_step, self.stale = value, step, 0
            else:
                self.stale += 1
        return self.stopped

    @property
    def stopped(self) -> bool:
        return self.stale >= self.patience

    def reason(self) -> str:
        """Why the run stopped, in plain words."""
        by = f" by more than {self.min_delta:g}" if self.min_delta else ""
        evaluations = f"{self.stale} evaluation{'s' if self.stale != 1 else ''}"
        best = f"best {self.best:.4g} at step {self.best_step}" if self.best is not None else "no finite value"
        return f"{self.metric} did not improve{by} for {evaluations} ({best})"

    def state_dict(self) -> dict[str, Any]:
        """Plain values (what a checkpoint's ``weights_only`` loading takes)."""
        return {"best": self.best, "best_step": self.best_step, "stale": self.stale, "judged_step": self.judged_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.best_step = state["best"], state["best_step"]
        self.stale, self.judged_step = state["stale"], state["judged_step"]

    def _improves(self, value: float) -> bool:
        if not math.isfinite(value):  # a NaN or infinite evaluation is never the best
            return False
        if self.best is None:
            return True
        return value < self.best - self.min_delta if self.mode == "min" else value > self.best + self.min_delta


@dataclass(frozen=True)
class RungCheck:
    """Stops decided outside the run (a sweep's ASHA), at given steps.

    At each of ``steps`` the run evaluates, and ``decide(step, value)`` takes the evaluation's
    ``metric`` and returns None to go on, or how the run ends there and why:
    (JobStatus.STOPPED_EARLY, reason) to stop, (JobStatus.PAUSED, reason) to wait there for a
    promotion (its state in a checkpoint at that step, to resume from). The decider answers the same
    for the same step until a promotion (a resumed run evaluates its checkpoint's step again; a
    promoted one is told to go on).
    """

    steps: tuple[int, ...]
    metric: str
    decide: Callable[[int, float], tuple[JobStatus, str] | None]
