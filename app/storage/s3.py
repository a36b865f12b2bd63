"""The S3-compatible backend (AWS, MinIO, Ceph, R2) through obstore, the Rust object_store client.

``MUONFORGE_ARTIFACT_URL=s3://bucket/prefix``; the endpoint, region and credentials are read the
standard AWS way (AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL, AWS_REGION or AWS_DEFAULT_REGION,
AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN). A plain-http endpoint
(``http://minio:9000``) is allowed as written; AWS_ALLOW_HTTP=true allows it too.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import urlsplit

import obstore
from obstore.exceptions import BaseError, GenericError, NotFoundError, PreconditionError
from obstore.store import S3Store as ObjectStoreS3

from app.storage.base import (
    CHUNK_BYTES,
    MAX_PART_BYTES,
    IntegrityError,
    ObjectInfo,
    ObjectNotFound,
    Staged,
    StagingWriter,
    StoreError,
    StoreUnavailable,
    check_key,
    check_prefix,
    check_range,
    chunk_bounds,
    copy_file,
    download_verified,
    file_sha256,
    staging_key,
)

if TYPE_CHECKING:
    from obstore import ObjectMeta, WritableFile
    from obstore.store import ClientConfig, RetryConfig, S3Config

MIN_PART_BYTES = 5 * 2**20  # S3's smallest part other than the last
PART_BYTES = 8 * 2**20
CONCURRENCY = 4  # parts uploaded at once: a writer holds at most (CONCURRENCY + 1) x part_size
COPY_LIMIT = 5 * 2**30  # S3's largest CopyObject: a larger object is copied through the client
SPAN_BYTES = 256 * 2**20  # one GET's range: a large object is read in several, each done within the timeout
CLIENT_DEFAULTS = {"connect_timeout": "5s", "timeout": "300s"}  # per request: one part, or one span (>= 0.9 MB/s)
ENV_CONFIG = {  # S3Config field: the environment variables that set it, first found wins
    "endpoint": ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT"),
    "region": ("AWS_REGION", "AWS_DEFAULT_REGION"),
    "access_key_id": ("AWS_ACCESS_KEY_ID",),
    "secret_access_key": ("AWS_SECRET_ACCESS_KEY",),
    "session_token": ("AWS_SESSION_TOKEN",),
}
TRUE = frozenset({"1", "true", "yes", "on"})


def parse_s3_url(url: str) -> tuple[str, str]:
    """The bucket and key prefix of ``s3://bucket/prefix``."""
    parts = urlsplit(url)
    if parts.scheme != "s3" or not parts.netloc or parts.query or parts.fragment:
        raise ValueError(f"artifact URL must be s3://bucket/prefix, got {url!r}")
    return parts.netloc, check_prefix(parts.path.lstrip("/"))


def s3_config(env: Mapping[str, str]) -> dict[str, str]:
    """obstore's S3 settings from the AWS environment variables in ``env``."""
    found = {field: next((env[n] for n in names if env.get(n)), None) for field, names in ENV_CONFIG.items()}
    return {field: value for field, value in found.items() if value}


def allow_http(env: Mapping[str, str], endpoint: str | None) -> bool:
    """Whether plain http is allowed: an http:// endpoint, or AWS_ALLOW_HTTP=true."""
    return env.get("AWS_ALLOW_HTTP", "").lower() in TRUE or (endpoint or "").startswith("http://")


@contextmanager
def translate(key: str, verb: str) -> Iterator[None]:
    """obstore's errors as the store's: not found, changed (precondition), unavailable, refused."""
    try:
        yield
    except (NotFoundError, FileNotFoundError):  # obstore raises the builtin for a 404
        raise ObjectNotFound(key) from None
    except PreconditionError as exc:
        raise IntegrityError(f"{key}: changed while it was read") from exc
    except PermissionError as exc:
        raise StoreError(f"{verb} {key}: {first_line(exc)}") from exc
    except (GenericError, OSError) as exc:  # the writer raises a plain OSError for what failed under it
        raise StoreUnavailable(f"{verb} {key}: {first_line(exc)}") from exc
    except BaseError as exc:
        raise StoreError(f"{verb} {key}: {first_line(exc)}") from exc


