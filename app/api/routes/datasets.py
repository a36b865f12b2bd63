"""/v1/datasets: upload, read and delete corpora (thin routes over app.services.datasets)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, File, Form, Query, Response, UploadFile

from app.api.deps import After, DatasetId, Work
from app.api.routes.jobs import ERRORS
from app.schemas import api as schemas
from app.services import datasets as service
from contract.spec import NO_NUL

router = APIRouter(prefix="/v1/datasets", tags=["datasets"])


@router.post(
    "", status_code=201, response_model=schemas.Dataset, responses={**ERRORS, 413: ERRORS[422], 503: ERRORS[422]}
)
async def upload_dataset(
    work: Work,
    file: Annotated[
        UploadFile,
        File(
            description="A corpus, not empty: UTF-8 text, or by its file name's suffix .jsonl rows ({text}, "
            "{prompt, completion} or {messages}) or a .parquet file with a string column.",
            json_schema_extra={"minLength": 1},
        ),
    ],
    name: Annotated[str | None, Form(max_length=200, pattern=NO_NUL)] = None,
) -> schemas.Dataset:
    """Store a corpus. 413 over the upload limit (`payload_too_large`) or over what the tenant's
    storage quota leaves (`storage_quota_exceeded`); 422 if it is empty, not UTF-8 text, a JSONL
    line that is not a row (the message names the line) or a parquet file that cannot be read; 503
    `service_unavailable` (with `Retry-After`) while the artifact store cannot be reached."""
    filename = file.filename or "dataset"
    dataset = await work(service.upload_dataset, file.file, name or filename, work.settings, filename)
    return schemas.Dataset.of(dataset)


@router.get("", response_model=schemas.DatasetList, responses=ERRORS)
async def list_datasets(
    work: Work, limit: Annotated[int, Query(ge=1, le=100)] = 20, after: After = None
) -> schemas.DatasetList:
    return await work(service.list_datasets, limit, after)


@router.get("/{dataset_id}", response_model=schemas.Dataset, responses=ERRORS)
async def get_dataset(dataset_id: DatasetId, work: Work) -> schemas.Dataset:
    return schemas.Dataset.of(await work(service.get_dataset, dataset_id))


@router.delete("/{dataset_id}", status_code=204, response_class=Response, responses=ERRORS)
async def delete_dataset(dataset_id: DatasetId, work: Work) -> Response:
    """Delete a dataset and its stored object. 409 `dataset_in_use` while a queued, running or paused job of
    the tenant trains on it; finished jobs keep their spec."""
    await work(service.delete_dataset, dataset_id, work.settings)
    return Response(status_code=204)
