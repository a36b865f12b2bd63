"""A job's status, and the sets of statuses the service reasons with. The one place they are spelled.

queued -> running -> succeeded | failed | cancelled | stopped_early, with cancelling between a
cancel request and the worker's stop; stopped_early is a sweep's trial that ASHA stopped at a rung
(app.search). A trial of a sweep whose ASHA promotes waits at a rung as paused (running ->
paused): on no worker, not counted against the job cap, its state in a checkpoint at the rung;
then paused -> queued when ASHA promotes it (it resumes from the rung), -> stopped_early when its
sweep ends without promoting it, -> cancelled when it is cancelled. Postgres (or the embedded
SQLite file) is the single source of truth. A sweep's own status (running -> completed |
cancelled) is spelled here too.
"""

from __future__ import annotations

from enum import StrEnum


class JobStatus(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    CANCELLING = "cancelling"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    STOPPED_EARLY = "stopped_early"  # a sweep's trial that ASHA stopped at a rung
    PAUSED = "paused"  # a sweep's trial waiting at an ASHA rung to be promoted

    @property
    def finished(self) -> bool:
        return self in FINISHED


# Held by a worker attempt's lease (a cancel request does not end the attempt by itself).
RUNNING = frozenset({JobStatus.RUNNING, JobStatus.CANCELLING})
# Counted against the tenant's job cap: waiting for a worker or on one.
ACTIVE = frozenset({JobStatus.QUEUED}) | RUNNING
# Final: nothing changes a finished job's status again.
FINISHED = frozenset({JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED, JobStatus.STOPPED_EARLY})


class SweepStatus(StrEnum):
    """A sweep: running until every trial has finished (then completed), or cancelled."""

    RUNNING = "running"
    COMPLETED = "completed"
    CANCELLED = "cancelled"


def is_finished(status: str) -> bool:
    """Whether ``status`` (a JobStatus or its text, as stored or sent) is final."""
    return status in FINISHED
