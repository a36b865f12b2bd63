"""/v1/jobs/{id}/checkpoints: list a job's checkpoints and download one (streamed)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query
from fastapi.responses import FileResponse

from app.deps import JobId, Work
from app.routes.jobs import ERRORS
from app.schemas import api as schemas
from app.services import checkpoints as service
from app.services.telemetry import MAX_STEP

router = APIRouter(prefix="/v1/jobs/{job_id}/checkpoints", tags=["checkpoints"])


@router.get("", response_model=schemas.CheckpointList, responses=ERRORS)
async def list_checkpoints(
    job_id: JobId,
    work: Work,
    limit: Annotated[int, Query(ge=1, le=100)] = 100,
    after: Annotated[int | None, Query(ge=0, le=MAX_STEP, description="The previous page's `next_after`.")] = None,
) -> schemas.CheckpointList:
    """Newest first, a page at a time (a job keeps `train.keep_checkpoints` plus its best)."""
    return await work(service.list_checkpoints, job_id, limit, after)


@router.get(
    "/{step}",
    response_class=FileResponse,
    responses={**ERRORS, 200: {"content": {"application/octet-stream": {}}, "description": "The checkpoint file."}},
)
async def download_checkpoint(job_id: JobId, step: Annotated[int, Path(ge=0, le=MAX_STEP)], work: Work):
    """The checkpoint written after `step` optimizer steps (a torch.save file: model, optimizer,
    RNG states, step), streamed."""
    path = await work(service.checkpoint_file, job_id, step, work.settings)
    return FileResponse(path, media_type="application/octet-stream", filename=f"{job_id}-step{step:08d}.pt")
