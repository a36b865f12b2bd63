"""Response schemas of the HTTP API (one family per resource)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from app.job_status import JobStatus
from app.services.caps import CHAR_VOCAB_MAX


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
        "payload_too_large",
        "storage_quota_exceeded",
        "validation_error",
        "rate_limited",
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


class Job(BaseModel):
    id: str
    name: str | None
    status: JobStatus
    spec: dict[str, Any] = Field(description="The validated JobSpec, defaults filled in.")
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    attempt: int = Field(description="Worker attempts so far (a resumed job counts each).")
    progress: Progress
    summary: dict[str, Any] = Field(description="Latest loss, val_loss, attn_max_logit, ...")
    error: JobError | None

    @classmethod
    def of(cls, job: Any) -> Job:
        return cls(
            id=job.id,
            name=job.name,
            status=job.status,
            spec=job.spec,
            created_at=job.created_at,
            started_at=job.started_at,
            finished_at=job.finished_at,
            attempt=job.attempt,
            progress=Progress(step=job.progress_step, total_steps=job.total_steps),
            summary=job.summary or {},
            error=job.error,
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
            char_tokenizer=dataset.char_vocab <= CHAR_VOCAB_MAX,
            created_at=dataset.created_at,
        )


class DatasetList(BaseModel):
    data: list[Dataset]
    has_more: bool
    next_after: str | None


class Checkpoint(BaseModel):
    step: int
    bytes: int
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
                {"job_id": "job_01hx…", "series": [{"name": "loss", "points": [[0, 5.54], [1, 5.31], [2, 4.98]]}]}
            ]
        }
    )


class SignIn(BaseModel):
    api_key: str = Field(min_length=1, max_length=200, description="An API key from `muonforge keys create`.")


class Session(BaseModel):
    tenant: str = Field(description="The tenant the key belongs to.")
