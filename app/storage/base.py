"""The artifact store's contract: keys, the objects' facts, the errors, and the staging writer.

A key is a relative POSIX path (``datasets/t1/abc.txt``). Every object is written under a staging
key (``staging/<random>``) while its size and sha256 are computed, and becomes visible at its final
key only when the caller commits it, once its database row has committed; staging keys left
behind by a crash are swept by age (:func:`sweep_staging`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import TracebackType
from typing import Protocol, Self

log = logging.getLogger("muonforge.storage")
STAGING = "staging"
CHUNK_BYTES = 8 * 2**20  # a read's unit: a range request, a file read, a hashed and written block
IN_FLIGHT = 4  # chunks a verified download receives ahead of its hashing and writing (5 x 8 MiB held at most)
MAX_PART_BYTES = 64 * 2**20


class StoreError(Exception):
    """The artifact store refused an operation (the base of the store's errors)."""


class StoreUnavailable(StoreError, ConnectionError):
    """The store could not be reached or answered with a server error: retry later (a
    ConnectionError, so that the retries and hand-backs of a database outage apply to it too)."""


class ObjectNotFound(StoreError):
    """No object at this key."""


class IntegrityError(StoreError):
    """An object's bytes are not the ones its row records (size or sha256), or changed while read."""


@dataclass(frozen=True)
class ObjectInfo:
    """One stored object: its key, size in bytes and last modification time (UTC)."""

    key: str
    size: int
    modified: datetime


@dataclass(frozen=True)
class Staged:
    """An object written under a staging key, with the size and sha256 of what was written."""

    key: str
    size: int
    sha256: str


class Sink(Protocol):
    """Where a staging writer's bytes go: a backend's file or multipart upload."""

    def write(self, data: bytes | bytearray | memoryview) -> None: ...

    def finish(self) -> None: ...

    def abort(self, exc: BaseException) -> None: ...


class StagingWriter:
    """A write-only stream to a staging key that counts and hashes every byte it passes on.

    Used as a context manager: a clean exit finishes the object and sets :attr:`staged`; an
    exception aborts it (nothing is left under the staging key).
    """

    def __init__(self, key: str, sink: Sink) -> None:
        self.key = key
        self.staged: Staged | None = None
        self._sink = sink
        self._hash = hashlib.sha256()
        self._size = 0

    def write(self, data: bytes | bytearray | memoryview) -> int:
        """Pass ``data`` on to the store; returns its length."""
        size = memoryview(data).nbytes
        self._hash.update(data)
        self._sink.write(data)
        self._size += size
        return size

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is not None:
            self._sink.abort(exc)
            return
        try:
            self._sink.finish()
        except BaseException as failed:
            self._sink.abort(failed)
            raise
        self.staged = Staged(self.key, self._size, self._hash.hexdigest())


class ArtifactStore(Protocol):
    """Artifacts by key: staged writes committed once their row commits, verified reads, listing.

    Every operation is synchronous (the API calls it in its thread pool). Errors: ObjectNotFound,
    IntegrityError, StoreUnavailable (retry later), all StoreError.
    """

    def writer(self) -> StagingWriter:
        """A streaming writer to a new staging key (bounded memory: multipart for large objects)."""
        ...

    def stage_file(self, path: Path) -> Staged:
        """The file at ``path`` written under a staging key (a file already in the store's own
        directory is staged where it is: its key is its path there, and nothing is copied)."""
        ...

    def commit(self, staged: str, final: str) -> None:
        """Make the object at ``staged`` visible at ``final`` (replacing what was there).

        Repeating a commit that already happened (``staged`` gone, ``final`` present) succeeds.
        """
        ...

    def put_file(self, path: Path, key: str) -> Staged:
        """The file at ``path`` stored at ``key`` itself, no staging copy: for a key nothing reads
        before the caller's row names it (a checkpoint's attempt-unique key), so an object there
        without a row is an orphan its owner deletes. An upload cut off leaves nothing there."""
        ...

    def fetch(self, key: str, dest: Path, size: int, sha256: str) -> Path:
        """Download ``key`` to ``dest`` through a temporary file beside it, verified.

        Raises IntegrityError (``dest`` untouched) when the object's size or sha256 differ.
        """
        ...

    def open_range(self, key: str, start: int = 0, end: int | None = None) -> Iterator[bytes]:
        """The bytes ``[start, end)`` of ``key`` (``end`` past the object: to its end), in chunks.

        The object is looked up before this returns (ObjectNotFound at once); an object replaced
        while its chunks are read raises IntegrityError.
        """
        ...

    def stat(self, key: str) -> ObjectInfo | None:
        """The object at ``key``, or None."""
        ...

    def delete(self, key: str) -> None:
        """Delete ``key``; deleting what is not there succeeds."""
        ...

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object under the folder ``prefix`` (whole path segments; empty: everything)."""
        ...


def copy_file(writer: StagingWriter, path: Path) -> Staged:
    """Write the file at ``path`` through ``writer`` (a context it opens and closes); what it staged."""
    with writer, path.open("rb") as file:
        while chunk := file.read(CHUNK_BYTES):
            writer.write(chunk)
    assert writer.staged is not None
    return writer.staged


def file_sha256(path: Path) -> str:
    """The sha256 of the file at ``path``, read in chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def check_key(key: str) -> str:
    """``key`` when it is a relative POSIX path of plain segments; ValueError otherwise."""
    segments = key.split("/")
    if not key or "\\" in key or "\0" in key or any(s in ("", ".", "..") for s in segments):
        raise ValueError(f"invalid artifact key: {key!r}")
    return key


def check_prefix(prefix: str) -> str:
    """``prefix`` without a trailing slash; empty (everything) or a valid key."""
    prefix = prefix.rstrip("/")
    return prefix and check_key(prefix)


def staging_key() -> str:
    """A new key under the staging folder that nothing else uses."""
    return f"{STAGING}/{secrets.token_hex(16)}"


def check_range(start: int, end: int | None, size: int) -> tuple[int, int]:
    """The half-open range ``[start, end)`` clipped to an object of ``size`` bytes."""
    if start < 0 or (end is not None and end < start):
        raise ValueError(f"invalid byte range: [{start}, {end})")
    stop = size if end is None else min(end, size)
    return min(start, stop), stop


def chunk_bounds(start: int, end: int, chunk: int = CHUNK_BYTES) -> Iterator[tuple[int, int]]:
    """``[start, end)`` cut into consecutive ranges of at most ``chunk`` bytes."""
    for lo in range(start, end, chunk):
        yield lo, min(lo + chunk, end)


def partial_path(dest: Path) -> Path:
    """A temporary file name beside ``dest`` (same filesystem, so it can be renamed onto it)."""
    return dest.with_name(f".{dest.name}.{secrets.token_hex(6)}.part")


def download_verified(key: str, chunks: Iterable[bytes | memoryview], dest: Path, size: int, sha256: str) -> Path:
    """Write ``chunks`` to a file beside ``dest`` and rename it onto ``dest`` when its size and
    sha256 are the expected ones; IntegrityError otherwise (``dest`` untouched, nothing left).

    A thread of its own hashes and writes each chunk while the next one arrives (both let go of
    the GIL), at most IN_FLIGHT chunks behind."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp, digest, written = partial_path(dest), hashlib.sha256(), 0
    try:
        with tmp.open("wb") as out, ThreadPoolExecutor(1, thread_name_prefix="download") as disk:

            def keep(chunk: bytes | memoryview) -> None:
                digest.update(chunk)
                out.write(chunk)

            behind: deque[Future[None]] = deque()
            for chunk in chunks:
                written += len(chunk)
                if written > size:
                    raise IntegrityError(f"{key}: more than the {size} bytes recorded")
                behind.append(disk.submit(keep, chunk))
                while len(behind) > IN_FLIGHT or (behind and behind[0].done()):
                    behind.popleft().result()
            while behind:
                behind.popleft().result()
            out.flush()
            os.fsync(out.fileno())  # on disk before its name says it is there
        verify(key, written, digest.hexdigest(), size, sha256)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def verified(key: str, chunks: Iterable[bytes], size: int, sha256: str | None) -> Iterator[bytes]:
    """The chunks of a whole object, the last one held back until everything read matched the
    recorded size and sha256 (IntegrityError instead of it, so a reader never gets a complete copy
    of changed bytes). ``sha256`` None checks the size alone."""
    digest, total, held = hashlib.sha256(), 0, None
    for chunk in chunks:
        if held is not None:
            yield held
        digest.update(chunk)
        total += len(chunk)
        held = chunk
    verify(key, total, digest.hexdigest() if sha256 else "", size, sha256 or "")
    if held is not None:
        yield held


def verify(key: str, size: int, sha256: str, want_size: int, want_sha256: str) -> None:
    """IntegrityError unless the size and sha256 read are the ones recorded."""
    if size != want_size:
        raise IntegrityError(f"{key}: {size} bytes stored, {want_size} recorded")
    if sha256 != want_sha256:
        raise IntegrityError(f"{key}: sha256 {sha256} stored, {want_sha256} recorded")


def stale(objects: Iterable[ObjectInfo], cutoff: datetime) -> list[str]:
    """The keys of the objects last modified before ``cutoff``."""
    return [o.key for o in objects if o.modified < cutoff]


def delete_all(store: ArtifactStore, keys: Iterable[str]) -> None:
    """Delete ``keys``; one the store refuses stays (logged) for a sweep or a later delete."""
    for key in keys:
        try:
            store.delete(key)
        except StoreError as exc:
            log.warning("%s stays in the store: %s", key, exc)


def sweep_staging(store: ArtifactStore, older_than: timedelta, now: datetime | None = None) -> list[str]:
    """Delete the staging objects older than ``older_than`` (left by writes never committed);
    returns their keys. ``older_than`` must exceed the longest time between a write's end and its
    commit (hours, not minutes)."""
    cutoff = (now or datetime.now(UTC)) - older_than
    keys = stale(store.list(STAGING), cutoff)
    for key in keys:
        store.delete(key)
    return keys
