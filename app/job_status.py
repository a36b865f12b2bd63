"""A job's status, and the sets of statuses the service reasons with. The one place they are spelled.

queued -> running -> succeeded | failed | cancelled, with cancelling between a cancel request
and the worker's stop. Postgres (or the embedded SQLite file) is the single source of truth.
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

    @property
    def finished(self) -> bool:
        return self in FINISHED


# Held by a worker attempt's lease (a cancel request does not end the attempt by itself).
RUNNING = frozenset({JobStatus.RUNNING, JobStatus.CANCELLING})
# Counted against the tenant's job cap: waiting for a worker or on one.
ACTIVE = frozenset({JobStatus.QUEUED}) | RUNNING
# Final: nothing changes a finished job's status again.
FINISHED = frozenset({JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED})


def is_finished(status: str) -> bool:
    """Whether ``status`` (a JobStatus or its text, as stored or sent) is final."""
    return status in FINISHED