def first_line(exc: BaseException) -> str:
    """An error's first line (obstore appends a multi-line debug dump)."""
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


class UploadSink:
    """An obstore writer: one PUT for a small object, a multipart upload of ``part_size`` parts
    (``concurrency`` at once) for a large one; an abort aborts the multipart upload."""

    def __init__(self, store: ObjectStoreS3, key: str, part_size: int, concurrency: int) -> None:
        self.key = key
        with translate(key, "write"):
            self.file: WritableFile = obstore.open_writer(
                store, key, buffer_size=part_size, max_concurrency=concurrency
            )

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Hand ``data`` to the upload; obstore keeps a reference to it until its part is sent, so
        a buffer the caller may reuse is copied first."""
        with translate(self.key, "write"):
            self.file.write(data if isinstance(data, bytes) else bytes(data))

    def finish(self) -> None:
        with translate(self.key, "write"):
            self.file.close()

    def abort(self, exc: BaseException) -> None:
        """Abort the upload; where that fails too (the store is down, or the writer already closed
        on the error), the bucket's lifecycle rule removes the incomplete multipart upload."""
        with suppress(BaseError, OSError):
            self.file.__exit__(type(exc), exc, exc.__traceback__)


class S3Store:
    """Artifacts as objects under ``prefix`` in ``bucket`` of an S3-compatible store."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        env: Mapping[str, str] = os.environ,
        part_size: int = PART_BYTES,
        concurrency: int = CONCURRENCY,
        copy_limit: int = COPY_LIMIT,
        client_options: Mapping[str, Any] | None = None,
        retry: Mapping[str, Any] | None = None,
    ) -> None:
        if not MIN_PART_BYTES <= part_size <= MAX_PART_BYTES:
            raise ValueError(f"part_size must be {MIN_PART_BYTES} to {MAX_PART_BYTES} bytes, got {part_size}")
        config = s3_config(env)
        options = {**CLIENT_DEFAULTS, "allow_http": allow_http(env, config.get("endpoint")), **(client_options or {})}
        self.bucket, self.prefix = bucket, check_prefix(prefix)
        self.part_size, self.concurrency, self.copy_limit = part_size, max(1, concurrency), copy_limit
        self.store = ObjectStoreS3(
            bucket,
            prefix=self.prefix or None,
            config=cast("S3Config", config),
            client_options=cast("ClientConfig", options),
            retry_config=cast("RetryConfig | None", retry),
        )

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> S3Store:
        """The store of ``s3://bucket/prefix``."""
        bucket, prefix = parse_s3_url(url)
        return cls(bucket, prefix, **kwargs)

    def __repr__(self) -> str:
        return f"S3Store('s3://{self.bucket}/{self.prefix}')"

    def writer(self) -> StagingWriter:
        """A writer to a new staging object, streamed in parts."""
        key = staging_key()
        return StagingWriter(key, UploadSink(self.store, key, self.part_size, self.concurrency))

    def stage_file(self, path: Path) -> Staged:
        """Upload the file to a new staging object, in parts."""
        return copy_file(self.writer(), path)

    def put_file(self, path: Path, key: str) -> Staged:
        """Upload the file to ``key`` in parts (an S3 object appears whole when its upload
        completes), read by the client itself while a thread hashes it. The file must not change
        meanwhile (a checkpoint never does; a reader's verified fetch would refuse it)."""
        check_key(key)
        size = path.stat().st_size
        with ThreadPoolExecutor(1, thread_name_prefix="hash") as hasher:
            digest = hasher.submit(file_sha256, path)
            with translate(key, "write"):
                obstore.put(self.store, key, path, chunk_size=self.part_size, max_concurrency=self.concurrency)
        return Staged(key, size, digest.result())

    def commit(self, staged: str, final: str) -> None:
        """Copy the staging object to its final key on the server (one larger than S3's CopyObject
        takes, through this client in parts), then delete the staging one (a delete that fails
        leaves it to the sweep: the object is committed)."""
        check_key(final)
        try:
            meta = self.head(check_key(staged))
            if meta["size"] > self.copy_limit:
                self.stream_copy(staged, meta, final)
            else:
                with translate(staged, "commit"):
                    obstore.copy(self.store, staged, final)
        except ObjectNotFound:
            if self.stat(final) is None:
                raise
            return
        with suppress(StoreError):
            self.delete(staged)

    def stream_copy(self, source: str, meta: ObjectMeta, final: str) -> None:
        """Copy ``source`` (as ``meta`` describes it) to ``final`` by reading it and uploading it
        in parts: the final object appears whole, or not at all."""
        with StagingWriter(final, UploadSink(self.store, final, self.part_size, self.concurrency)) as out:
            for chunk in self.ranges(source, meta["e_tag"], 0, meta["size"]):
                out.write(chunk)

    def fetch(self, key: str, dest: Path, size: int, sha256: str) -> Path:
        """Download to a file beside ``dest`` in ranged reads, verified, then rename it onto ``dest``."""
        meta = self.head(key)
        if meta["size"] != size:
            raise IntegrityError(f"{key}: {meta['size']} bytes stored, {size} recorded")
        chunks = self.ranges(key, meta["e_tag"], 0, size)
        return download_verified(key, chunks, dest, size, sha256)

    def open_range(self, key: str, start: int = 0, end: int | None = None) -> Iterator[bytes]:
        """The bytes ``[start, end)`` in ranged reads, each pinned to the object read first (its ETag)."""
        meta = self.head(key)
        lo, hi = check_range(start, end, meta["size"])
        return (bytes(chunk) for chunk in self.ranges(key, meta["e_tag"], lo, hi))

    def stat(self, key: str) -> ObjectInfo | None:
        """The object's size and modification time, or None."""
        try:
            meta = self.head(key)
        except ObjectNotFound:
            return None
        return ObjectInfo(key, meta["size"], meta["last_modified"])

    def delete(self, key: str) -> None:
        """Delete the object (S3 answers a delete of a missing key with success too)."""
        with translate(check_key(key), "delete"):
            obstore.delete(self.store, key)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object under ``prefix``, page by page."""
        folder = check_prefix(prefix)
        with translate(folder or "/", "list"):
            for page in obstore.list(self.store, folder or None):
                yield from (ObjectInfo(m["path"], m["size"], m["last_modified"]) for m in page)

    def head(self, key: str) -> ObjectMeta:
        """The object's metadata (size, last_modified, e_tag)."""
        with translate(check_key(key), "stat"):
            return obstore.head(self.store, key)

    def ranges(self, key: str, etag: str | None, start: int, end: int) -> Iterator[memoryview]:
        """``[start, end)`` in chunks: one streamed GET per span, each pinned to ``etag`` (a span
        of an object replaced since: IntegrityError)."""
        for lo, hi in chunk_bounds(start, end, SPAN_BYTES):
            options: dict[str, Any] = {"range": (lo, hi)}
            if etag:
                options["if_match"] = etag
            with translate(key, "read"):
                result = obstore.get(self.store, key, options=cast(Any, options))
                for chunk in result.stream(min_chunk_size=CHUNK_BYTES):
                    yield memoryview(chunk)


def retry_config(max_retries: int, timeout: timedelta) -> dict[str, Any]:
    """A retry policy: at most ``max_retries`` retries, none started after ``timeout``."""
    return {"max_retries": max_retries, "retry_timeout": timeout}
