"""What a run ends with: its result, or the error that stopped it (with a job's error code)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from contract import metrics
from contract.status import JobStatus

STOP_KEYS = ("stopped_at", "stop_reason")  # in the summary of a run that stopped early


class TrainingError(RuntimeError):
    """The run cannot go on (non-finite loss, bad data, ...); the message says why and where,
    ``code`` what kind of stop it is (a job's error code)."""

    code = "training_error"


class NotEnoughGpus(TrainingError):
    """A CUDA run of a group asks for more ranks on a node than the node has GPUs."""

    code = "not_enough_gpus"


class TimeLimitReached(TrainingError):
    """The run reached ``train.max_minutes``; its latest state is in a checkpoint."""

    code = "time_limit"


@dataclass
class RunResult:
    status: JobStatus  # succeeded, cancelled, stopped_early or paused (ended at a rung by ``rungs``)
    steps: int  # optimizer steps completed
    summary: dict[str, Any]  # the latest value of each metrics.SUMMARY metric (and STOP_KEYS, if it stopped early)
    tokens_per_s: float | None  # over the run's training steps (the summary's is the last step's)
    wall_s: float

    def __post_init__(self) -> None:
        self.status = JobStatus(self.status)  # also when it arrives as text, from a rank of a group

    @property
    def loss(self) -> float | None:
        return self.summary.get(metrics.LOSS)

    @property
    def val_loss(self) -> float | None:
        return self.summary.get(metrics.VAL_LOSS)

    @property
    def attn_max_logit(self) -> float | None:
        return self.summary.get(metrics.ATTN_MAX_LOGIT)

    def as_dict(self) -> dict[str, Any]:
        """What ``summary.json`` holds."""
        return {
            "status": self.status.value,
            "steps": self.steps,
            metrics.LOSS: self.loss,
            metrics.VAL_LOSS: self.val_loss,
            metrics.ATTN_MAX_LOGIT: self.attn_max_logit,
            metrics.TOKENS_PER_S: self.tokens_per_s,
            "wall_s": self.wall_s,
            **{k: self.summary[k] for k in STOP_KEYS if k in self.summary},
        }
