"""/v1/jobs/{id}/checkpoints: list a job's checkpoints and download one (streamed)."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Path, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse

from app.api import ranges
from app.api.deps import JobId, Work
from app.api.routes.jobs import ERRORS
from app.schemas import api as schemas
from app.services import checkpoints as service
from app.services import export
from app.services.metric_history import MAX_STEP
from app.storage import store_from

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


@router.get("/{step}", response_class=StreamingResponse, responses={**ERRORS, 200: FILE, 206: FILE})
async def download_checkpoint(
    request: Request,
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
    safetensors, or a transformers model directory as a tar archive (converted on request). The
    file itself honours one `Range` (206; `If-Range` with its ETag, the file's sha256), so an
    interrupted download resumes where it stopped."""
    stored = await work(service.checkpoint_object, job_id, step)
    if file_format == "pt":
        name = f"{job_id}-step{step:08d}.pt"
        with service.reading(job_id, step):
            return await run_in_threadpool(
                ranges.download,
                store_from(work.settings),
                stored.key,
                stored.bytes,
                stored.sha256,
                media_type="application/octet-stream",
                filename=name,
                range_header=request.headers.get("range"),
                if_range=request.headers.get("if-range"),
            )
    convert, media_type, filename = {
        "safetensors": (export.exported, "application/octet-stream", f"{job_id}-step{step:08d}.safetensors"),
        "hf": (export.exported_hf, "application/x-tar", f"{job_id}-step{step:08d}-hf.tar"),
    }[file_format]
    chunks, size = await run_in_threadpool(service.exported, work.settings, job_id, step, stored, convert)
    headers = {"Content-Length": str(size), "Content-Disposition": f'attachment; filename="{filename}"'}
    return StreamingResponse(chunks, media_type=media_type, headers=headers)
