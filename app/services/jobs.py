"""Job use cases: create (validate, cap, idempotency, enqueue after commit), list, get, cancel.
Services never commit; the request (or task) that owns the session does."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from app.db.base import utcnow
from app.db.models import Job, Tenant
from app.errors import Conflict, NotFound, RateLimited, ValidationFailed
from app.queue import enqueue_train
from app.repositories.jobs import JobRepository
from app.repositories.tenants import DatasetRepository
from app.schemas import JobSpec
from app.schemas import api as schemas
from app.services.caps import check_caps
from app.settings import Settings

SYNTHETIC_VOCAB = 64  # the engine's builtin synthetic task
MAX_LIMIT = 100


def after_commit(session: Session, action) -> None:
    """Run ``action`` once the request's transaction has committed (enqueue after commit)."""
    session.info.setdefault("after_commit", []).append(action)


def request_hash(spec: dict[str, Any]) -> str:
    """Of the validated spec, defaults filled in: bodies that mean the same job hash the same."""
    return hashlib.sha256(json.dumps(spec, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def queue_for(spec: JobSpec) -> str:
    """Workers listen on their device class ("cpu", "cuda") and on "default" (device: auto)."""
    return "default" if spec.train.device == "auto" else spec.train.device


def status_event(repo: JobRepository, job: Job, refresh: bool = True) -> None:
    """Record the job's current state as a status event. ``refresh`` re-reads the row (needed
    after a compare-and-set UPDATE, which bypasses the loaded object)."""
    if refresh:
        repo.session.refresh(job)
    repo.add_event(job.id, "status", schemas.Job.of(job).model_dump(mode="json"))


def create_job(
    session: Session, tenant: Tenant, spec: JobSpec, idempotency_key: str | None, settings: Settings
) -> tuple[Job, bool]:
    """Returns (job, created). A replay of the same key and body returns the first job."""
    repo = JobRepository(session)
    dumped = spec.model_dump(mode="json")
    digest = request_hash(dumped)
    if idempotency_key:
        existing = repo.by_idempotency_key(tenant.id, idempotency_key)
        if existing is not None:
            return _replay(existing, digest), False
    vocab = _vocabulary(session, tenant, spec)
    check_caps(dumped, vocab, settings)
    cap = tenant.job_cap or settings.tenant_job_cap
    if repo.count_active(tenant.id) >= cap:
        raise RateLimited(f"this tenant already has {cap} queued or running jobs (the cap)", retry_after=30)
    job = Job(
        tenant_id=tenant.id, name=spec.name, status="queued", spec=dumped, queue=queue_for(spec),
        dataset_id=spec.data.dataset_id, idempotency_key=idempotency_key, request_hash=digest,
        max_restarts=spec.train.max_restarts, total_steps=spec.train.steps, summary={}, enqueued_at=utcnow(),
        attempt=0, progress_step=0, cancel_requested=False,
    )  # fmt: skip
    if idempotency_key is None:
        repo.add(job)
    else:  # a savepoint (two round trips) only where a concurrent replay can collide
        try:
            with session.begin_nested():
                repo.add(job)
        except IntegrityError:  # a concurrent request with the same key won the insert
            existing = repo.by_idempotency_key(tenant.id, idempotency_key)
            if existing is None:
                raise
            return _replay(existing, digest), False
    status_event(repo, job, refresh=False)  # just inserted: the object is the row
    after_commit(session, lambda: enqueue_train(settings, job.id, job.queue))
    return job, True


def _replay(existing: Job, digest: str) -> Job:
    if existing.request_hash != digest:
        raise Conflict("this Idempotency-Key was used with a different request body", param="Idempotency-Key")
    return existing


def _vocabulary(session: Session, tenant: Tenant, spec: JobSpec) -> int:
    if spec.data.path is not None:
        raise ValidationFailed("data.path is for local runs; upload the corpus and use data.dataset_id", "data.path")
    if spec.data.builtin == "synthetic":
        return SYNTHETIC_VOCAB
    dataset = DatasetRepository(session).get(spec.data.dataset_id, tenant.id)
    if dataset is None:
        raise ValidationFailed(f"no dataset {spec.data.dataset_id!r} for this tenant", param="data.dataset_id")
    return 256 if spec.data.tokenizer == "byte" else dataset.char_vocab


def get_job(session: Session, tenant: Tenant, job_id: str) -> Job:
    job = JobRepository(session).get(job_id, tenant.id)
    if job is None:
        raise NotFound(f"no job {job_id!r}", param="job_id")
    return job


def list_jobs(session: Session, tenant: Tenant, limit: int, after: str | None, status: str | None) -> schemas.JobList:
    rows = JobRepository(session).page(tenant.id, limit, after, status)
    page = rows[:limit]
    return schemas.JobList(
        data=[schemas.Job.of(j) for j in page],
        has_more=len(rows) > limit,
        next_after=page[-1].id if len(rows) > limit else None,
    )


def cancel_job(session: Session, tenant: Tenant, job_id: str) -> Job:
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
