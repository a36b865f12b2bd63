"""Datasets: uploads within the size limit and the storage quota, deletes, and the orphan sweep.

An upload is streamed to the artifact store (``app.storage``: files under MUONFORGE_ARTIFACT_DIR
by default, an S3 bucket with MUONFORGE_ARTIFACT_URL) within the size limit and the tenant's
storage quota, checked as it arrives, and recorded with the size and sha256 the store's writer
computed; ``sweep_orphans`` removes the objects that no row names.

A dataset's row and its object are stored together or not at all. The upload is written under a
staging key; its row is inserted (under the tenant's lock, which makes the quota exact); only
then is the object committed to its final key (``datasets/<tenant>/<id><suffix>``, the row's
``path``), and deleted again if the transaction does not commit (``on_rollback``). A process that
dies between the store's commit and the database's leaves an object that no row names, and one
that dies mid-upload a staging object: ``sweep_orphans`` (run by the reaper) removes both once
they are an hour old.
"""

from __future__ import annotations

import codecs
import logging
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from datetime import UTC, datetime, timedelta
from functools import partial
from itertools import islice
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from sqlalchemy.orm import Session

from app.db.base import new_id
from app.db.models import Dataset
from app.db.session import on_commit, on_rollback
from app.errors import (
    DatasetInUse,
    NotFound,
    PayloadTooLarge,
    ServiceUnavailable,
    StorageQuotaExceeded,
    ValidationFailed,
)
from app.repositories.jobs import JobRepository
from app.repositories.tenants import DatasetRepository, TenantRepository
from app.schemas import api as schemas
from app.services.auth import TenantRef
from app.settings import Settings
from app.storage import (
    ArtifactStore,
    Staged,
    StoreError,
    StoreUnavailable,
    cache_from,
    store_from,
    sweep_staging,
)
from contract import documents
from worker.engine.facts import CHAR_VOCAB_MAX, TOKEN_NAME_DIGEST, CharacterSet

log = logging.getLogger("muonforge.datasets")

CHUNK = 1 << 20
DATASETS = "datasets"  # the store's folder of datasets: datasets/<tenant id>/<dataset id><suffix>
STORED_SUFFIX = {"text": ".txt", "jsonl": ".jsonl", "parquet": ".parquet"}
ORPHAN_AGE_SECONDS = 3600.0  # an object no row names is removed once it is this old (no upload takes that long)
RETRY_AFTER_SECONDS = 30  # what a 503 for an unreachable store suggests
SWEEP_BATCH = 1000  # dataset ids looked up per query by the sweep


def upload_dataset(
    session: Session, tenant: TenantRef, stream: BinaryIO, name: str, settings: Settings, filename: str | None = None
) -> Dataset:
    """Store an upload as a dataset of the tenant; its format is its file name's suffix (.jsonl,
    .parquet, else text), kept as the stored object's suffix.

    Over the upload limit, or over what is left of the tenant's storage quota
    (``MUONFORGE_TENANT_STORAGE_BYTES``), it answers 413: both say the request is larger than the
    server will take, and 413's meaning is exactly that (a 422 would say the file is invalid, which
    it is not; a smaller one is accepted). A store that cannot be reached answers 503.
    """
    datasets, tenants = DatasetRepository(session), TenantRepository(session)
    quota = settings.tenant_storage_bytes
    used = tenants.stored_bytes(tenant.id)
    session.commit()  # no connection is held while the file is read
    dataset_id = new_id("ds")
    fmt = documents.file_format(filename or name)
    key = f"{DATASETS}/{tenant.id}/{dataset_id}{STORED_SUFFIX[fmt]}"
    store = store_from(settings)
    with store_reachable():
        staged, char_vocab, columns = stage_upload(stream, store, settings.upload_limit_bytes, quota, used, fmt)
        try:
            # Exact under concurrent uploads: the tenant's row is locked until the commit, so the sum
            # counts every upload of the tenant committed before this one.
            tenants.lock([tenant.id])
            used = tenants.stored_bytes(tenant.id)
            if used + staged.size > quota:
                raise over_quota(quota, used)
            dataset = datasets.add(
                Dataset(
                    id=dataset_id,
                    tenant_id=tenant.id,
                    name=name[:200],
                    bytes=staged.size,
                    sha256=staged.sha256,
                    char_vocab=char_vocab,
                    columns=columns,
                    path=key,
                )
            )
            on_rollback(session, partial(store.delete, key))
            store.commit(staged.key, key)
        except BaseException:
            discard(store, staged.key)
            raise
    return dataset


@contextmanager
def store_reachable() -> Iterator[None]:
    """The store being unreachable as a 503 (retry later) rather than a 500."""
    try:
        yield
    except StoreUnavailable as exc:
        log.warning("the artifact store is unavailable: %s", exc)
        raise ServiceUnavailable(
            "the artifact store cannot be reached; try again later", headers={"Retry-After": str(RETRY_AFTER_SECONDS)}
        ) from exc


def discard(store: ArtifactStore, key: str) -> None:
    """Delete a staging object that will not be committed; where the store refuses, the sweep removes it."""
    with suppress(StoreError):
        store.delete(key)


