"""/v1/datasets: upload and read corpora."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, File, Form, Query, UploadFile

from app.deps import After, DatasetId, Work
from app.routes.jobs import ERRORS
from app.schemas import api as schemas
from app.schemas.job_spec import NO_NUL
from app.services import datasets as service

router = APIRouter(prefix="/v1/datasets", tags=["datasets"])


@router.post("", status_code=201, response_model=schemas.Dataset, responses={**ERRORS, 413: ERRORS[422]})
async def upload_dataset(
    work: Work,
    file: Annotated[
        UploadFile, File(description="A UTF-8 text corpus, not empty.", json_schema_extra={"minLength": 1})
    ],
    name: Annotated[str | None, Form(max_length=200, pattern=NO_NUL)] = None,
) -> schemas.Dataset:
    dataset = await work(service.upload_dataset, file.file, name or file.filename or "dataset", work.settings)
    return schemas.Dataset.model_validate(dataset)


@router.get("", response_model=schemas.DatasetList, responses=ERRORS)
async def list_datasets(
    work: Work, limit: Annotated[int, Query(ge=1, le=100)] = 20, after: After = None
) -> schemas.DatasetList:
    return await work(service.list_datasets, limit, after)


@router.get("/{dataset_id}", response_model=schemas.Dataset, responses=ERRORS)
async def get_dataset(dataset_id: DatasetId, work: Work) -> schemas.Dataset:
    return schemas.Dataset.model_validate(await work(service.get_dataset, dataset_id))
