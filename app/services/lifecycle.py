"""The job lifecycle: every change of a job's status, each a use case named after its rule.

The rules are contract.status.TRANSITIONS (claim, request_cancel and cancel_waiting, finish,
pause, release, promote and unpromote, stop_waiting); a new job's first status is recorded here
too. A use case does one fenced compare-and-set (app.repositories.jobs ``change_status``, which
refuses a change its rule does not name) and, if the row changed, records the status event in
the same transaction (app.services.job_journal ``record_status``, which also queues a final
status's webhook deliveries). It returns the job as recorded, or None where the row had moved on
(another attempt holds it, a concurrent change came first): the caller looks again, or stops.
Services never commit: the request's unit of work or the task's ``transaction(settings)`` does.

Callers keep the lock order of app.repositories.jobs: one existing job's status per transaction,
no tenant locked before it. ``promote`` reads the tenant's job cap on the row its change's
trigger now holds, so the count is exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from functools import partial
from typing import Any

from sqlalchemy.orm import Session

from app.db.base import utcnow
from app.db.models import Job
from app.messaging.live_bus import LiveBus
from app.repositories.jobs import JobRepository
from app.repositories.leases import LeaseRepository
from app.repositories.models import ModelRepository
from app.repositories.sweeps import SweepRepository
from app.repositories.tenants import DatasetRepository, TenantRepository
from app.services.job_journal import record_first_statuses, record_status
from contract.spec import JobSpec
from contract.status import JobStatus


@dataclass(frozen=True)
class Rungs:
    """The ASHA of a sweep's trial, as its attempt asks it at each rung."""

    sweep_id: str
    asha: dict[str, Any]
    metric: str


@dataclass(frozen=True)
class ModelObjects:
    """An uploaded model's directory as the artifact store holds it: its folder's key (``path``,
    relative to the artifact dir with the local store) and each file's size and sha256 (empty for a
    row from before they were kept)."""

    path: str
    files: dict[str, tuple[int, str]]


@dataclass(frozen=True)
class Claim:
    """A new attempt at a job, with what its worker needs to run it."""

    attempt: int  # the fencing token of every later write of this attempt
    spec: JobSpec
    dataset_path: str | None  # the corpus's file, relative to the artifact dir; None for a builtin corpus
    char_vocab: int | None  # the dataset's distinct characters, if it has one
    corpus_bytes: int
    progress: int  # steps completed by earlier attempts
    summary: dict[str, Any]
    rungs: Rungs | None  # a trial of a sweep with ASHA
    model: ModelObjects | None = None  # model.hf.model_id's files (None: none, or deleted since)


class Promotion(StrEnum):
    """What ``promote`` did with a waiting trial."""

    PROMOTED = "promoted"
    NOT_WAITING = "not_waiting"  # not paused any more: nothing changed
    OVER_CAP = "over_cap"  # the tenant's job cap holds it back: the promotion was undone


# -- a new job ------------------------------------------------------------------------------------
def record_created(session: Session, jobs: list[Job]) -> None:
    """The first status of jobs just inserted (contract.status.INITIAL, which the repository's
    insert holds them to), as their first event."""
    record_first_statuses(session, jobs)


# -- a worker's attempt ---------------------------------------------------------------------------
def claim(session: Session, bus: LiveBus, job_id: str, owner: str, lease: timedelta) -> Claim | None:
    """``claim``: queued -> running, for a new attempt of ``owner`` under a lease; for a job of
    several nodes this worker is node 0, and the attempt's node slots open. None if the job is not
    queued (finished, or another attempt holds it)."""
    now = utcnow()
    attempt = JobRepository(session).change_status(
        job_id, "claim", JobStatus.RUNNING, now=now, lease_owner=owner, lease_expires_at=now + lease
    )
    if attempt is None:
        return None
    job = record_status(session, bus, job_id)
    if job.nnodes > 1:
        LeaseRepository(session).open_nodes(job_id, attempt, job.nnodes, owner)
    dataset = DatasetRepository(session).get_any(job.dataset_id) if job.dataset_id else None
    sweep = SweepRepository(session).get(job.sweep_id, job.tenant_id) if job.sweep_id else None
    return Claim(
        attempt=attempt,
        spec=JobSpec.model_validate(job.spec),
        dataset_path=dataset.path if dataset else None,
        char_vocab=dataset.char_vocab if dataset else None,
        corpus_bytes=dataset.bytes if dataset else 0,
        progress=job.progress_step,
        summary=dict(job.summary or {}),
        rungs=Rungs(sweep.id, dict(sweep.asha), sweep.metric) if sweep is not None and sweep.asha else None,
        model=uploaded_model(session, job),
    )


def uploaded_model(session: Session, job: Job) -> ModelObjects | None:
    """The store objects of the uploaded model the job starts from; None without one, or once it
    was deleted."""
    model_id = (job.spec["model"].get("hf") or {}).get("model_id")
    model = ModelRepository(session).get(model_id, job.tenant_id) if model_id else None
    if model is None:
        return None
    return ModelObjects(model.path, {name: (size, sha) for name, (size, sha) in (model.objects or {}).items()})


def finish(
    session: Session,
    bus: LiveBus,
    job_id: str,
    attempt: int,
    status: str,
    step: int,
    summary: dict[str, Any],
    error: dict[str, Any] | None = None,
) -> Job | None:
    """``finish``: the attempt's outcome (a final status), with the steps completed, the run's
    summary and, for a failure, its error."""
    changed = JobRepository(session).change_status(
        job_id, "finish", status, attempt=attempt, error=error, progress_step=step, summary=summary
    )
    return None if changed is None else record_status(session, bus, job_id)


