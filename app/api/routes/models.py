"""/v1/models: upload, read and delete transformers model directories (thin routes over app.services.models).

The tenant's uploads (`mdl_…`) and the operators' staged models (`staged:<directory>`) share the routes."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, File, Form, Path, Query, Response, UploadFile

from app.api.deps import Work
from app.api.routes.jobs import ERRORS
from app.schemas import api as schemas
from app.services import models as service
from contract.spec import MODEL_ID, NO_NUL

router = APIRouter(prefix="/v1/models", tags=["models"])

ModelId = Annotated[
    str, Path(pattern=MODEL_ID, description="An uploaded model's id (`mdl_…`) or a staged one's (`staged:<name>`).")
]
ModelAfter = Annotated[str | None, Query(pattern=MODEL_ID, description="The previous page's `next_after`.")]


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
    work: Work, limit: Annotated[int, Query(ge=1, le=100)] = 20, after: ModelAfter = None
) -> schemas.ModelList:
    """The tenant's uploads, newest first, then the staged models by name (`source` says which)."""
    return await work(service.list_models, limit, after, work.settings)


@router.get("/{model_id}", response_model=schemas.ModelDetail, responses=ERRORS)
async def get_model(model_id: ModelId, work: Work) -> schemas.ModelDetail:
    """A model: its files, its sizes and its config.json."""
    return await work(service.show_model, model_id, work.settings)


@router.delete("/{model_id}", status_code=204, response_class=Response, responses=ERRORS)
async def delete_model(model_id: ModelId, work: Work) -> Response:
    """Delete an upload and its files. 409 `model_in_use` while a queued, running or paused job
    starts from it; 409 `conflict` for a staged model (read-only: the operators remove its directory)."""
    await work(service.delete_model, model_id, work.settings)
    return Response(status_code=204)
