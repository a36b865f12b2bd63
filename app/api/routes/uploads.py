"""/v1/uploads: resumable uploads of datasets and models in parts (thin routes over app.services.uploads)."""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import AsyncIterator, Iterator
from typing import Annotated

import anyio.from_thread
from fastapi import APIRouter, Header, Path, Request

from app.api.deps import Work
from app.api.routes.jobs import ERRORS
from app.errors import ValidationFailed
from app.schemas import uploads as schemas
from app.services import uploads as service

router = APIRouter(prefix="/v1/uploads", tags=["uploads"])
UploadId = Annotated[str, Path(max_length=40, pattern=r"^[A-Za-z0-9_]+$")]
SHA256_DIGEST = re.compile(r"(?:^|,)\s*sha-256=:([A-Za-z0-9+/=]+):")
BATCH_BYTES = 1 << 20  # body bytes handed to the store's writer at a time


@router.post("", status_code=201, response_model=schemas.Upload, responses={**ERRORS, 413: ERRORS[422]})
async def create_upload(body: schemas.UploadCreate, work: Work) -> schemas.Upload:
    """Start a resumable upload; its parts are kept until `expires_at`. 413 when the file is larger
    than a dataset or model upload may be, or than the tenant's storage quota leaves."""
    upload = await work(service.create_upload, body.purpose, body.filename, body.bytes, body.name, work.settings)
    return schemas.Upload.of(upload, [])


@router.get("/{upload_id}", response_model=schemas.Upload, responses=ERRORS)
async def get_upload(upload_id: UploadId, work: Work) -> schemas.Upload:
    """The upload and the parts received so far: what a client resuming it still has to send."""
    return schemas.Upload.of(*await work(service.get_upload, upload_id))


@router.put(
    "/{upload_id}/parts/{number}",
    response_model=schemas.UploadPart,
    responses={**ERRORS, 410: ERRORS[422], 413: ERRORS[422], 503: ERRORS[422]},
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary", "minLength": 1}}},
        }
    },
)
async def put_part(
    upload_id: UploadId,
    number: Annotated[int, Path(ge=1, le=service.MAX_PARTS)],
    request: Request,
    work: Work,
    repr_digest: Annotated[str | None, Header(description="`sha-256=:<base64>:` (RFC 9530): checked.")] = None,
) -> schemas.UploadPart:
    """Store one part (the raw body, at most 64 MiB), in any order, in parallel, again to replace
    it. With `Repr-Digest` the part is refused (422, nothing kept) unless its bytes match."""
    sha256 = digest_of(repr_digest)
    part = await work(service.put_part, upload_id, number, blocking(batched(request.stream())), sha256, work.settings)
    return schemas.UploadPart(number=part.number, bytes=part.bytes, sha256=part.sha256)


@router.post(
    "/{upload_id}/complete", response_model=schemas.Upload, responses={**ERRORS, 410: ERRORS[422], 503: ERRORS[422]}
)
async def complete_upload(upload_id: UploadId, body: schemas.UploadComplete, work: Work) -> schemas.Upload:
    """Make the dataset or model from the parts, in order (`dataset_id` or `model_id` in the answer).
    409 `upload_parts_mismatch` when the parts listed are not the ones received (the message names
    them; send them again and complete again); then the checks of a dataset or model upload."""
    claimed = [(p.number, p.sha256) for p in body.parts]
    await work(service.complete_upload, upload_id, claimed, work.settings)
    return schemas.Upload.of(*await work(service.get_upload, upload_id))


@router.post("/{upload_id}/cancel", response_model=schemas.Upload, responses={**ERRORS, 410: ERRORS[422]})
async def cancel_upload(upload_id: UploadId, work: Work) -> schemas.Upload:
    """Cancel a pending upload; its parts are deleted."""
    await work(service.cancel_upload, upload_id, work.settings)
    return schemas.Upload.of(*await work(service.get_upload, upload_id))


def digest_of(header: str | None) -> str | None:
    """The hex sha256 a ``Repr-Digest`` header gives, or None without one (422 if it has no sha-256)."""
    if header is None:
        return None
    match = SHA256_DIGEST.search(header)
    try:
        raw = base64.b64decode(match.group(1), validate=True) if match else b""
    except binascii.Error:
        raw = b""
    if len(raw) != 32:
        raise ValidationFailed("Repr-Digest must give sha-256=:<base64 of 32 bytes>:", param="Repr-Digest")
    return raw.hex()


async def batched(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The body's chunks joined into batches of about BATCH_BYTES (fewer trips between threads)."""
    pending: list[bytes] = []
    size = 0
    async for chunk in chunks:
        pending.append(chunk)
        size += len(chunk)
        if size >= BATCH_BYTES:
            yield b"".join(pending)
            pending, size = [], 0
    if pending:
        yield b"".join(pending)


def blocking(chunks: AsyncIterator[bytes]) -> Iterator[bytes]:
    """An async iterator read from a worker thread: each item fetched on the event loop."""

    async def step() -> bytes | None:
        return await anext(chunks, None)

    while (chunk := anyio.from_thread.run(step)) is not None:
        yield chunk
