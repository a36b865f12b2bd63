"""The resumable uploads' request and response bodies (/v1/uploads)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from contract.spec import NO_NUL
from contract.status import UploadStatus


class UploadCreate(BaseModel):
    """A resumable upload to make: what it will become, its file's name and size."""

    model_config = ConfigDict(extra="forbid")

    purpose: Literal["dataset", "model"] = Field(description="A dataset (a corpus), or a model archive.")
    filename: str = Field(
        min_length=1,
        max_length=200,
        pattern=NO_NUL,
        description="The file's name: its suffix gives a dataset's format (.txt, .jsonl, .parquet) or a model "
        "archive's (.tar, .tar.gz, .zip).",
    )
    bytes: int = Field(ge=1, description="The file's size: the parts must add up to it.")
    name: str | None = Field(None, max_length=200, pattern=NO_NUL, description="The dataset's or model's name.")


class UploadPart(BaseModel):
    number: int = Field(description="Its place in the file, from 1.")
    bytes: int
    sha256: str


class Upload(BaseModel):
    id: str
    purpose: Literal["dataset", "model"]
    filename: str
    name: str
    bytes: int
    status: UploadStatus
    created_at: datetime
    expires_at: datetime = Field(description="When a pending upload's parts are deleted (then 410).")
    parts: list[UploadPart] = Field(description="The parts received so far, by number.")
    dataset_id: str | None = Field(None, description="The dataset it became, once completed.")
    model_id: str | None = Field(None, description="The model it became, once completed.")

    @classmethod
    def of(cls, upload: Any, parts: list[Any]) -> Upload:
        made = {f"{upload.purpose}_id": upload.result_id} if upload.result_id else {}
        return cls(
            id=upload.id,
            purpose=upload.purpose,
            filename=upload.filename,
            name=upload.name,
            bytes=upload.bytes,
            status=upload.status,
            created_at=upload.created_at,
            expires_at=upload.expires_at,
            parts=[UploadPart(number=p.number, bytes=p.bytes, sha256=p.sha256) for p in parts],
            **made,
        )


class PartDigest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    number: int = Field(ge=1)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class UploadComplete(BaseModel):
    """Every part of the file, in order, with the sha256 the client computed of each."""

    model_config = ConfigDict(extra="forbid")

    parts: list[PartDigest] = Field(min_length=1, max_length=10_000)
