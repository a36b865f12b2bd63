"""/v1/jobs: thin routes over app.services.jobs."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Response

from app.db.models import Job
from app.deps import Work
from app.schemas import JobSpec
from app.schemas import api as schemas
from app.services import jobs as service

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])
ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": schemas.ErrorBody} for code in (401, 404, 409, 422, 429)
}  # fmt: skip


@router.post("", status_code=201, response_model=schemas.Job, responses=ERRORS)
async def create_job(
    spec: JobSpec,
    work: Work,
    response: Response,
    idempotency_key: Annotated[str | None, Header(max_length=200)] = None,
) -> schemas.Job:
    """Validate a JobSpec, store it and queue it. A replay with the same `Idempotency-Key` and
    body answers 200 with the same job; the same key with another body is 409."""
    prepared = await work(service.prepare_job, spec, idempotency_key, work.settings, work.admission)
    job, created = (prepared, False) if isinstance(prepared, Job) else await work.writer.insert(prepared)
    if not created:
        response.status_code = 200
    return schemas.Job.of(job)


@router.get("", response_model=schemas.JobList, responses=ERRORS)
async def list_jobs(
    work: Work,
    status: schemas.JobStatus | None = None,
    limit: Annotated[int, Query(ge=1, le=service.MAX_LIMIT)] = 20,
    after: str | None = None,
) -> schemas.JobList:
    """Newest first. Pass the previous page's `next_after` as `after`."""
    return await work(service.list_jobs, limit, after, status)


@router.get("/{job_id}", response_model=schemas.Job, responses=ERRORS)
async def get_job(job_id: str, work: Work) -> schemas.Job:
    return schemas.Job.of(await work(service.get_job, job_id))


@router.post("/{job_id}/cancel", response_model=schemas.Job, responses=ERRORS)
async def cancel_job(job_id: str, work: Work) -> schemas.Job:
    """Queued: cancelled at once. Running: `cancelling` until the worker stops. Finished: 409."""
    return schemas.Job.of(await work(service.cancel_job, job_id))
