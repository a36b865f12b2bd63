"""/v1/jobs: thin routes over app.services.jobs."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Response

from app.deps import CurrentTenant, SessionDep, SettingsDep
from app.schemas import JobSpec
from app.schemas import api as schemas
from app.services import jobs as service

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])
ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": schemas.ErrorBody} for code in (401, 404, 409, 422, 429)
}  # fmt: skip


@router.post("", status_code=201, response_model=schemas.Job, responses=ERRORS)
def create_job(
    tenant: CurrentTenant,
    session: SessionDep,
    settings: SettingsDep,
    response: Response,
    spec: JobSpec,
    idempotency_key: Annotated[str | None, Header(max_length=200)] = None,
) -> schemas.Job:
    """Validate a JobSpec, store it and queue it. A replay with the same `Idempotency-Key` and
    body answers 200 with the same job; the same key with another body is 409."""
    job, created = service.create_job(session, tenant, spec, idempotency_key, settings)
    if not created:
        response.status_code = 200
    return schemas.Job.of(job)


@router.get("", response_model=schemas.JobList, responses=ERRORS)
def list_jobs(
    tenant: CurrentTenant,
    session: SessionDep,
    status: schemas.JobStatus | None = None,
    limit: Annotated[int, Query(ge=1, le=service.MAX_LIMIT)] = 20,
    after: str | None = None,
) -> schemas.JobList:
    """Newest first. Pass the previous page's `next_after` as `after`."""
    return service.list_jobs(session, tenant, limit, after, status)


@router.get("/{job_id}", response_model=schemas.Job, responses=ERRORS)
def get_job(job_id: str, tenant: CurrentTenant, session: SessionDep) -> schemas.Job:
    return schemas.Job.of(service.get_job(session, tenant, job_id))


@router.post("/{job_id}/cancel", response_model=schemas.Job, responses=ERRORS)
def cancel_job(job_id: str, tenant: CurrentTenant, session: SessionDep) -> schemas.Job:
    """Queued: cancelled at once. Running: `cancelling` until the worker stops. Finished: 409."""
    return schemas.Job.of(service.cancel_job(session, tenant, job_id))
