"""/v1/datasets: upload and read corpora."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, File, Form, Query, UploadFile

from app.deps import CurrentTenant, SessionDep, SettingsDep
from app.routes.jobs import ERRORS
from app.schemas import api as schemas
from app.services import datasets as service

router = APIRouter(prefix="/v1/datasets", tags=["datasets"])


@router.post("", status_code=201, response_model=schemas.Dataset, responses={**ERRORS, 413: ERRORS[422]})
def upload_dataset(
    tenant: CurrentTenant,
    session: SessionDep,
    settings: SettingsDep,
    file: Annotated[UploadFile, File(description="A UTF-8 text corpus.")],
    name: Annotated[str | None, Form(max_length=200)] = None,
) -> schemas.Dataset:
    dataset = service.upload_dataset(session, tenant, file.file, name or file.filename or "dataset", settings)
    return schemas.Dataset.model_validate(dataset)


@router.get("", response_model=schemas.DatasetList, responses=ERRORS)
def list_datasets(
    tenant: CurrentTenant,
    session: SessionDep,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    after: str | None = None,
) -> schemas.DatasetList:
    return service.list_datasets(session, tenant, limit, after)


@router.get("/{dataset_id}", response_model=schemas.Dataset, responses=ERRORS)
def get_dataset(dataset_id: str, tenant: CurrentTenant, session: SessionDep) -> schemas.Dataset:
    return schemas.Dataset.model_validate(service.get_dataset(session, tenant, dataset_id))