def pause(session: Session, bus: LiveBus, job_id: str, attempt: int, step: int, summary: dict[str, Any]) -> Job | None:
    """``pause``: the attempt of a sweep's trial that waits at a rung (ASHA's promote form) ends,
    the job paused with the steps completed and the run's summary; a job being cancelled
    meanwhile is cancelled instead (``finish``)."""
    change = partial(JobRepository(session).change_status, job_id, attempt=attempt, progress_step=step, summary=summary)
    if (
        change("pause", JobStatus.PAUSED) is None
        and change("finish", JobStatus.CANCELLED, sources=[JobStatus.CANCELLING]) is None
    ):
        return None
    return record_status(session, bus, job_id)


def after_lost_attempt(job: Job, cause: str) -> tuple[JobStatus, dict[str, Any] | None]:
    """Where a job goes once its attempt is lost (``cause`` says how): cancelled if a cancel was
    asked, failed once ``max_restarts`` resumes are used up, else back to the queue to resume from
    its latest checkpoint."""
    if job.cancel_requested:
        return JobStatus.CANCELLED, None
    if job.attempt > job.max_restarts:
        return JobStatus.FAILED, {
            "code": "worker_lost",
            "message": f"{cause}; max_restarts ({job.max_restarts}) used up",
        }
    return JobStatus.QUEUED, None


def release(
    session: Session, bus: LiveBus, job_id: str, attempt: int, cause: str, now: datetime, lapsed: bool = False
) -> Job | None:
    """``release``: attempt ``attempt`` is lost (``cause``) and gives its job up, by
    ``after_lost_attempt``: back to the queue (sent at ``now``), or to its final state. The
    outcome is decided on the job's row as locked here, so a cancel requested since the caller
    last read it ends the job cancelled. ``lapsed``: only if the attempt's lease lapsed before
    ``now`` (the reaper's case; the attempt itself gives it up at once). None if the attempt no
    longer held the job."""
    repo = JobRepository(session)
    job = repo.locked(job_id)
    if job is None or job.attempt != attempt:
        return None  # deleted, or released already and a new attempt began
    status, error = after_lost_attempt(job, cause)
    values = {} if status == JobStatus.QUEUED else {"error": error}
    if repo.change_status(job_id, "release", status, attempt=attempt, now=now, lapsed=lapsed, **values) is None:
        return None
    return record_status(session, bus, job_id)


def cancel_requested(session: Session, job_id: str) -> bool:
    """Whether a cancel was asked of the job (its attempt stops at its next look)."""
    return JobRepository(session).cancel_requested(job_id)


# -- the API: a cancel ----------------------------------------------------------------------------
def cancel(session: Session, bus: LiveBus, job: Job) -> Job | None:
    """The cancel of ``job`` (as last read): cancelled at once if no worker holds it
    (``cancel_waiting``), cancelling until its worker stops if one does (``request_cancel``).
    None if it was in neither state, or has moved on since."""
    if job.status in (JobStatus.QUEUED, JobStatus.PAUSED):
        return cancel_waiting(session, bus, job.id)
    if job.status == JobStatus.RUNNING:
        return request_cancel(session, bus, job.id)
    return None


def cancel_waiting(session: Session, bus: LiveBus, job_id: str) -> Job | None:
    """``cancel_waiting``: a job no worker holds (queued, or a trial paused at a rung) is
    cancelled at once."""
    changed = JobRepository(session).change_status(job_id, "cancel_waiting", JobStatus.CANCELLED, cancel_requested=True)
    return None if changed is None else record_status(session, bus, job_id)


def request_cancel(session: Session, bus: LiveBus, job_id: str) -> Job | None:
    """``request_cancel``: a running job is cancelling until its worker sees the request."""
    changed = JobRepository(session).change_status(
        job_id, "request_cancel", JobStatus.CANCELLING, cancel_requested=True
    )
    return None if changed is None else record_status(session, bus, job_id)


# -- a sweep's waiting trials ---------------------------------------------------------------------
def promote(session: Session, bus: LiveBus, job_id: str, tenant_id: str, cap: int) -> Promotion:
    """``promote``: a trial paused at a rung is queued again (its caller sends its task after
    commit) to resume there, within the tenant's job ``cap``. Its next attempt is no restart after
    a lost worker: ``max_restarts`` grows by one with it."""
    if JobRepository(session).change_status(job_id, "promote", JobStatus.QUEUED) is None:
        return Promotion.NOT_WAITING
    # The change counted the job in the tenant's active jobs (by trigger), whose row this
    # transaction now holds: the count is exact. Over the cap, the change is undone.
    if TenantRepository(session).active_jobs(tenant_id) > cap:
        unpromote(session, job_id)
        return Promotion.OVER_CAP
    record_status(session, bus, job_id)
    return Promotion.PROMOTED


def unpromote(session: Session, job_id: str) -> bool:
    """``unpromote``: undo ``promote`` in the same transaction, before its status was recorded
    (so no event either); whether the job was queued."""
    return JobRepository(session).change_status(job_id, "unpromote", JobStatus.PAUSED) is not None


def stop_waiting(session: Session, bus: LiveBus, job_id: str, summary: dict[str, Any]) -> Job | None:
    """``stop_waiting``: a trial paused at a rung that its sweep will not promote is stopped
    there, with ``summary`` (where and why)."""
    changed = JobRepository(session).change_status(job_id, "stop_waiting", JobStatus.STOPPED_EARLY, summary=summary)
    return None if changed is None else record_status(session, bus, job_id)
