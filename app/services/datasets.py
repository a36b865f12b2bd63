"""Datasets: uploads within the size limit and the storage quota, deletes, and the orphan sweep.

An upload is streamed to disk within the size limit and the tenant's storage quota, checked as
UTF-8, hashed and recorded; ``sweep_orphans`` removes the files that no row names.

A dataset's row and its file are stored together or not at all. The upload is written under a
temp name (``<id>.part``) and fsynced; its row is inserted (under the tenant's lock, which makes
the quota exact); only then is the file renamed to its final name, and removed again if the
transaction does not commit (``on_rollback``). A process that dies between the rename and the
commit leaves a final file that no row names, and one that dies mid-write a ``.part`` file:
``sweep_orphans`` (run by the reaper) removes both once they are an hour old.
"""

from __future__ import annotations

import codecs
import hashlib
import logging
import os
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import BinaryIO

from sqlalchemy.orm import Session

from app.db.base import new_id
from app.db.models import Dataset
from app.db.session import on_commit, on_rollback
from app.errors import DatasetInUse, NotFound, PayloadTooLarge, StorageQuotaExceeded, ValidationFailed
from app.repositories.jobs import JobRepository
from app.repositories.tenants import DatasetRepository, TenantRepository
from app.schemas import api as schemas
from app.services.auth import TenantRef
from app.settings import Settings
from app.storage.local import sync_directory
from contract import documents
from worker.engine.facts import CHAR_VOCAB_MAX, TOKEN_DIR

log = logging.getLogger("muonforge.datasets")

CHUNK = 1 << 20
DATASETS = "datasets"  # under MUONFORGE_ARTIFACT_DIR: datasets/<tenant id>/<dataset id><suffix>
STORED_SUFFIX = {"text": ".txt", "jsonl": ".jsonl", "parquet": ".parquet"}
ORPHAN_AGE_SECONDS = 3600.0  # a file no row names is removed once it is this old (no upload takes that long)


@dataclass(frozen=True)
class Stored:
    """What ``write_upload`` learned of a corpus as it wrote it."""

    size: int
    sha256: str
    char_vocab: int  # distinct characters, at most CHAR_VOCAB_MAX + 1 ("more than the char tokenizer takes")


