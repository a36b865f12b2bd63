"""Job use cases after intake (app.services.intake): get, list, cancel, metric history.

Services never commit; the request (or task) that owns the session does.
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from app.db.models import Job
from app.errors import Conflict, NotFound
from app.messaging.live_bus import LiveBus
from app.repositories.jobs import JobRepository
from app.schemas import api as schemas
from app.services import lifecycle
from app.services.auth import TenantRef
from app.services.metric_history import history
from contract.status import JobStatus

MAX_LIMIT = 100


def get_job(session: Session, tenant: TenantRef, job_id: str) -> Job:
    job = JobRepository(session).get(job_id, tenant.id)
    if job is None:
        raise NotFound(f"no job {job_id!r}", param="job_id")
    return job


def list_jobs(
    session: Session, tenant: TenantRef, limit: int, after: str | None, status: str | None
) -> schemas.JobList:
    rows = JobRepository(session).page(tenant.id, limit, after, status)
    page = rows[:limit]
    return schemas.JobList(
        data=[schemas.Job.of(j) for j in page],
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