def over_quota(quota: int, used: int) -> StorageQuotaExceeded:
    if quota == 0:
        return StorageQuotaExceeded("this server takes no uploads (its storage quota is 0 bytes)", "file")
    return StorageQuotaExceeded(
        f"the upload would take this tenant's datasets and models over its storage quota of {quota:,} bytes "
        f"({used:,} bytes in use); delete a dataset or a model to make room",
        param="file",
    )


def stage_upload(
    stream: BinaryIO, store: ArtifactStore, limit: int, quota: int, used: int, fmt: str = "text"
) -> tuple[Staged, int, list[str] | None]:
    """Stream ``stream`` to a staging object of ``store``, checked as ``fmt`` (``check_stream``);
    returns the staged object, its distinct characters and a parquet file's column names.

    A parquet file is read by pyarrow, which seeks: its bytes also go to an anonymous temporary
    file (the system temp directory, TMPDIR) as they pass, checked there once complete. A check
    that fails aborts the writer: nothing is left under the staging key.
    """
    with ExitStack() as stack:
        spool = stack.enter_context(tempfile.TemporaryFile()) if fmt == "parquet" else None
        writer = stack.enter_context(store.writer())
        sinks: list[Callable[[bytes], object]] = [writer.write] if spool is None else [writer.write, spool.write]
        chars = check_stream(stream, sinks, limit, quota, used, fmt)
        columns = None
        if spool is not None:
            spool.flush()
            columns = check_parquet(spool, chars)
    assert writer.staged is not None  # set by the writer's clean exit
    return writer.staged, chars.count, columns


def check_stream(
    stream: BinaryIO, sinks: list[Callable[[bytes], object]], limit: int, quota: int, used: int, fmt: str
) -> Characters:
    """Pass ``stream``'s chunks to each of ``sinks``, checking them as ``fmt``; returns the
    distinct characters seen.

    Text and JSONL are checked as UTF-8 as they arrive, each JSONL line as a row
    (contract.documents: a bad one is refused with its number); a parquet file is left to
    ``check_parquet`` once complete. Reading stops as soon as it passes ``limit`` or what ``quota``
    leaves above ``used``. The distinct characters are collected up to CHAR_VOCAB_MAX + 1 only, so
    memory stays bounded (that many plus one chunk's) whatever the file holds.
    """
    room = max(quota - used, 0)
    decoder, size = codecs.getincrementaldecoder("utf-8")(), 0
    chars = Characters()
    lines = JsonlLines(chars) if fmt == "jsonl" else None
    try:
        while chunk := stream.read(CHUNK):
            size += len(chunk)
            if size > min(limit, room):
                if limit <= room:
                    raise PayloadTooLarge(f"the upload exceeds {limit:,} bytes", param="file")
                raise over_quota(quota, used)
            if fmt != "parquet":
                try:
                    text = decoder.decode(chunk)
                except UnicodeDecodeError as exc:
                    where = size - len(chunk) + exc.start
                    raise ValidationFailed(f"the file is not UTF-8 text (byte {where})", "file") from None
                if lines is not None:
                    lines.feed(text)
                else:
                    chars.update(text)
            for sink in sinks:
                sink(chunk)
        if fmt != "parquet":
            decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        raise ValidationFailed("the file ends inside a UTF-8 character", param="file") from None
    if size == 0:
        raise ValidationFailed("the file is empty", param="file")
    if lines is not None:
        lines.finish()
    return chars


class Characters:
    """Distinct characters seen, counted up to CHAR_VOCAB_MAX + 1 ("more than the char tokenizer takes")."""

    def __init__(self) -> None:
        self.seen: CharacterSet | None = CharacterSet()

    def update(self, text: str) -> None:
        if self.seen is not None:
            self.seen.update(text)
            if len(self.seen.found) > CHAR_VOCAB_MAX:
                self.seen = None  # over the char tokenizer's range: no need to count further

    @property
    def count(self) -> int:
        return CHAR_VOCAB_MAX + 1 if self.seen is None else len(self.seen.found)


class JsonlLines:
    """A JSONL upload's lines checked as rows as the text arrives; the characters counted are those
    of the documents the rows lay out (the default layout: its role lines and NUL end of text)."""

    def __init__(self, chars: Characters) -> None:
        self.chars, self.rest, self.number, self.rows = chars, "", 0, 0

    def feed(self, text: str) -> None:
        *complete, self.rest = (self.rest + text).split("\n")
        for line in complete:
            self.check(line)

    def finish(self) -> None:
        self.check(self.rest)
        if not self.rows:
            raise ValidationFailed("the JSONL file holds no row", param="file")

    def check(self, line: str) -> None:
        self.number += 1
        if not line.strip():
            return
        try:
            row = documents.parse_row(line)
        except ValueError as exc:
            raise ValidationFailed(f"line {self.number}: {exc}", param="file") from None
        self.rows += 1
        self.chars.update(documents.segments_text(documents.segments(row)))