def upload_dataset(
    session: Session, tenant: TenantRef, stream: BinaryIO, name: str, settings: Settings, filename: str | None = None
) -> Dataset:
    """Store an upload as a dataset of the tenant; its format is its file name's suffix (.jsonl,
    .parquet, else text), kept as the stored file's suffix.

    Over the upload limit, or over what is left of the tenant's storage quota
    (``MUONFORGE_TENANT_STORAGE_BYTES``), it answers 413: both say the request is larger than the
    server will take, and 413's meaning is exactly that (a 422 would say the file is invalid, which
    it is not; a smaller one is accepted).
    """
    datasets, tenants = DatasetRepository(session), TenantRepository(session)
    quota = settings.tenant_storage_bytes
    used = tenants.stored_bytes(tenant.id)
    session.commit()  # no connection is held while the file is read
    dataset_id = new_id("ds")
    fmt = documents.file_format(filename or name)
    relative = Path(DATASETS) / tenant.id / f"{dataset_id}{STORED_SUFFIX[fmt]}"
    target = settings.artifact_dir / relative
    tmp = target.with_suffix(".part")
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        stored = write_upload(stream, tmp, settings.upload_limit_bytes, quota, used, fmt)
        # Exact under concurrent uploads: the tenant's row is locked until the commit, so the sum
        # counts every upload of the tenant committed before this one.
        tenants.lock([tenant.id])
        used = tenants.stored_bytes(tenant.id)
        if used + stored.size > quota:
            raise over_quota(quota, used)
        dataset = datasets.add(
            Dataset(
                id=dataset_id,
                tenant_id=tenant.id,
                name=name[:200],
                bytes=stored.size,
                sha256=stored.sha256,
                char_vocab=stored.char_vocab,
                path=str(relative),
            )
        )
        on_rollback(session, partial(target.unlink, missing_ok=True))
        os.utime(tmp)  # its age counts from here: the sweep leaves it alone while this commits
        tmp.replace(target)
        sync_directory(target.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return dataset


def over_quota(quota: int, used: int) -> StorageQuotaExceeded:
    if quota == 0:
        return StorageQuotaExceeded("this server takes no uploads (its storage quota is 0 bytes)", "file")
    return StorageQuotaExceeded(
        f"the upload would take this tenant's datasets and models over its storage quota of {quota:,} bytes "
        f"({used:,} bytes in use); delete a dataset or a model to make room",
        param="file",
    )


def write_upload(stream: BinaryIO, tmp: Path, limit: int, quota: int, used: int, fmt: str = "text") -> Stored:
    """Write ``stream`` to ``tmp`` and fsync it (and its directory), checking it as ``fmt``.

    Text and JSONL are checked as UTF-8 as they arrive, each JSONL line as a row
    (contract.documents: a bad one is refused with its number); a parquet file once written (its
    footer, its string columns). Reading stops as soon as it passes ``limit`` or what ``quota``
    leaves above ``used``. The distinct characters are collected up to CHAR_VOCAB_MAX + 1 only, so
    memory stays bounded (that many plus one chunk's) whatever the file holds.
    """
    room = max(quota - used, 0)
    digest, decoder, size = hashlib.sha256(), codecs.getincrementaldecoder("utf-8")(), 0
    chars = Characters()
    lines = JsonlLines(chars) if fmt == "jsonl" else None
    try:
        with tmp.open("wb") as out:
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
                digest.update(chunk)
                out.write(chunk)
            if fmt != "parquet":
                decoder.decode(b"", final=True)
            out.flush()
            os.fsync(out.fileno())
    except UnicodeDecodeError:
        raise ValidationFailed("the file ends inside a UTF-8 character", param="file") from None
    if size == 0:
        raise ValidationFailed("the file is empty", param="file")
    if lines is not None:
        lines.finish()
    if fmt == "parquet":
        check_parquet(tmp, chars)
    sync_directory(tmp.parent)
    return Stored(size, digest.hexdigest(), chars.count)


class Characters:
    """Distinct characters seen, counted up to CHAR_VOCAB_MAX + 1 ("more than the char tokenizer takes")."""

    def __init__(self) -> None:
        self.seen: set[str] | None = set()

    def update(self, text: str) -> None:
        if self.seen is not None:
            self.seen.update(text)
            if len(self.seen) > CHAR_VOCAB_MAX:
                self.seen = None  # over the char tokenizer's range: no need to count further

    @property
    def count(self) -> int:
        return CHAR_VOCAB_MAX + 1 if self.seen is None else len(self.seen)


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


def check_parquet(path: Path, chars: Characters) -> None:
    """A parquet file readable, with a string column (a job names it, data.text_column); the
    characters counted over its string columns."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(path)
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


def parquet_columns(path: Path) -> list[str]:
    """A stored parquet dataset's column names (its footer only is read)."""
    import pyarrow.parquet as pq

    return list(pq.ParquetFile(path).schema_arrow.names)


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
    """Delete the dataset's row, then (once committed) its file and, unless another dataset holds
    the same bytes, its tokenized copies.

    Refused (409 dataset_in_use) while an unfinished job of the tenant (queued, running, paused at
    a rung) trains on it. The tenant's row is locked first, as a job's insert locks it: no job
    naming the dataset can be inserted between the count and the delete (one inserted after it
    finds no dataset).
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
    on_commit(session, partial((settings.artifact_dir / dataset.path).unlink, missing_ok=True))
    if not repo.holds_sha256(dataset.sha256):  # no other dataset (of any tenant) reads these tokens
        on_commit(session, partial(remove_tokens, settings.artifact_dir / TOKEN_DIR, dataset.sha256))


def remove_tokens(directory: Path, sha256: str) -> None:
    """Remove the tokenized copies of a text (every tokenizer's) from the jobs' shared token cache."""
    for path in directory.glob(f"{sha256[:16]}-*"):
        path.unlink(missing_ok=True)


def sweep_orphans(session: Session, settings: Settings, now: float | None = None) -> int:
    """Remove the files under the datasets directory that no row names; returns how many.

    Only files older than ORPHAN_AGE_SECONDS go: uploads cut off mid-write (``.part``), and files
    whose row was never committed (a process that died between the rename and the commit) or whose
    delete committed before its file went.
    """
    root = settings.artifact_dir / DATASETS
    if not root.is_dir():
        return 0
    cutoff = (time.time() if now is None else now) - ORPHAN_AGE_SECONDS
    repo, removed = DatasetRepository(session), 0
    for directory in (d for d in root.iterdir() if d.is_dir()):
        old = [f for f in directory.iterdir() if f.is_file() and mtime(f) < cutoff]
        stored = set(STORED_SUFFIX.values())
        known = repo.existing_ids({f.stem for f in old if f.suffix in stored})
        for f in old:
            if f.suffix == ".part" or (f.suffix in stored and f.stem not in known):
                f.unlink(missing_ok=True)
                removed += 1
    if removed:
        log.info("removed %d dataset file(s) that no dataset names", removed)
    return removed


def mtime(path: Path) -> float:
    """When the file was last written; infinitely late once it is gone (another sweep removed it)."""
    try:
        return path.stat().st_mtime
    except FileNotFoundError:  # removed meanwhile (another process's sweep)
        return float("inf")
