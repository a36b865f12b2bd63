"""/v1/models: upload, read and delete transformers model directories (thin routes over app.services.models)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, File, Form, Query, Response, UploadFile

from app.api.deps import After, ModelId, Work
from app.api.routes.jobs import ERRORS
from app.schemas import api as schemas
from app.services import models as service
from contract.spec import NO_NUL

router = APIRouter(prefix="/v1/models", tags=["models"])


@router.post("", status_code=201, response_model=schemas.ModelDetail, responses={**ERRORS, 413: ERRORS[422]})
async def upload_model(
    work: Work,
    file: Annotated[
        UploadFile,
        File(
            description="A tar (optionally gzipped) or zip archive of a transformers model directory: config.json, "
            "safetensors weights, optional tokenizer files.",
            json_schema_extra={"minLength": 1},
        ),
    ],
    name: Annotated[str | None, Form(max_length=200, pattern=NO_NUL)] = None,
) -> schemas.ModelDetail:
    """Store a model. 413 over the model upload limit (`payload_too_large`) or over what the
    tenant's storage quota leaves (`storage_quota_exceeded`); 422 for an archive, a config or
    weights refused (the message says which member and why)."""
    model = await work(service.upload_model, file.file, name or file.filename or "model", work.settings)
    return service.detail(model)


@router.get("", response_model=schemas.ModelList, responses=ERRORS)
async def list_models(
    work: Work, limit: Annotated[int, Query(ge=1, le=100)] = 20, after: After = None
) -> schemas.ModelList:
    return await work(service.list_models, limit, after)


@router.get("/{model_id}", response_model=schemas.ModelDetail, responses=ERRORS)
async def get_model(model_id: ModelId, work: Work) -> schemas.ModelDetail:
    """A model: its files, its sizes and its config.json."""
    return await work(service.show_model, model_id)


@router.delete("/{model_id}", status_code=204, response_class=Response, responses=ERRORS)
async def delete_model(model_id: ModelId, work: Work) -> Response:
    """Delete a model and its files."""
    await work(service.delete_model, model_id, work.settings)
    return Response(status_code=204)