def check_parquet(source: Path | BinaryIO, chars: Characters) -> list[str]:
    """A parquet file (a path, or a seekable file) readable, with a string column (a job names
    it, data.text_column); the characters counted over its string columns. Returns its column names."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(source)
        columns = [f.name for f in table.schema_arrow if pa.types.is_string(f.type) or pa.types.is_large_string(f.type)]
        if not columns:
            raise ValidationFailed("the parquet file has no string column to train on", param="file")
        for batch in table.iter_batches(columns=columns):
            for column in batch.columns:
                for value in column.to_pylist():
                    chars.update(value or "")
    except (pa.ArrowException, OSError) as exc:
        raise ValidationFailed(f"the file is not a readable parquet file: {exc}", param="file") from None
    chars.update(documents.NUL)
    return list(table.schema_arrow.names)


def get_dataset(session: Session, tenant: TenantRef, dataset_id: str) -> Dataset:
    dataset = DatasetRepository(session).get(dataset_id, tenant.id)
    if dataset is None:
        raise NotFound(f"no dataset {dataset_id!r}", param="dataset_id")
    return dataset


def list_datasets(session: Session, tenant: TenantRef, limit: int, after: str | None) -> schemas.DatasetList:
    rows = DatasetRepository(session).page(tenant.id, limit, after)
    page = rows[:limit]
    return schemas.DatasetList(
        data=[schemas.Dataset.of(d) for d in page],
        has_more=len(rows) > limit,
        next_after=page[-1].id if len(rows) > limit else None,
    )


def delete_dataset(session: Session, tenant: TenantRef, dataset_id: str, settings: Settings) -> None:
    """Delete the dataset's row, then (once committed) its stored object and, unless another
    dataset holds the same bytes, its tokenized copies.

    Refused (409 dataset_in_use) while an unfinished job of the tenant (queued, running, paused at
    a rung) trains on it. The tenant's row is locked first, as a job's insert locks it: no job
    naming the dataset can be inserted between the count and the delete (one inserted after it
    finds no dataset). An object the store fails to delete is left to ``sweep_orphans``.
    """
    TenantRepository(session).lock([tenant.id])
    dataset = get_dataset(session, tenant, dataset_id)
    jobs = JobRepository(session)
    if unfinished := jobs.count_unfinished_using(tenant.id, dataset.id):
        raise DatasetInUse(
            f"dataset {dataset.id!r} is used by {unfinished} queued, running or paused job(s): cancel them or let "
            "them finish",
            param="dataset_id",
        )
    jobs.forget_dataset(tenant.id, dataset.id)
    repo = DatasetRepository(session)
    repo.delete(dataset)
    on_commit(session, partial(store_from(settings).delete, dataset.path))
    if not repo.holds_sha256(dataset.sha256):  # no other dataset (of any tenant) reads these tokens
        on_commit(session, partial(remove_tokens, settings, dataset.sha256))


def remove_tokens(settings: Settings, sha256: str) -> None:
    """Evict a text's token arrays (every tokenizer's) from this host's cache; other hosts' age out."""
    cache_from(settings, store_from(settings)).discard(sha256[:TOKEN_NAME_DIGEST])


def sweep_orphans(session: Session, settings: Settings, now: float | None = None) -> int:
    """Remove the store's dataset objects that no row names; returns how many.

    Only objects older than ORPHAN_AGE_SECONDS go: those whose row was never committed (a process
    that died between the store's commit and the database's) or whose delete committed before the
    object went, and the ``.part`` files that uploads cut off mid-write left before uploads went
    through the store. The store's staging objects of that age (writes never committed: a process
    that died mid-upload) are swept too, logged but not counted.
    """
    store = store_from(settings)
    at = time.time() if now is None else now
    cutoff = datetime.fromtimestamp(at - ORPHAN_AGE_SECONDS, UTC)
    old = [o.key for o in store.list(DATASETS) if o.modified < cutoff and len(o.key.split("/")) == 3]
    repo = DatasetRepository(session)
    known: set[str | None] = {None}  # None: a key that names no dataset, which is kept
    ids = iter(sorted({i for key in old if (i := dataset_id_of(key))}))
    while batch := list(islice(ids, SWEEP_BATCH)):
        known |= repo.existing_ids(batch)
    orphans = [key for key in old if key.endswith(".part") or dataset_id_of(key) not in known]
    for key in orphans:
        store.delete(key)
    removed = len(orphans)
    if removed:
        log.info("removed %d dataset object(s) that no dataset names", removed)
    staged = sweep_staging(store, timedelta(seconds=ORPHAN_AGE_SECONDS), datetime.fromtimestamp(at, UTC))
    if staged:
        log.info("removed %d staging object(s) never committed", len(staged))
    return removed


def dataset_id_of(key: str) -> str | None:
    """The dataset id a stored object's key names (``datasets/<tenant>/<id><suffix>``), or None."""
    path = PurePosixPath(key)
    return path.stem if path.suffix in STORED_SUFFIX.values() else None


def mtime(path: Path) -> float:
    """When the file was last written; infinitely late once it is gone (another sweep removed it)."""
    try:
        return path.stat().st_mtime
    except FileNotFoundError:  # removed meanwhile (another process's sweep)
        return float("inf")
