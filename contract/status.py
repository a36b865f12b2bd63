"""Job, sweep and trial statuses, the sets the service reasons with, and a job's transitions.

A job is created ``queued``; a worker's attempt claims it (``running``) and ends it (``succeeded``,
``failed``, ``cancelled``, ``stopped_early``), with ``cancelling`` between a cancel request and
the worker's stop. A sweep's trial that waits at an ASHA rung is ``paused``: on no worker, not
counted against the job cap, its state in a checkpoint at the rung. ``TRANSITIONS`` names every
change a job's status may take; the job repository refuses any other. Postgres (or the embedded
SQLite file) is the single source of truth.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any


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
# Not final: queued, on a worker, or a trial paused at a rung.
UNFINISHED = frozenset(JobStatus) - FINISHED


def is_finished(status: str) -> bool:
    """Whether ``status`` (a JobStatus or its text, as stored or sent) is final."""
    return status in FINISHED


@dataclass(frozen=True)
class Transition:
    """A named rule: a job in one of ``sources`` may move to one of ``targets``; ``by`` says who
    takes it and why."""

    name: str
    sources: frozenset[JobStatus]
    targets: frozenset[JobStatus]
    by: str


def _rule(name: str, sources: Iterable[JobStatus], targets: Iterable[JobStatus], by: str) -> Transition:
    return Transition(name, frozenset(sources), frozenset(targets), by)


S = JobStatus
TRANSITIONS: tuple[Transition, ...] = (
    _rule("claim", {S.QUEUED}, {S.RUNNING}, "a worker's attempt takes the job under a lease"),
    _rule("request_cancel", {S.RUNNING}, {S.CANCELLING}, "the API: a cancel of a job a worker holds"),
    _rule("cancel_waiting", {S.QUEUED, S.PAUSED}, {S.CANCELLED}, "the API: a cancel of a job no worker holds"),
    _rule("finish", RUNNING, FINISHED, "the attempt records its outcome (a cancelling job may still succeed)"),
    _rule("pause", {S.RUNNING}, {S.PAUSED}, "the attempt of a sweep's trial that waits at an ASHA rung"),
    _rule(
        "release",
        RUNNING,
        {S.QUEUED, S.FAILED, S.CANCELLED},
        "the reaper (a lapsed lease) or the attempt (a dead rank): queued to resume, failed past "
        "max_restarts, cancelled if it was being cancelled",
    ),
    _rule("promote", {S.PAUSED}, {S.QUEUED}, "a sweep: ASHA promotes a waiting trial, which resumes at its rung"),
    _rule(
        "unpromote", {S.QUEUED}, {S.PAUSED}, "a sweep: undoes a promotion past the tenant's job cap, same transaction"
    ),
    _rule("stop_waiting", {S.PAUSED}, {S.STOPPED_EARLY}, "a sweep that ends without promoting a waiting trial"),
)
del S
RULES: dict[str, Transition] = {rule.name: rule for rule in TRANSITIONS}

# A new job's status; then only the changes of TRANSITIONS.
INITIAL = JobStatus.QUEUED
ALLOWED: dict[JobStatus, frozenset[JobStatus]] = {
    source: frozenset(t for rule in TRANSITIONS if source in rule.sources for t in rule.targets) for source in JobStatus
}


def allowed(source: str, target: str) -> bool:
    """Whether a job may go from ``source`` to ``target`` (the same status is no change, and allowed)."""
    return source == target or JobStatus(target) in ALLOWED[JobStatus(source)]


class IllegalTransition(ValueError):
    """A status change that TRANSITIONS does not allow: a bug in the caller, never a race."""


def check_transition(sources: Iterable[str], target: str) -> None:
    """Raise IllegalTransition unless a job may go to ``target`` from each of ``sources``."""
    refused = sorted(str(s) for s in sources if not allowed(s, target))
    if refused:
        raise IllegalTransition(f"a job may not go from {', '.join(refused)} to {target}")


class SweepStatus(StrEnum):
    """A sweep: running until every trial has finished (then completed), or cancelled."""

    RUNNING = "running"
    COMPLETED = "completed"
    CANCELLED = "cancelled"


class TrialStatus(StrEnum):
    """A sweep's trial before it has a job (after, its status is its job's)."""

    PENDING = "pending"  # waits for a slot (max_concurrent)
    NOT_STARTED = "not_started"  # could not start (its error says why)


class UploadStatus(StrEnum):
    """A resumable upload: taking parts, being made into its dataset or model, and how it ended."""

    PENDING = "pending"
    COMPLETING = "completing"
    COMPLETED = "completed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"


# A trial that will not change any more: its job finished, or it never started.
TRIAL_FINISHED = frozenset(FINISHED | {TrialStatus.NOT_STARTED})


def as_json() -> dict[str, Any]:
    """The statuses by name (``{"job": {"QUEUED": "queued", …}, …}``) and their sets as lists in
    declaration order: what the web pages embed."""
    trial = [*JobStatus, *TrialStatus]
    return {
        "job": {s.name: s.value for s in JobStatus},
        "sweep": {s.name: s.value for s in SweepStatus},
        "trial": {s.name: s.value for s in TrialStatus},
        "active": [s.value for s in JobStatus if s in ACTIVE],
        "running": [s.value for s in JobStatus if s in RUNNING],
        "finished": [s.value for s in JobStatus if s in FINISHED],
        "trial_finished": [s.value for s in trial if s in TRIAL_FINISHED],
    }
