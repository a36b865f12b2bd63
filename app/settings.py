"""The one Settings class: every setting is a MUONFORGE_* environment variable.

Unset MUONFORGE_DATABASE_URL / MUONFORGE_REDIS_URL mean the embedded default: a SQLite file
and a SQLite-backed broker under ./var, no server needed.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from app.services.webhook_destinations import AllowList

VAR = Path("var")
MEMORY_SHARE = 0.8  # of the machine's (or container's) memory, a job's by default; the rest: the worker, the OS


def machine_memory_bytes() -> int:
    """This machine's memory, or its container's limit where lower (cgroup v2, then v1)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit_file).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def default_job_memory() -> int:
    return int(MEMORY_SHARE * machine_memory_bytes())


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="MUONFORGE_", extra="ignore")

    database_url: str | None = Field(None, description="postgresql+psycopg://… ; unset: SQLite under ./var")
    redis_url: str | None = Field(None, description="redis://… (broker and live bus); unset: SQLite broker under ./var")
    artifact_dir: Path = Field(VAR / "artifacts", description="Checkpoints, corpora and run outputs.")
    artifact_url: str | None = Field(
        None,
        description="s3://bucket/prefix: artifacts in an S3-compatible object store (AWS, MinIO, Ceph, R2), its "
        "endpoint, region and credentials from the standard AWS variables (AWS_ENDPOINT_URL, AWS_REGION, "
        "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY; docs/deploy.md, Artifact store). Unset: files under artifact_dir.",
    )
    cache_dir: Path = Field(
        VAR / "cache",
        description="A worker's local cache of store objects (datasets, token arrays, warm-start weights), "
        "least recently used evicted, never a file in use (docs/deploy.md, Worker cache); one per host, shared "
        "by its workers. Default var/cache, beside the embedded var/artifacts (never inside an artifact dir); "
        "with the local artifact dir the cache hands out the store's own files and keeps only the token arrays.",
    )
    cache_bytes: int = Field(
        50 * 2**30,
        ge=0,
        description="Most bytes the worker cache keeps; files in use are never evicted, so it holds more while "
        "they are (0: a file is removed once no job uses it).",
    )
    model_dir: Path | None = Field(
        None,
        description="Operator-staged models: each directory in it that holds a config.json is a transformers "
        "model every tenant may train from as `staged:<directory>`, read-only (docs/service.md, Staged "
        "models); the API host and every worker host need the same directories. Unset: none.",
    )

    # Resource caps, checked before a job is queued.
    max_params: int = Field(200_000_000, description="Largest model, in parameters.")
    max_steps: int = Field(1_000_000, description="Most optimizer steps per job.")
    max_batch_tokens: int = Field(1_048_576, description="Largest batch_size x seq_len.")
    worker_memory_bytes: int = Field(
        default_factory=default_job_memory,
        gt=0,
        description="Memory one job may take on a worker (its estimated peak: weights, optimizer state, "
        "activations, attention scores, logits); more answers 422. Default: 80% of this machine's or "
        "container's memory; set it to the smallest worker's.",
    )
    max_series_per_step: int = Field(
        1024, gt=0, description="Telemetry series reported per telemetry step (per-head and per-expert included)."
    )
    max_checkpoints: int = Field(1000, gt=0, description="Checkpoints one job writes: steps / checkpoint_every.")
    max_job_minutes: float = Field(
        1440.0, gt=0, description="Wall time a job may take (train.max_minutes: its default and its cap)."
    )
    max_nproc: int = Field(
        8, ge=1, description="Processes per node of a job (resources.nproc; more than one: torch.distributed)."
    )
    max_nnodes: int = Field(4, ge=1, description="Workers one job may train on together (resources.nnodes).")
    tenant_job_cap: int = Field(8, description="Queued plus running jobs per tenant; more answers 429.")
    upload_limit_bytes: int = Field(256 * 2**20, description="Largest dataset upload.")
    max_model_bytes: int = Field(
        4 * 2**30,
        description="Largest model upload: the archive, and the sum of the sizes its members declare (more: 413 "
        "for the archive, 422 for its declared contents).",
    )
    upload_expiry_seconds: float = Field(
        86400.0,
        gt=0,
        description="How long a resumable upload (POST /v1/uploads) waits for its parts and its completion; then "
        "its parts are deleted and it answers 410.",
    )
    max_model_members: int = Field(64, ge=1, description="Most members a model archive may hold (more answers 422).")
    tenant_storage_bytes: int = Field(
        10 * 2**30,
        ge=0,
        description="Bytes of datasets and models a tenant may store in all (0: no uploads); more answers 413.",
    )
    max_body_bytes: int = Field(
        1 << 20, description="Largest request body other than an upload (a job spec is a few kB); more answers 413."
    )
    tenant_stream_cap: int = Field(
        100, description="Open event streams per tenant, across the API processes; more answers 429."
    )
    tenant_threads: int = Field(
        2, description="Threads of an API process's pool (40) one tenant's requests may use at once (0: no limit)."
    )
    tenant_rate_per_second: float = Field(
        200.0,
        description="Requests a second per tenant, across the API processes, on average (0: no limit); "
        "more answers 429.",
    )
    tenant_burst: int = Field(400, description="Requests a tenant may make at once above its rate.")
    refusal_pace_seconds: float = Field(
        5.0,
        ge=0,
        description="A tenant refused 429 again before its Retry-After has passed gets its next refusal "
        "after a pause of half to all of that Retry-After, at most this long (0: at once), so a client that retries "
        "at once is paced by the server.",
    )
    auth_cache_seconds: float = Field(
        10.0, description="How long a verified API key is trusted without a database lookup (0: never)."
    )
    metrics_token: str | None = Field(
        None, min_length=1, description="When set, GET /metrics needs Authorization: Bearer <it>."
    )

    # Database connections of each process (Postgres; SQLite has no pool to size).
    db_pool_size: int = Field(20, ge=1, description="Connections a process keeps open.")
    db_max_overflow: int = Field(30, ge=0, description="Connections a process may open beyond the pool under load.")

    # Leases: a running attempt renews its lease every heartbeat; an expired lease is requeued.
    lease_seconds: float = Field(30.0, description="How long a worker's claim on a job lasts without a heartbeat.")
    heartbeat_seconds: float = Field(5.0, description="How often a running attempt renews its lease.")
    stall_seconds: float = Field(
        1800.0,
        gt=0,
        description="A running attempt that completes no step for this long stops renewing its lease: "
        "the reaper gives the job to another worker (it resumes from its checkpoint).",
    )
    gang_wait_seconds: float = Field(
        600.0,
        gt=0,
        description="How long the first worker of a job of several nodes waits for the others to join; then it "
        "gives the job back to the queue (an attempt counted against train.max_restarts).",
    )
    node_address: str | None = Field(
        None,
        description="The address other workers reach this one at, for jobs of several nodes (the rendezvous "
        "and the socket rank 0 reports to); unset: this host's name, resolved.",
    )
    reaper_seconds: float = Field(10.0, description="How often expired leases are looked for.")
    requeue_after_seconds: float = Field(300.0, description="Re-send a queued job's task after this long.")
    cancel_poll_seconds: float = Field(1.0, description="How often a running job reads its cancel flag.")
    outage_patience_seconds: float = Field(
        120.0,
        description="How long a running job keeps training through a database outage (retrying with backoff) "
        "before its attempt hands the job back to resume later; it is never failed for it.",
    )

    # Telemetry.
    telemetry_flush_seconds: float = Field(
        1.0, description="How often a running job's metrics are written to the database (the live bus: at once)."
    )
    live_stream_maxlen: int = Field(10_000, description="Entries each job's Redis Stream keeps (about).")

    # Webhooks (app.services.webhooks, app.services.webhook_delivery, app.services.webhook_destinations).
    webhook_allow: str = Field(
        "",
        description="Where webhooks may be delivered: comma-separated networks (10.0.0.0/8), addresses, host "
        "names, and `public` (every globally routable address). Empty: nowhere (creating an endpoint answers 422).",
    )
    webhook_require_https: bool = Field(False, description="Refuse http:// endpoint URLs.")
    webhook_tenant_cap: int = Field(20, ge=0, description="Webhook endpoints per tenant; more answers 409.")
    webhook_timeout_seconds: float = Field(
        10.0, gt=0, description="A delivery attempt's limit to connect, to send, and to wait for the answer."
    )
    webhook_retry_base_seconds: float = Field(
        5.0, gt=0, description="The wait after a failed attempt; each next wait is 6 times longer (with jitter)."
    )
    webhook_retry_max_seconds: float = Field(7200.0, gt=0, description="The longest wait between two attempts.")
    webhook_retry_window_seconds: float = Field(
        86400.0, gt=0, description="How long after its event a delivery is retried before it is marked failed."
    )
    webhook_log_days: float = Field(
        30.0, gt=0, description="How long a delivered or failed delivery (and its attempts) stays in the delivery log."
    )
    webhook_poll_seconds: float = Field(1.0, gt=0, description="How often an API process looks for due deliveries.")
    webhook_concurrency: int = Field(8, ge=1, description="Deliveries an API process sends at once.")

    worker_alive_file: Path | None = Field(
        None, description="A worker touches this file while it reaches the broker and the database (a healthcheck)."
    )

    @field_validator("artifact_dir", "cache_dir")
    @classmethod
    def _absolute(cls, v: Path) -> Path:
        return v.expanduser().resolve()

    @field_validator("model_dir", mode="before")
    @classmethod
    def _absolute_or_unset(cls, v: object) -> object:
        if v is None or (isinstance(v, str) and not v.strip()):
            return None  # MUONFORGE_MODEL_DIR= (empty) is unset
        return Path(str(v)).expanduser().resolve()

    @field_validator("webhook_allow")
    @classmethod
    def _allow_list(cls, v: str) -> str:
        AllowList.parse(v)  # a typo stops the process at start, not every delivery later
        return v

    @property
    def webhook_allow_list(self) -> AllowList:
        return AllowList.parse(self.webhook_allow)

    @property
    def embedded(self) -> bool:
        return self.database_url is None

    @property
    def sqlalchemy_url(self) -> str:
        return self.database_url or f"sqlite:///{(VAR / 'muonforge.db').resolve()}"

    @property
    def broker_url(self) -> str:
        return self.redis_url or f"sqla+sqlite:///{(VAR / 'broker.db').resolve()}"


@lru_cache
def get_settings() -> Settings:
    return Settings()
