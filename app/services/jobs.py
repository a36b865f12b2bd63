"""Job use cases after intake (app.services.intake): get, list, cancel, metric history.

Services never commit; the request (or task) that owns the session does.
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from app.db.models import Job
from app.errors import Conflict, NotFound
from app.messaging.live_bus import LiveBus
from app.repositories.jobs import JobRepository
from app.repositories.metrics import MetricRepository
from app.schemas import api as schemas
from app.services import lifecycle
from app.services.auth import TenantRef
from app.services.metric_history import history
from contract import metrics
from contract.status import JobStatus

MAX_LIMIT = 100


def get_job(session: Session, tenant: TenantRef, job_id: str) -> Job:
    job = JobRepository(session).get(job_id, tenant.id)
    if job is None:
        raise NotFound(f"no job {job_id!r}", param="job_id")
    return job


def show_job(session: Session, tenant: TenantRef, job_id: str) -> schemas.Job:
    """The job as the API shows it: with the step of its val_loss, and while it is queued, the
    queued jobs ahead of it."""
    job = get_job(session, tenant, job_id)
    ahead = JobRepository(session).queued_ahead(job) if job.status == JobStatus.QUEUED else None
    return schemas.Job.of(job, val_loss_step=val_loss_steps(session, [job]).get(job.id), queue_position=ahead)


def val_loss_steps(session: Session, jobs: list[Job]) -> dict[str, int]:
    """The step of each job's latest val_loss (the one its summary holds), by job; one query."""
    return MetricRepository(session).last_steps([j.id for j in jobs], metrics.VAL_LOSS)


def list_jobs(
    session: Session, tenant: TenantRef, limit: int, after: str | None, status: str | None, trials: bool | None = None
) -> schemas.JobList:
    """Newest first; ``trials``: False leaves out sweeps' trials, True keeps only them."""
    rows = JobRepository(session).page(tenant.id, limit, after, status, trials)
    page = rows[:limit]
    steps = val_loss_steps(session, page)
    return schemas.JobList(
        data=[schemas.Job.of(j, val_loss_step=steps.get(j.id)) for j in page],
        has_more=len(rows) > limit,
        next_after=page[-1].id if len(rows) > limit else None,
    )


def cancel_job(session: Session, tenant: TenantRef, job_id: str, bus: LiveBus) -> Job:
    """queued or paused: cancelled at once; running: cancelling until the worker stops; finished: 409."""
    for _ in range(3):  # a concurrent status change makes the compare-and-set miss: look again
        job = get_job(session, tenant, job_id)
        if job.status == JobStatus.CANCELLING:
            return job
        if JobStatus(job.status).finished:
            raise Conflict(f"job {job_id} has already finished ({job.status})")
        if (changed := lifecycle.cancel(session, bus, job)) is not None:
            return changed
    raise Conflict(f"job {job_id} kept changing state; try again")


def metric_history(
    session: Session,
    tenant: TenantRef,
    job_id: str,
    names: str | None,
    max_points: int,
    from_step: int | None,
    to_step: int | None,
) -> schemas.MetricHistory:
    get_job(session, tenant, job_id)  # 404 for another tenant's job (a from_step after to_step: no points)
    wanted = [n for n in names.split(",") if n.strip()] if names else None
    series = history(session, job_id, [n.strip() for n in wanted] if wanted else None, max_points, from_step, to_step)
    return schemas.MetricHistory(job_id=job_id, series=series)
