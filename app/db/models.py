"""The service's tables: tenants and their keys, datasets, jobs, webhooks and sweeps.

A job's rows beside its own: its node slots, events, checkpoints and metrics (series and chunks).
A webhook endpoint's: its deliveries and their attempts. A sweep's: its trials and rung decisions.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import BigInteger, Boolean, Double, ForeignKey, Index, Integer, LargeBinary, String, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column
from sqlalchemy.types import Text

from contract.status import JobStatus, SweepStatus, UploadStatus
from contract.webhooks import DeliveryStatus

from .base import Base, IdColumn, JSONDoc, Timestamped, UTCDateTime, new_id


class Tenant(Timestamped, Base):
    __tablename__ = "tenants"
    id: Mapped[str] = mapped_column(IdColumn, primary_key=True, default=lambda: new_id("ten"))
    name: Mapped[str] = mapped_column(String(100), unique=True)
    job_cap: Mapped[int | None] = mapped_column(Integer)  # overrides the global cap when set
    # Its jobs in contract.status.ACTIVE, kept by triggers on jobs (migration 0005): the job cap
    # reads one row instead of counting them. The service's code never writes it.
    active_jobs: Mapped[int] = mapped_column(Integer, server_default="0")


class ApiKey(Timestamped, Base):
    """A Bearer key, stored as its SHA-256: a lookup by hash, never the key itself."""

    __tablename__ = "api_keys"
    id: Mapped[str] = mapped_column(IdColumn, primary_key=True, default=lambda: new_id("key"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(16))  # first characters, to tell keys apart
    name: Mapped[str | None] = mapped_column(String(100))  # what it is for: "laptop", "ci"
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    # Written when the key is verified against the database and the value is over a minute old
    # (app.services.auth): precise to about a minute, at most one write per key per minute.
    last_used_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class Dataset(Timestamped, Base):
    __tablename__ = "datasets"
    id: Mapped[str] = mapped_column(IdColumn, primary_key=True, default=lambda: new_id("ds"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(200))
    bytes: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    # Distinct characters (the char tokenizer's vocabulary), counted up to CHAR_VOCAB_MAX + 1 at most:
    # that value means "more than the char tokenizer takes".
    char_vocab: Mapped[int] = mapped_column(Integer)
    # A parquet dataset's column names, as its upload read them (data.text_column is checked
    # against them at submission, with no read of the object); None for text and JSONL.
    columns: Mapped[list[str] | None] = mapped_column(JSONDoc, nullable=True)
    path: Mapped[str] = mapped_column(String(500))  # relative to MUONFORGE_ARTIFACT_DIR

    __table_args__ = (Index("ix_datasets_tenant_id_id", "tenant_id", "id"),)


class Upload(Timestamped, Base):
    """A resumable upload of a dataset or a model in parts (app.services.uploads): what it will be,
    its declared size, until when its parts are kept, and what it became."""

    __tablename__ = "uploads"
    id: Mapped[str] = mapped_column(IdColumn, primary_key=True, default=lambda: new_id("upl"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    purpose: Mapped[str] = mapped_column(String(16))  # dataset | model
    filename: Mapped[str] = mapped_column(String(200))
    name: Mapped[str] = mapped_column(String(200))
    bytes: Mapped[int] = mapped_column(BigInteger)  # declared at creation: the parts must add up to it
    status: Mapped[str] = mapped_column(String(16), default=UploadStatus.PENDING)  # contract.status.UploadStatus
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime)
    result_id: Mapped[str | None] = mapped_column(String(40), nullable=True)  # the dataset or model made

    __table_args__ = (
        Index("ix_uploads_tenant_id_id", "tenant_id", "id"),
        Index("ix_uploads_status_expires_at", "status", "expires_at"),
    )


class UploadPart(Base):
    """One part of an upload, as stored: its number (from 1), size, sha256 and store key."""

    __tablename__ = "upload_parts"
    upload_id: Mapped[str] = mapped_column(ForeignKey("uploads.id", ondelete="CASCADE"), primary_key=True)
    number: Mapped[int] = mapped_column(Integer, primary_key=True)
    bytes: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    key: Mapped[str] = mapped_column(String(500))


class UploadedModel(Timestamped, Base):
    """A transformers model directory a tenant uploaded (app.services.models): its files live under
    ``path``, its config.json is kept here for reads."""

    __tablename__ = "models"
    id: Mapped[str] = mapped_column(IdColumn, primary_key=True, default=lambda: new_id("mdl"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(200))
    model_type: Mapped[str] = mapped_column(String(64))
    parameters: Mapped[int] = mapped_column(BigInteger)
    bytes: Mapped[int] = mapped_column(BigInteger)  # the extracted files' sizes: what the storage quota counts
    sha256: Mapped[str] = mapped_column(String(64))  # of the archive as uploaded
    config: Mapped[dict[str, Any]] = mapped_column(JSONDoc)  # its config.json
    files: Mapped[list[str]] = mapped_column(JSONDoc)  # the directory's file names, sorted
    # Each file's [size, sha256] as the artifact store holds it (its key: path/name); None for a row
    # from before they were kept (such a model is read from the local store's directory alone).
    objects: Mapped[dict[str, list[Any]] | None] = mapped_column(JSONDoc, nullable=True)
    path: Mapped[str] = mapped_column(String(500))  # a directory, relative to MUONFORGE_ARTIFACT_DIR

    __table_args__ = (Index("ix_models_tenant_id_id", "tenant_id", "id"),)


class Job(Timestamped, Base):
    """One training job.

    Status changes are compare-and-set updates (app.services.lifecycle, through
    JobRepository.change_status); ``attempt`` is the fencing token of the worker attempt that
    holds the lease.
    """

    __tablename__ = "jobs"
    id: Mapped[str] = mapped_column(IdColumn, primary_key=True, default=lambda: new_id("job"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    name: Mapped[str | None] = mapped_column(String(200))
    status: Mapped[str] = mapped_column(String(16), default=JobStatus.QUEUED)
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
    # Telemetry: the seq of the job's latest event (events are numbered 1, 2, ... per job under
    # this row's lock, so they commit in seq order), and the live-bus position up to which its
    # metrics are stored (the events stream tails the bus from there).
    event_seq: Mapped[int] = mapped_column(Integer, default=0)
    telemetry_mark: Mapped[str | None] = mapped_column(String(40))
    # A warm start (init_from): the tenant's job and the step of its checkpoint this one started
    # from, resolved at intake. The retention policy keeps that checkpoint. No foreign key: SQLite
    # adds one only by copying the table, which would drop its triggers (migration 0005).
    parent_job_id: Mapped[str | None] = mapped_column(IdColumn)
    parent_step: Mapped[int | None] = mapped_column(Integer)
    # A sweep's trial: its sweep (no foreign key, for the same reason).
    sweep_id: Mapped[str | None] = mapped_column(IdColumn)
    # The parameter routing table of the model its latest attempt built (worker.engine.optimizer
    # .routing_table): written once per attempt, read by GET /v1/jobs/{id}/routing alone, so a
    # loaded Job leaves it out (read it with JobRepository.routing).
    routing: Mapped[dict[str, Any] | None] = mapped_column(JSONDoc, deferred=True, deferred_raiseload=True)

    @property
    def nnodes(self) -> int:
        """The workers that train the job together (``resources.nnodes``): its tasks per enqueue."""
        return int((self.spec.get("resources") or {}).get("nnodes", 1))

    __table_args__ = (
        Index("ix_jobs_tenant_id_id", "tenant_id", "id"),
        Index("ix_jobs_tenant_id_status_id", "tenant_id", "status", "id"),
        Index("ix_jobs_status_lease_expires_at", "status", "lease_expires_at"),
        Index("ix_jobs_dataset_id", "dataset_id"),  # a dataset's delete and its foreign key's check
        Index("ix_jobs_parent_job_id", "parent_job_id"),  # the checkpoints a job's retention keeps for others
        Index("ix_jobs_sweep_id", "sweep_id"),  # a sweep's trials
        UniqueConstraint("tenant_id", "idempotency_key", name="uq_jobs_tenant_id_idempotency_key"),
    )


class JobNode(Base):
    """A node slot of a job of several nodes (``resources.nnodes``) in its current attempt.

    It names the worker that holds it, under a lease of its own. Node 0 is the worker that claimed
    the job (the job's lease is its lease); it publishes where the others meet it: the c10d
    rendezvous, and the socket of its launcher, which global rank 0 reports to.
    """

    __tablename__ = "job_nodes"
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    node: Mapped[int] = mapped_column(Integer, primary_key=True)
    attempt: Mapped[int] = mapped_column(Integer)
    owner: Mapped[str | None] = mapped_column(String(200))  # None: free
    lease_expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    rendezvous: Mapped[str | None] = mapped_column(String(300))  # node 0: host:port of the c10d store
    run_id: Mapped[str | None] = mapped_column(String(64))  # node 0: the rendezvous's id
    report: Mapped[str | None] = mapped_column(String(300))  # node 0: host:port of its launcher's socket
    token: Mapped[str | None] = mapped_column(String(64))  # node 0: what a rank shows that socket


class JobEvent(Base):
    """Status changes, checkpoints and log lines of a job, in order (the events stream replays them)."""

    __tablename__ = "job_events"
    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    seq: Mapped[int] = mapped_column(Integer)  # 1, 2, ... per job: the events stream's cursor
    step: Mapped[int | None] = mapped_column(Integer)  # optimizer steps completed when it happened
    kind: Mapped[str] = mapped_column(String(16))  # status | checkpoint | log
    payload: Mapped[dict[str, Any]] = mapped_column(JSONDoc)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)

    __table_args__ = (UniqueConstraint("job_id", "seq", name="uq_job_events_job_id_seq"),)


class Checkpoint(Timestamped, Base):
    __tablename__ = "checkpoints"
    id: Mapped[str] = mapped_column(IdColumn, primary_key=True, default=lambda: new_id("ckpt"))
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(Integer)
    path: Mapped[str] = mapped_column(String(500))  # its key in the artifact store
    bytes: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str | None] = mapped_column(String(64))  # None: a row written before digests were kept
    attempt: Mapped[int] = mapped_column(Integer)
    metrics: Mapped[dict[str, Any]] = mapped_column(JSONDoc, default=dict)  # latest value of each metric then

    __table_args__ = (UniqueConstraint("job_id", "step", name="uq_checkpoints_job_id_step"),)


class MetricSeries(Base):
    """One metric of one job: its point count, its last step stored and its last chunk.

    The last step stored is the ingest's idempotency filter (a point at or before it is a repeat);
    new points extend the last chunk until it is full.
    """

    __tablename__ = "metric_series"
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    name: Mapped[str] = mapped_column(String(200), primary_key=True)
    points: Mapped[int] = mapped_column(BigInteger)
    first_step: Mapped[int] = mapped_column(Integer)
    last_step: Mapped[int] = mapped_column(Integer)
    tail_step: Mapped[int] = mapped_column(Integer)  # first_step of the last chunk
    tail_points: Mapped[int] = mapped_column(Integer)


class MetricChunk(Base):
    """Consecutive points of one series, stored columnar, with the chunk's min, max and last point.

    ``steps`` (int32) and ``values`` (float64) are little-endian arrays; the summary points let
    history be downsampled from summaries instead of points.
    """

    __tablename__ = "metric_chunks"
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    name: Mapped[str] = mapped_column(String(200), primary_key=True)
    first_step: Mapped[int] = mapped_column(Integer, primary_key=True)
    last_step: Mapped[int] = mapped_column(Integer)
    n: Mapped[int] = mapped_column(Integer)
    steps: Mapped[bytes] = mapped_column(LargeBinary)
    values: Mapped[bytes] = mapped_column(LargeBinary)
    min_step: Mapped[int] = mapped_column(Integer)
    min_value: Mapped[float] = mapped_column(Double)
    max_step: Mapped[int] = mapped_column(Integer)
    max_value: Mapped[float] = mapped_column(Double)
    last_value: Mapped[float] = mapped_column(Double)


class WebhookEndpoint(Timestamped, Base):
    """A tenant's webhook endpoint: its URL, the event types it takes, and the secret that signs them.

    The secret is kept as it is (signing needs it, unlike an API key, which is only compared) and is
    shown once, when the endpoint is created.
    """

    __tablename__ = "webhook_endpoints"
    id: Mapped[str] = mapped_column(IdColumn, primary_key=True, default=lambda: new_id("wh"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    url: Mapped[str] = mapped_column(String(2000))
    events: Mapped[list[str]] = mapped_column(JSONDoc)
    secret: Mapped[str] = mapped_column(String(100))

    __table_args__ = (Index("ix_webhook_endpoints_tenant_id_id", "tenant_id", "id"),)


class WebhookDelivery(Timestamped, Base):
    """One event for one endpoint (the outbox), sent until a 2xx answer or the retry window's end.

    It is inserted in the transaction of the change it reports. Its id is the ``webhook-id`` header,
    the same on every attempt, so a receiver can drop repeats.
    """

    __tablename__ = "webhook_deliveries"
    id: Mapped[str] = mapped_column(IdColumn, primary_key=True, default=lambda: new_id("msg"))
    endpoint_id: Mapped[str] = mapped_column(ForeignKey("webhook_endpoints.id", ondelete="CASCADE"))
    event_type: Mapped[str] = mapped_column(String(32))
    body: Mapped[str] = mapped_column(Text)  # the JSON sent, the same bytes on every attempt (they are signed)
    status: Mapped[str] = mapped_column(String(16), default=DeliveryStatus.PENDING)
    attempts: Mapped[int] = mapped_column(Integer, default=0)  # claimed so far: the fencing token of the latest
    # When it is due (pending), or the end of the lease of the attempt that claimed it; null once it
    # is delivered or failed, so the due-delivery index holds pending ones only.
    next_attempt_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    last_error: Mapped[str | None] = mapped_column(String(500))
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)

    __table_args__ = (
        Index("ix_webhook_deliveries_endpoint_id_id", "endpoint_id", "id"),
        Index("ix_webhook_deliveries_next_attempt_at", "next_attempt_at"),
    )


class WebhookAttempt(Base):
    """One try at a delivery: when, how long, and the answer's status code or the error."""

    __tablename__ = "webhook_attempts"
    delivery_id: Mapped[str] = mapped_column(ForeignKey("webhook_deliveries.id", ondelete="CASCADE"), primary_key=True)
    number: Mapped[int] = mapped_column(Integer, primary_key=True)  # 1, 2, ... per delivery
    at: Mapped[datetime] = mapped_column(UTCDateTime)
    duration_ms: Mapped[int] = mapped_column(Integer)
    status_code: Mapped[int | None] = mapped_column(Integer)
    error: Mapped[str | None] = mapped_column(String(500))


class Sweep(Timestamped, Base):
    """A hyperparameter sweep: a base JobSpec, a search space, and its trials (SweepTrial).

    The trials run as ordinary jobs, at most ``max_concurrent`` at a time. Its row is the lock that
    serializes the sweep's decisions: which trial starts next, and each ASHA decision (SweepRung).
    """

    __tablename__ = "sweeps"
    id: Mapped[str] = mapped_column(IdColumn, primary_key=True, default=lambda: new_id("swp"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    name: Mapped[str | None] = mapped_column(String(200))
    status: Mapped[str] = mapped_column(String(16), default=SweepStatus.RUNNING)
    request: Mapped[dict[str, Any]] = mapped_column(JSONDoc)  # the validated request, defaults filled in
    metric: Mapped[str] = mapped_column(String(64))
    mode: Mapped[str] = mapped_column(String(8))  # min | max
    max_concurrent: Mapped[int] = mapped_column(Integer)
    asha: Mapped[dict[str, Any] | None] = mapped_column(JSONDoc)  # {rungs, reduction_factor} or null
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    idempotency_key: Mapped[str | None] = mapped_column(String(200))
    request_hash: Mapped[str | None] = mapped_column(String(64))  # of the validated request

    __table_args__ = (
        Index("ix_sweeps_tenant_id_id", "tenant_id", "id"),
        Index("ix_sweeps_status", "status"),  # the running sweeps the reaper advances
        Index("uq_sweeps_tenant_id_idempotency_key", "tenant_id", "idempotency_key", unique=True),
    )


class SweepTrial(Base):
    """One trial of a sweep: its parameters and its validated JobSpec, stored at submission; its
    job once started (null while it waits for a slot)."""

    __tablename__ = "sweep_trials"
    sweep_id: Mapped[str] = mapped_column(ForeignKey("sweeps.id", ondelete="CASCADE"), primary_key=True)
    number: Mapped[int] = mapped_column(Integer, primary_key=True)  # 0, 1, ...: the order trials start in
    params: Mapped[dict[str, Any]] = mapped_column(JSONDoc)  # {spec path: value}
    spec: Mapped[dict[str, Any]] = mapped_column(JSONDoc)
    job_id: Mapped[str | None] = mapped_column(IdColumn, unique=True)
    # Why it could not start (its dataset was deleted meanwhile, ...): it counts as finished.
    error: Mapped[dict[str, Any] | None] = mapped_column(JSONDoc)


class SweepRung(Base):
    """A trial's metric at an ASHA rung and the decision taken on it, once.

    The unique (job, rung) key makes a second decision impossible; a retry or a resumed attempt
    reads this one. ``position`` is its order among the results recorded at the rung (1, 2, ...),
    the order the rule saw them in.
    """

    __tablename__ = "sweep_rungs"
    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    sweep_id: Mapped[str] = mapped_column(ForeignKey("sweeps.id", ondelete="CASCADE"))
    job_id: Mapped[str] = mapped_column(IdColumn)
    rung: Mapped[int] = mapped_column(Integer)  # the step
    position: Mapped[int] = mapped_column(Integer)
    value: Mapped[float] = mapped_column(Double)
    go_on: Mapped[bool] = mapped_column(Boolean)  # went on at once (true); else stopped or waits (promote form)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    promoted_at: Mapped[datetime | None] = mapped_column(UTCDateTime)  # a waiting trial's promotion past the rung

    __table_args__ = (
        UniqueConstraint("job_id", "rung", name="uq_sweep_rungs_job_id_rung"),
        UniqueConstraint("sweep_id", "rung", "position", name="uq_sweep_rungs_sweep_id_rung_position"),
    )
