"""Downloads of stored objects with HTTP range requests (RFC 9110 §14): one byte range at a time.

A download names its object's sha256 as its strong ETag, so a client that resumes with
``If-Range`` gets the rest of the same bytes or, if the object changed, the whole new one.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from fastapi.responses import Response, StreamingResponse

from app.storage import ArtifactStore
from app.storage.base import verified

RANGE = re.compile(r"bytes=(\d*)-(\d*)")


def byte_range(header: str | None, size: int) -> tuple[int, int] | None:
    """The half-open ``[start, end)`` a ``Range`` header asks of an object of ``size`` bytes; None
    for the whole object (no header, or one this server may ignore: several ranges, another unit,
    bad syntax). ``(size, size)`` when the range is not satisfiable (it starts past the end)."""
    match = RANGE.fullmatch(header.strip()) if header else None
    if match is None or match.group(1) == match.group(2) == "":
        return None
    first, last = match.group(1), match.group(2)
    if first == "":  # a suffix: the last N bytes
        length = int(last)
        return (size, size) if length == 0 else (max(0, size - length), size)
    start = int(first)
    if last and int(last) < start:
        return None  # invalid: ignored, as the RFC asks
    if start >= size:
        return (size, size)
    return start, min(size, int(last) + 1) if last else size


def download(
    store: ArtifactStore,
    key: str,
    size: int,
    sha256: str | None,
    *,
    media_type: str,
    filename: str,
    range_header: str | None = None,
    if_range: str | None = None,
) -> Response:
    """The object at ``key`` (of the row's ``size`` and ``sha256``) as a streamed download: 200 with
    the whole of it, verified as it is read; 206 with the one range asked for; 416 for a range past
    its end. Raises the store's errors before anything is sent (ObjectNotFound, StoreUnavailable)."""
    etag = f'"{sha256}"' if sha256 else None
    headers = {"Accept-Ranges": "bytes", "Content-Disposition": f'attachment; filename="{filename}"'}
    if etag:
        headers["ETag"] = etag
    wanted = byte_range(range_header, size) if if_range is None or if_range == etag else None
    if wanted is not None and wanted[0] >= size:
        return Response(status_code=416, headers={**headers, "Content-Range": f"bytes */{size}"})
    if wanted is None:
        chunks: Iterator[bytes] = verified(key, store.open_range(key), size, sha256)
        return StreamingResponse(chunks, media_type=media_type, headers={**headers, "Content-Length": str(size)})
    start, end = wanted
    partial_headers = {
        **headers,
        "Content-Length": str(end - start),
        "Content-Range": f"bytes {start}-{end - 1}/{size}",
    }
    return StreamingResponse(store.open_range(key, start, end), 206, media_type=media_type, headers=partial_headers)
