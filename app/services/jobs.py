"""Job use cases: create (prepare: validate, cap, idempotency; then insert, in batches, see
JobWriter), list, get, cancel. Services never commit; the request (or task, or the JobWriter)
that owns the session does."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import partial
from typing import Any

from sqlalchemy.orm import Session

from app.db.base import new_id, utcnow
from app.db.models import Job
from app.errors import Conflict, NotFound, RateLimited, ValidationFailed
from app.repositories.jobs import JobRepository
from app.repositories.tenants import DatasetRepository
from app.schemas import JobSpec
from app.schemas import api as schemas
from app.services import telemetry
from app.services.admission import Admission
from app.services.auth import TenantRef
from app.services.caps import check_caps
from app.settings import Settings

SYNTHETIC_VOCAB = 64  # the engine's builtin synthetic task
MAX_LIMIT = 100


def request_hash(spec: dict[str, Any]) -> str:
    """Of the validated spec, defaults filled in: bodies that mean the same job hash the same."""
    return hashlib.sha256(json.dumps(spec, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def queue_for(spec: JobSpec) -> str:
    """Workers listen on their device class ("cpu", "cuda") and on "default" (device: auto)."""
    return "default" if spec.train.device == "auto" else spec.train.device


def status_event(repo: JobRepository, job: Job) -> None:
    """Record the job's current state as a status event. The row is read again first: a
    compare-and-set UPDATE bypasses the loaded object."""
    repo.session.refresh(job)
    repo.add_event(job.id, "status", schemas.Job.of(job).model_dump(mode="json"), step=job.progress_step)


@dataclass
class NewJob:
    """A validated submission, ready to insert: the job's row and its request hash."""

    row: dict[str, Any]
    digest: str

    def job(self) -> Job:
        return Job(**self.row)


def prepare_job(
    session: Session,
    tenant: TenantRef,
    spec: JobSpec,
    idempotency_key: str | None,
    settings: Settings,
    admission: Admission | None = None,
) -> Job | NewJob:
    """Everything a submission needs before its insert: the replay of a known Idempotency-Key
    (returns that job), the dataset, the resource caps and the tenant's job cap (returns the
    new job's row). ``admission`` (the API process's) spares most submissions an exact count."""
    repo = JobRepository(session)
    dumped = spec.model_dump(mode="json")
    digest = request_hash(dumped)
    if idempotency_key:
        existing = repo.by_idempotency_key(tenant.id, idempotency_key)
        if existing is not None:
            return _replay(existing, digest)
    vocab = _vocabulary(session, tenant, spec)
    check_caps(dumped, vocab, settings)
    cap = tenant.job_cap or settings.tenant_job_cap
    count_active = partial(repo.count_active, tenant.id)
    if not (admission.admit(tenant.id, cap, count_active) if admission else count_active() < cap):
        raise RateLimited(f"this tenant already has {cap} queued or running jobs (the cap)", retry_after=30)
    now = utcnow()
    row = dict(
        id=new_id("job"), created_at=now, tenant_id=tenant.id, name=spec.name, status="queued", spec=dumped,
        queue=queue_for(spec), dataset_id=spec.data.dataset_id, idempotency_key=idempotency_key,
        request_hash=digest, max_restarts=spec.train.max_restarts, total_steps=spec.train.steps, summary={},
        enqueued_at=now, attempt=0, progress_step=0, cancel_requested=False, event_seq=1,
    )  # fmt: skip
    return NewJob(row, digest)


def insert_jobs(session: Session, new_jobs: list[NewJob]) -> list[tuple[Job, bool] | Exception]:
    """Insert prepared jobs and their first status event, in one statement per table. A job
    whose Idempotency-Key another request inserted first is that request's replay (or a 409).
    Returns, per job, (job, created) or the error that job answers with."""
    repo = JobRepository(session)
    inserted = repo.insert_new([n.row for n in new_jobs])
    results: list[tuple[Job, bool] | Exception] = []
    events = []
    for new in new_jobs:
        if new.row["id"] in inserted:
            job = new.job()
            events.append((job.id, 0, "status", schemas.Job.of(job).model_dump(mode="json")))
            results.append((job, True))
            continue
        key = new.row["idempotency_key"]
        existing = repo.by_idempotency_key(new.row["tenant_id"], key) if key else None
        if existing is None:  # only a concurrent insert with the same key skips a row
            results.append(RuntimeError(f"job {new.row['id']} was not inserted"))
            continue
        try:
            results.append((_replay(existing, new.digest), False))
        except Conflict as exc:
            results.append(exc)
    repo.add_first_events(events)
    return results


def _replay(existing: Job, digest: str) -> Job:
    if existing.request_hash != digest:
        raise Conflict("this Idempotency-Key was used with a different request body", param="Idempotency-Key")
    return existing


def _vocabulary(session: Session, tenant: TenantRef, spec: JobSpec) -> int:
    if spec.data.path is not None:
        raise ValidationFailed("data.path is for local runs; upload the corpus and use data.dataset_id", "data.path")
    if spec.data.builtin == "synthetic":
        return SYNTHETIC_VOCAB
    dataset = DatasetRepository(session).get(spec.data.dataset_id, tenant.id)
    if dataset is None:
        raise ValidationFailed(f"no dataset {spec.data.dataset_id!r} for this tenant", param="data.dataset_id")
    return 256 if spec.data.tokenizer == "byte" else dataset.char_vocab


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


def cancel_job(session: Session, tenant: TenantRef, job_id: str) -> Job:
    """queued: cancelled at once; running: cancelling until the worker stops; finished: 409."""
    repo = JobRepository(session)
    for _ in range(3):  # a concurrent status change makes the compare-and-set miss: look again
        job = get_job(session, tenant, job_id)
        if job.status == "cancelling":
            return job
        if job.status in ("succeeded", "failed", "cancelled"):
            raise Conflict(f"job {job_id} has already finished ({job.status})")
        changed = repo.cancel_queued(job_id, utcnow()) if job.status == "queued" else repo.request_cancel(job_id)
        if changed:
            status_event(repo, job)
            return job
    raise Conflict(f"job {job_id} kept changing state; try again")


def metric_history(
    session: Session, tenant: TenantRef, job_id: str, names: str | None, max_points: int, from_step: int | None,
    to_step: int | None,
) -> schemas.MetricHistory:  # fmt: skip
    get_job(session, tenant, job_id)  # 404 for another tenant's job
    if from_step is not None and to_step is not None and from_step > to_step:
        raise ValidationFailed(f"from_step ({from_step}) is after to_step ({to_step})", param="from_step")
    wanted = [n for n in names.split(",") if n.strip()] if names else None
    series = telemetry.history(session, job_id, [n.strip() for n in wanted] if wanted else None, max_points,
                               from_step, to_step)  # fmt: skip
    return schemas.MetricHistory(job_id=job_id, series=series)
