"""A job submission prepared: the replay of a known Idempotency-Key, every check, the job's row.

The first stage of the job intake (app.services.intake), run in the request's unit of work; a
sweep's trials take the same checks (``check_spec``) and the same path.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import partial
from typing import Any, overload

from sqlalchemy.orm import Session

from app.db.base import new_id, utcnow
from app.db.models import Job
from app.errors import Conflict, RateLimited, TenantSuspended, ValidationFailed
from app.repositories.jobs import JobRepository
from app.repositories.tenants import DatasetRepository, TenantRepository
from app.services.admission import Admission
from app.services.auth import TenantRef
from app.services.caps import check_caps
from app.services.model_start import from_uploaded_model
from app.services.tenants import job_cap
from app.services.warm_start import resolve_init_from
from app.settings import Settings
from contract.documents import file_format
from contract.spec import DataSpec, JobSpec
from contract.status import INITIAL
from worker.engine.facts import CHAR_VOCAB_MAX, vocabulary


@dataclass
class Submission:
    """A validated submission of a new job: its row, to insert."""

    digest: str  # request_hash of the validated spec
    row: dict[str, Any]  # the jobs table's columns
    cap: int  # the tenant's job cap, checked again, exactly, where the row is inserted


def request_hash(spec: dict[str, Any]) -> str:
    """Of the validated spec, defaults filled in: bodies that mean the same job hash the same."""
    return hashlib.sha256(json.dumps(spec, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def queue_for(spec: JobSpec) -> str:
    """Workers listen on their device class ("cpu", "cuda") and on "default" (device: auto)."""
    return "default" if spec.train.device == "auto" else spec.train.device


@overload
def prepare_submission(
    session: Session,
    tenant: TenantRef,
    spec: JobSpec,
    idempotency_key: None,
    settings: Settings,
    admission: Admission | None = None,
) -> Submission: ...


@overload
def prepare_submission(
    session: Session,
    tenant: TenantRef,
    spec: JobSpec,
    idempotency_key: str | None,
    settings: Settings,
    admission: Admission | None = None,
) -> Submission | Job: ...


def prepare_submission(
    session: Session,
    tenant: TenantRef,
    spec: JobSpec,
    idempotency_key: str | None,
    settings: Settings,
    admission: Admission | None = None,
) -> Submission | Job:
    """Everything a submission needs before its insert: the replay of a known Idempotency-Key,
    the dataset, the resource caps, the warm start's checkpoint and the tenant's job cap.
    ``admission`` (the API process's) spares most submissions the read of the tenant's active
    jobs (a round trip)."""
    repo = JobRepository(session)
    digest = request_hash(with_server_limits(spec, settings).stored())
    if idempotency_key:
        existing = repo.by_idempotency_key(tenant.id, idempotency_key)
        if existing is not None:
            return replay(existing, digest)
    cap = job_cap(tenant.job_cap, settings.tenant_job_cap)
    if cap <= 0:
        raise TenantSuspended("this tenant is suspended: it may not start jobs (ask the service's operators)")
    spec = check_spec(session, tenant, spec, settings)
    active_jobs = partial(TenantRepository(session).active_jobs, tenant.id)
    if not (admission.admit(tenant.id, cap, active_jobs) if admission else active_jobs() < cap):
        raise cap_reached(cap)
    now = utcnow()
    row = dict(
        id=new_id("job"),
        created_at=now,
        tenant_id=tenant.id,
        name=spec.name,
        status=INITIAL,
        spec=spec.stored(),
        queue=queue_for(spec),
        dataset_id=spec.data.dataset_id,
        idempotency_key=idempotency_key,
        request_hash=digest,
        max_restarts=spec.train.max_restarts,
        total_steps=spec.train.steps,
        summary={},
        enqueued_at=now,
        attempt=0,
        progress_step=0,
        cancel_requested=False,
        event_seq=1,
        sweep_id=None,
        parent_job_id=spec.init_from.job_id if spec.init_from else None,
        parent_step=spec.init_from.step if spec.init_from else None,
    )
    return Submission(digest, row, cap)


def no_dataset(dataset_id: str) -> ValidationFailed:
    return ValidationFailed(f"no dataset {dataset_id!r} for this tenant", param="data.dataset_id")


def no_checkpoint(job_id: str, step: int) -> ValidationFailed:
    return ValidationFailed(
        f"job {job_id!r} no longer has a checkpoint at step {step} (its retention policy removed it meanwhile); "
        "submit again from another step",
        param="init_from.step",
    )


def cap_reached(cap: int) -> RateLimited:
    return RateLimited(f"this tenant already has {cap} queued or running jobs (the cap)", retry_after=30)


def replay(existing: Job, digest: str) -> Job:
    """The job a repeated Idempotency-Key answers with, if the body is the same."""
    if existing.request_hash != digest:
        raise Conflict("this Idempotency-Key was used with a different request body", param="Idempotency-Key")
    return existing


def with_server_limits(spec: JobSpec, settings: Settings) -> JobSpec:
    """The spec as this server runs it: an unset ``train.max_minutes`` is the server's limit,
    which the stored spec then shows."""
    if spec.train.max_minutes is not None:
        return spec
    train = spec.train.model_copy(update={"max_minutes": settings.max_job_minutes})
    return spec.model_copy(update={"train": train})


def check_spec(session: Session, tenant: TenantRef, spec: JobSpec, settings: Settings) -> JobSpec:
    """Every check of a job's spec before its insert, bar the job cap: its dataset, the resource
    caps and a warm start's checkpoint. Returns the spec as the service runs it: the server's time
    limit filled in, an uploaded model's config and vocabulary filled in, and ``init_from.step``
    resolved (the stored spec names the file the worker loads)."""
    spec = from_uploaded_model(session, tenant, with_server_limits(spec, settings), settings)
    vocab, corpus_bytes = data_facts(session, tenant, spec.data)
    check_caps(spec, vocab, corpus_bytes, settings)
    return spec.model_copy(update={"init_from": resolve_init_from(session, tenant, spec, vocab)})


def data_facts(session: Session, tenant: TenantRef, data: DataSpec) -> tuple[int, int]:
    """(vocabulary size, corpus bytes) of a validated spec's ``data``, as the engine will see them
    (for the parameter and memory caps). Refused here: a dataset with more distinct characters
    than the char tokenizer takes, a data.format other than the dataset's, a parquet dataset
    without data.text_column."""
    if data.path is not None:
        raise ValidationFailed("data.path is for local runs; upload the corpus and use data.dataset_id", "data.path")
    if data.dataset_id is None:
        return vocabulary(data), 0
    dataset = DatasetRepository(session).get(data.dataset_id, tenant.id)
    if dataset is None:
        raise no_dataset(data.dataset_id)
    if data.tokenizer == "char" and dataset.char_vocab > CHAR_VOCAB_MAX:  # counted up to CHAR_VOCAB_MAX + 1
        raise ValidationFailed(
            f"the dataset has more than {CHAR_VOCAB_MAX:,} distinct characters, the most the char tokenizer "
            "takes: use tokenizer byte",
            param="data.tokenizer",
        )
    fmt = file_format(dataset.path)
    if data.format not in ("auto", fmt):
        raise ValidationFailed(
            f"dataset {dataset.id} is {fmt}, not {data.format}: leave data.format out (auto)", param="data.format"
        )
    if fmt == "parquet" and data.text_column not in (columns := dataset.columns or []):
        raise ValidationFailed(
            f"dataset {dataset.id} has no column {data.text_column!r}; its columns: {', '.join(columns)}",
            param="data.text_column",
        )
    return vocabulary(data, dataset.char_vocab), dataset.bytes
