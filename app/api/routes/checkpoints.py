"""/v1/jobs/{id}/checkpoints: list a job's checkpoints and download one (streamed)."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Path, Query
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse, StreamingResponse

from app.api.deps import JobId, Work
from app.api.routes.jobs import ERRORS
from app.schemas import api as schemas
from app.services import checkpoints as service
from app.services import export
from app.services.metric_history import MAX_STEP

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


BINARY = {"schema": {"type": "string", "format": "binary"}}
FILE = {
    "content": {"application/octet-stream": BINARY, "application/x-tar": BINARY},
    "description": "The checkpoint file (`format=pt`), its weights as a safetensors file (`format=safetensors`), "
    "or a transformers model directory as a tar archive (`format=hf`).",
}


@router.get("/{step}", response_class=FileResponse, responses={**ERRORS, 200: FILE})
async def download_checkpoint(
    job_id: JobId,
    step: Annotated[int, Path(ge=0, le=MAX_STEP)],
    work: Work,
    file_format: Annotated[
        Literal["pt", "safetensors", "hf"],
        Query(
            alias="format",
            description="pt: the checkpoint as the worker wrote it (torch.save: model, optimizer, RNG states, "
            "step). safetensors: the model's weights only, every tensor under its own name, with the model's "
            "config (the spec's model section, vocab_size, tokenizer) as JSON in the metadata key "
            f"`{export.EXPORT_KEY}`. hf: a tar archive of a directory that transformers' "
            "`AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained` load (config.json, "
            "model.safetensors, generation_config.json, and the files of the text's tokenizer, byte, char or "
            "bpe); arch gpt and hf only.",
        ),
    ] = "pt",
):
    """The checkpoint written after `step` optimizer steps, streamed: the file itself, its weights as
    safetensors, or a transformers model directory as a tar archive (converted on request)."""
    path = await work(service.checkpoint_file, job_id, step, work.settings)
    name = f"{job_id}-step{step:08d}"
    if file_format == "pt":
        return FileResponse(path, media_type="application/octet-stream", filename=f"{name}.pt")
    convert, media_type, filename = {
        "safetensors": (export.exported, "application/octet-stream", f"{name}.safetensors"),
        "hf": (export.exported_hf, "application/x-tar", f"{name}-hf.tar"),
    }[file_format]
    chunks, size = await run_in_threadpool(convert, path, work.settings.artifact_dir / "exports")
    headers = {"Content-Length": str(size), "Content-Disposition": f'attachment; filename="{filename}"'}
    return StreamingResponse(chunks, media_type=media_type, headers=headers)
