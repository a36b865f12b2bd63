"""Tables of the service: tenants, API keys, datasets, jobs, job events and checkpoints."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import BigInteger, Boolean, ForeignKey, Index, Integer, String, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from .base import Base, IdColumn, JSONDoc, Timestamped, UTCDateTime, new_id

JOB_STATUSES = ("queued", "running", "cancelling", "succeeded", "failed", "cancelled")
ACTIVE_STATUSES = ("queued", "running", "cancelling")
FINISHED_STATUSES = ("succeeded", "failed", "cancelled")


class Tenant(Timestamped, Base):
    __tablename__ = "tenants"
    id: Mapped[str] = mapped_column(IdColumn, primary_key=True, default=lambda: new_id("ten"))
    name: Mapped[str] = mapped_column(String(100), unique=True)
    job_cap: Mapped[int | None] = mapped_column(Integer)  # overrides the global cap when set


class ApiKey(Timestamped, Base):
    """A Bearer key, stored as its SHA-256: a lookup by hash, never the key itself."""

    __tablename__ = "api_keys"
    id: Mapped[str] = mapped_column(IdColumn, primary_key=True, default=lambda: new_id("key"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(16))  # first characters, to tell keys apart
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class Dataset(Timestamped, Base):
    __tablename__ = "datasets"
    id: Mapped[str] = mapped_column(IdColumn, primary_key=True, default=lambda: new_id("ds"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(200))
    bytes: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    char_vocab: Mapped[int] = mapped_column(Integer)  # distinct characters: the char tokenizer's vocabulary
    path: Mapped[str] = mapped_column(String(500))  # relative to MUONFORGE_ARTIFACT_DIR

    __table_args__ = (Index("ix_datasets_tenant_id_id", "tenant_id", "id"),)


class Job(Timestamped, Base):
    """One training job. Status changes are compare-and-set updates (see JobRepository);
    ``attempt`` is the fencing token of the worker attempt that holds the lease."""

    __tablename__ = "jobs"
    id: Mapped[str] = mapped_column(IdColumn, primary_key=True, default=lambda: new_id("job"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    name: Mapped[str | None] = mapped_column(String(200))
    status: Mapped[str] = mapped_column(String(16), default="queued")
    spec: Mapped[dict[str, Any]] = mapped_column(JSONDoc)
    queue: Mapped[str] = mapped_column(String(32), default="cpu")
    dataset_id: Mapped[str | None] = mapped_column(ForeignKey("datasets.id", ondelete="RESTRICT"))
    idempotency_key: Mapped[str | None] = mapped_column(String(200))
    request_hash: Mapped[str | None] = mapped_column(String(64))
    # Attempts and leases.
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    max_restarts: Mapped[int] = mapped_column(Integer, default=3)
    lease_owner: Mapped[str | None] = mapped_column(String(200))
    lease_expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    heartbeat_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    enqueued_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    # Progress and outcome.
    progress_step: Mapped[int] = mapped_column(Integer, default=0)
    total_steps: Mapped[int] = mapped_column(Integer)
    summary: Mapped[dict[str, Any]] = mapped_column(JSONDoc, default=dict)
    error: Mapped[dict[str, Any] | None] = mapped_column(JSONDoc)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)

    __table_args__ = (
        Index("ix_jobs_tenant_id_id", "tenant_id", "id"),
        Index("ix_jobs_tenant_id_status_id", "tenant_id", "status", "id"),
        Index("ix_jobs_status_lease_expires_at", "status", "lease_expires_at"),
        UniqueConstraint("tenant_id", "idempotency_key", name="uq_jobs_tenant_id_idempotency_key"),
    )


class JobEvent(Base):
    """Status changes, checkpoints and log lines of a job, in order (the events stream replays them)."""

    __tablename__ = "job_events"
    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    kind: Mapped[str] = mapped_column(String(16))  # status | checkpoint | log
    payload: Mapped[dict[str, Any]] = mapped_column(JSONDoc)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)


class Checkpoint(Timestamped, Base):
    __tablename__ = "checkpoints"
    id: Mapped[str] = mapped_column(IdColumn, primary_key=True, default=lambda: new_id("ckpt"))
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(Integer)
    path: Mapped[str] = mapped_column(String(500))  # relative to MUONFORGE_ARTIFACT_DIR
    bytes: Mapped[int] = mapped_column(BigInteger)
    attempt: Mapped[int] = mapped_column(Integer)

    __table_args__ = (UniqueConstraint("job_id", "step", name="uq_checkpoints_job_id_step"),)
