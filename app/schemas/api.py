"""Response schemas of the HTTP API (one family per resource)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from contract import metrics
from contract.documents import file_format
from contract.spec import in_field_order
from contract.status import JobStatus, SweepStatus, TrialStatus
from contract.webhooks import DeliveryStatus, WebhookEventType
from worker.engine.facts import CHAR_VOCAB_MAX


class FieldError(BaseModel):
    param: str | None
    message: str


class ErrorDetail(BaseModel):
    code: Literal[
        "unauthorized",
        "forbidden",
        "tenant_suspended",
        "not_found",
        "method_not_allowed",
        "conflict",
        "dataset_in_use",
        "model_in_use",
        "payload_too_large",
        "storage_quota_exceeded",
        "validation_error",
        "rate_limited",
        "upload_not_pending",
        "upload_parts_mismatch",
        "upload_expired",
        "artifact_changed",
        "service_unavailable",
        "internal",
    ]
    message: str
    param: str | None = Field(None, description="The offending field, dotted (e.g. optimizer.lr), or null.")
    errors: list[FieldError] | None = Field(
        None, description="A 422 of the request's validation: every invalid field (the first is param, message)."
    )


class ErrorBody(BaseModel):
    error: ErrorDetail

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "error": {
                        "code": "validation_error",
                        "message": "Input should be greater than 0",
                        "param": "optimizer.lr",
                    }
                }
            ]
        }
    )


class Progress(BaseModel):
    step: int = Field(description="Optimizer steps completed.")
    total_steps: int


class JobError(BaseModel):
    code: str
    message: str


class JobParent(BaseModel):
    job_id: str
    step: int = Field(description="The step of the checkpoint it started from.")


class Job(BaseModel):
    id: str
    name: str | None
    status: JobStatus
    spec: dict[str, Any] = Field(
        description="The validated JobSpec, defaults filled in, its keys in the order the JobSpec declares its fields."
    )
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    attempt: int = Field(description="Worker attempts so far (a resumed job counts each).")
    progress: Progress
    summary: dict[str, Any] = Field(description="Latest loss, val_loss, attn_max_logit, ...")
    error: JobError | None
    parent: JobParent | None = Field(
        description="A warm start (`init_from`): the job and checkpoint step it started from; else null."
    )
    sweep_id: str | None = Field(None, description="A sweep's trial: its sweep; else null.")
    val_loss_step: int | None = Field(
        None, description="The step of the summary's val_loss (the latest evaluation); null before the first."
    )
    queue_position: int | None = Field(
        None,
        description="A queued job, as `GET /v1/jobs/{id}` reads it: the queued jobs of its queue (every tenant's) "
        "submitted before it, which workers take first. Null otherwise, and in lists, events and webhook bodies.",
    )

    @classmethod
    def of(cls, job: Any, *, val_loss_step: int | None = None, queue_position: int | None = None) -> Job:
        return cls(
            id=job.id,
            name=job.name,
            status=job.status,
            spec=in_field_order(job.spec),
            created_at=job.created_at,
            started_at=job.started_at,
            finished_at=job.finished_at,
            attempt=job.attempt,
            progress=Progress(step=job.progress_step, total_steps=job.total_steps),
            summary=job.summary or {},
            error=job.error,
            parent=JobParent(job_id=job.parent_job_id, step=job.parent_step) if job.parent_job_id else None,
            sweep_id=getattr(job, "sweep_id", None),
            val_loss_step=val_loss_step,
            queue_position=queue_position,
        )


class JobList(BaseModel):
    data: list[Job]
    has_more: bool
    next_after: str | None = Field(description="Pass as `after` for the next page.")


class Dataset(BaseModel):
    id: str
    name: str
    bytes: int
    sha256: str
    format: Literal["text", "jsonl", "parquet"] = Field(
        description="How a job reads it (data.format auto): by the uploaded file name's suffix."
    )
    char_tokenizer: bool = Field(
        description="Whether a job may train on it with `tokenizer: char`: false when the text has more "
        f"than {CHAR_VOCAB_MAX:,} distinct characters (the byte tokenizer takes any dataset)."
    )
    created_at: datetime

    @classmethod
    def of(cls, dataset: Any) -> Dataset:
        return cls(
            id=dataset.id,
            name=dataset.name,
            bytes=dataset.bytes,
            sha256=dataset.sha256,
            format=file_format(dataset.path),
            char_tokenizer=dataset.char_vocab <= CHAR_VOCAB_MAX,
            created_at=dataset.created_at,
        )


class DatasetList(BaseModel):
    data: list[Dataset]
    has_more: bool
    next_after: str | None


class Model(BaseModel):
    id: str = Field(
        description="An upload's `mdl_…`, or a staged model's `staged:<directory>`: what `model.hf.model_id` names."
    )
    source: Literal["upload", "staged"] = Field(
        description="upload: the tenant's own (POST /v1/models); staged: the operators' (MUONFORGE_MODEL_DIR), "
        "shared by every tenant and never deleted through the API."
    )
    name: str = Field(description="An upload's given name; a staged model's directory name.")
    model_type: str = Field(description="Its transformers family (config.json's `model_type`).")
    parameters: int
    bytes: int = Field(
        description="Its files' sizes (an upload's, extracted, are what the tenant's storage quota counts; a staged "
        "model counts toward no quota)."
    )
    sha256: str | None = Field(description="Of the archive as uploaded; null for a staged model.")
    files: list[str] = Field(description="The model directory's files (a staged model's: those the service reads).")
    tokenizer_files: list[str] = Field(description="Those of its files that belong to a tokenizer.")
    created_at: datetime = Field(description="When it was uploaded; for a staged model, its files' latest change.")

    model_config = ConfigDict(protected_namespaces=())


class ModelSizes(BaseModel):
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    width: int
    ffn: int
    positions: int
    vocab: int
    tied_embeddings: bool


class ModelDetail(Model):
    sizes: ModelSizes = Field(description="Its shape in one set of words, whatever its family names the fields.")
    config: dict[str, Any] = Field(description="Its config.json.")


class ModelList(BaseModel):
    data: list[Model]
    has_more: bool
    next_after: str | None


class Checkpoint(BaseModel):
    step: int
    bytes: int
    sha256: str | None = Field(description="The file's sha256 (null for a checkpoint written before they were kept).")
    created_at: datetime
    metrics: dict[str, float] = Field(description="The latest value of every metric when it was written.")

    model_config = ConfigDict(from_attributes=True)


class CheckpointList(BaseModel):
    data: list[Checkpoint]
    has_more: bool = False
    next_after: str | None = None


class MetricSeries(BaseModel):
    name: str
    points: list[tuple[int, float]] = Field(description="[step, value] pairs, real points, ascending steps.")


class MetricHistory(BaseModel):
    job_id: str
    series: list[MetricSeries]

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {"job_id": "job_01hx…", "series": [{"name": metrics.LOSS, "points": [[0, 5.54], [1, 5.31], [2, 4.98]]}]}
            ]
        }
    )


class SignIn(BaseModel):
    api_key: str = Field(min_length=1, max_length=200, description="An API key from `muonforge keys create`.")


class Session(BaseModel):
    tenant: str = Field(description="The tenant the key belongs to.")


class WebhookCreate(BaseModel):
    url: str = Field(
        max_length=2000,
        pattern=r"^https?://",
        description="Where the events are POSTed: http(s), to a destination the server's operator allows "
        "(MUONFORGE_WEBHOOK_ALLOW); one outside answers 422.",
        examples=["https://hooks.example.com/muonforge"],
    )
    events: list[WebhookEventType] = Field(
        min_length=1, max_length=len(WebhookEventType), description="The event types to send (repeats count once)."
    )

    model_config = ConfigDict(extra="forbid")


class Webhook(BaseModel):
    id: str
    url: str
    events: list[WebhookEventType]
    created_at: datetime

    model_config = ConfigDict(from_attributes=True)


class WebhookCreated(Webhook):
    secret: str = Field(
        description="`whsec_` and the base64 of the signing key: shown this once. Every request carries "
        '`webhook-signature: v1,<base64 HMAC-SHA256 of "{webhook-id}.{webhook-timestamp}.{body}">`.'
    )


class WebhookList(BaseModel):
    data: list[Webhook]
    has_more: bool
    next_after: str | None


class WebhookAttempt(BaseModel):
    at: datetime
    duration_ms: int
    status_code: int | None = Field(description="The receiver's answer; null when none came (see `error`).")
    error: str | None

    model_config = ConfigDict(from_attributes=True)


class WebhookMessage(BaseModel):
    """The body of every webhook request."""

    type: WebhookEventType
    timestamp: datetime = Field(description="When the event happened.")
    data: dict[str, Any] = Field(
        description="For job.* events: the Job, as GET /v1/jobs/{id} returns it; for sweep.completed: the Sweep, "
        "as GET /v1/sweeps/{id} returns it."
    )


class WebhookDelivery(BaseModel):
    id: str = Field(description="The `webhook-id` header, the same on every attempt: a receiver drops repeats by it.")
    event_type: WebhookEventType
    status: DeliveryStatus
    payload: WebhookMessage = Field(description="The body sent.")
    created_at: datetime
    next_attempt_at: datetime | None = Field(description="When it is tried next (pending only).")
    finished_at: datetime | None
    last_error: str | None
    attempts: list[WebhookAttempt] = Field(description="Oldest first.")

    @classmethod
    def of(cls, delivery: Any, attempts: list[Any]) -> WebhookDelivery:
        return cls(
            id=delivery.id,
            event_type=delivery.event_type,
            status=delivery.status,
            payload=WebhookMessage.model_validate_json(delivery.body),
            created_at=delivery.created_at,
            next_attempt_at=delivery.next_attempt_at,
            finished_at=delivery.finished_at,
            last_error=delivery.last_error,
            attempts=[WebhookAttempt.model_validate(a) for a in attempts],
        )


class WebhookDeliveryList(BaseModel):
    data: list[WebhookDelivery]
    has_more: bool
    next_after: str | None


class SweepRung(BaseModel):
    rung: int = Field(description="The step.")
    value: float = Field(description="The trial's metric there.")
    position: int = Field(description="Its order among the results recorded at this rung (1: the first).")
    continued: bool = Field(description="Whether the trial went on past this rung (at once, or once promoted).")
    promoted: bool = Field(
        description="True: it waited at this rung (paused) until ASHA promoted it; false: it went on at once, "
        "waits, or stopped there."
    )


class SweepTrial(BaseModel):
    number: int = Field(description="0, 1, ...: the order trials start in.")
    params: dict[str, Any] = Field(description="Spec path -> the trial's value.")
    job_id: str | None = Field(description="Its job, once started; null while it waits for a slot.")
    status: JobStatus | TrialStatus = Field(
        description="Its job's status; `pending` while it waits, `not_started` if it could not start (see `error`)."
    )
    metric: float | None = Field(description="The latest evaluation of the sweep's metric (the job's summary).")
    step: int = Field(description="Optimizer steps completed.")
    rungs: list[SweepRung] = Field(description="Its ASHA rung results, ascending.")
    error: JobError | None


class SweepCounts(BaseModel):
    total: int
    by_status: dict[str, int] = Field(description="Trials by status (`pending` ones included).")


class Sweep(BaseModel):
    id: str
    name: str | None
    status: SweepStatus = Field(description="running until every trial has finished, then completed; or cancelled.")
    spec: dict[str, Any] = Field(description="The validated SweepSpec, defaults filled in.")
    metric: str
    mode: Literal["min", "max"]
    created_at: datetime
    finished_at: datetime | None
    counts: SweepCounts = Field(description="Its trials, by status.")
    best: SweepTrial | None = Field(
        description="The succeeded trial with the best metric (the first on a tie); null while none has succeeded."
    )


class SweepDetail(Sweep):
    trials: list[SweepTrial] = Field(description="Every trial, by number.")


class SweepList(BaseModel):
    data: list[Sweep]
    has_more: bool
    next_after: str | None
