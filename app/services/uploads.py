"""Resumable uploads: a dataset or a model sent in parts, in any order and in parallel, then completed.

An upload is created with its purpose, file name and size (refused at once over the limit or the
tenant's storage quota), and kept for ``MUONFORGE_UPLOAD_EXPIRY_SECONDS``. Each part (1 to
MAX_PARTS, at most 64 MiB) streams into the artifact store through a staging writer, checked
against the client's ``Repr-Digest`` when it sends one, and is recorded with its size and
sha256; sending a part again replaces it. The completion names every part with its sha256: a part
missing, extra or with another digest is refused, nothing lost (the upload stays pending). The
parts are then read back in order, each verified against its row as it streams, into the same
path a single-request upload takes (app.services.datasets, app.services.models): the same checks,
limits and quota, and the same dataset or model. The parts' objects are deleted once it has
committed, and an expired upload's by the sweep (``sweep_expired``, run by the reaper).

A completion marks the upload ``completing`` in a transaction of its own before it reads the
parts, so that no part changes and no second completion starts meanwhile; one that fails sets it
back to ``pending``.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Iterable, Iterator
from datetime import timedelta
from functools import partial

from sqlalchemy.orm import Session

from app.db.base import new_id, utcnow
from app.db.models import Upload, UploadPart
from app.db.session import on_commit, on_rollback, transaction
from app.errors import (
    NotFound,
    PayloadTooLarge,
    UploadExpired,
    UploadNotPending,
    UploadPartsMismatch,
    ValidationFailed,
)
from app.repositories.tenants import TenantRepository
from app.repositories.uploads import UploadRepository
from app.services import datasets, models
from app.services.auth import TenantRef
from app.services.datasets import over_quota, store_reachable
from app.settings import Settings
from app.storage import ArtifactStore, IntegrityError, ObjectNotFound, Staged, delete_all, store_from
from app.storage.base import MAX_PART_BYTES, verified
from contract.status import UploadStatus

log = logging.getLogger("muonforge.uploads")
UPLOADS = "uploads"  # the store's folder of parts: uploads/<upload id>/<number>.<sha256 prefix>
MAX_PARTS = 10_000
PURPOSES = ("dataset", "model")
SWEEP_BATCH = 100


def limit_of(purpose: str, settings: Settings) -> int:
    """The largest upload of ``purpose``."""
    return settings.upload_limit_bytes if purpose == "dataset" else settings.max_model_bytes


def create_upload(
    session: Session, tenant: TenantRef, purpose: str, filename: str, nbytes: int, name: str | None, settings: Settings
) -> Upload:
    """A new pending upload of ``nbytes`` bytes; 413 over the purpose's limit or the tenant's quota."""
    limit = limit_of(purpose, settings)
    if nbytes > limit:
        raise PayloadTooLarge(f"the file is {nbytes:,} bytes; a {purpose} upload takes at most {limit:,}", "bytes")
    quota, used = settings.tenant_storage_bytes, TenantRepository(session).stored_bytes(tenant.id)
    if used + nbytes > quota:
        raise over_quota(quota, used)
    expires = utcnow() + timedelta(seconds=settings.upload_expiry_seconds)
    row = Upload(
        id=new_id("upl"),
        tenant_id=tenant.id,
        purpose=purpose,
        filename=filename,
        name=(name or filename)[:200],
        bytes=nbytes,
        status=UploadStatus.PENDING,
        expires_at=expires,
    )
    return UploadRepository(session).add(row)


def get_upload(session: Session, tenant: TenantRef, upload_id: str) -> tuple[Upload, list[UploadPart]]:
    """The tenant's upload and its parts received so far (404 for another tenant's)."""
    repo = UploadRepository(session)
    upload = repo.get(upload_id, tenant.id)
    if upload is None:
        raise NotFound(f"no upload {upload_id}", param="upload_id")
    return upload, repo.parts(upload_id)


def pending(session: Session, tenant: TenantRef, upload_id: str, *, lock: bool = False) -> Upload:
    """The tenant's upload while it takes parts: 404, 409 ``upload_not_pending``, 410 ``upload_expired``."""
    upload = UploadRepository(session).get(upload_id, tenant.id, lock=lock)
    if upload is None:
        raise NotFound(f"no upload {upload_id}", param="upload_id")
    expired = upload.status == UploadStatus.PENDING and upload.expires_at <= utcnow()
    if upload.status == UploadStatus.EXPIRED or expired:
        raise UploadExpired(f"upload {upload_id} expired at {upload.expires_at.isoformat()}; its parts are deleted")
    if upload.status != UploadStatus.PENDING:
        raise UploadNotPending(f"upload {upload_id} is {upload.status}")
    return upload


def put_part(
    session: Session,
    tenant: TenantRef,
    upload_id: str,
    number: int,
    chunks: Iterable[bytes],
    sha256: str | None,
    settings: Settings,
) -> UploadPart:
    """Store part ``number`` of the upload from ``chunks`` (in place of an earlier one of that
    number). 422 for an empty part or one whose sha256 is not ``sha256`` (nothing kept), 413 past
    64 MiB or past the upload's declared size."""
    if not 1 <= number <= MAX_PARTS:
        raise ValidationFailed(f"a part's number is 1 to {MAX_PARTS}, not {number}", param="number")
    pending(session, tenant, upload_id)
    session.commit()  # no connection is held while the part is read
    store = store_from(settings)
    with store_reachable():
        staged = stage_part(chunks, store)
        try:
            if staged.size == 0:
                raise ValidationFailed("the part is empty", param="body")
            if sha256 is not None and staged.sha256 != sha256:
                raise ValidationFailed(
                    f"the part's sha256 is {staged.sha256}, not the {sha256} its Repr-Digest gives", param="body"
                )
            upload = pending(session, tenant, upload_id, lock=True)
            repo = UploadRepository(session)
            others = sum(p.bytes for p in repo.parts(upload_id) if p.number != number)
            if others + staged.size > upload.bytes:
                raise PayloadTooLarge(
                    f"the parts would add up to {others + staged.size:,} bytes; the upload was created for "
                    f"{upload.bytes:,} bytes",
                    "body",
                )
            key = f"{UPLOADS}/{upload_id}/{number:05d}.{staged.sha256[:16]}"
            replaced = repo.put_part(upload_id, number, staged.size, staged.sha256, key)
            store.commit(staged.key, key)
            if replaced != key:  # the same bytes again share their key: nothing to undo or delete
                on_rollback(session, partial(delete_all, store, [key]))
                if replaced is not None:
                    on_commit(session, partial(delete_all, store, [replaced]))
        except BaseException:
            datasets.discard(store, staged.key)
            raise
    return UploadPart(upload_id=upload_id, number=number, bytes=staged.size, sha256=staged.sha256, key=key)


def stage_part(chunks: Iterable[bytes], store: ArtifactStore) -> Staged:
    """Write ``chunks`` to a staging object; 413 (nothing kept) past MAX_PART_BYTES."""
    size = 0
    with store.writer() as writer:
        for chunk in chunks:
            size += len(chunk)
            if size > MAX_PART_BYTES:
                raise PayloadTooLarge(f"a part holds at most {MAX_PART_BYTES:,} bytes", "body")
            writer.write(chunk)
    assert writer.staged is not None
    return writer.staged


def complete_upload(
    session: Session, tenant: TenantRef, upload_id: str, claimed: list[tuple[int, str]], settings: Settings
) -> Upload:
    """Make the dataset or model of the upload from its parts, in order: ``claimed`` lists every
    part's number and sha256 as the client sent them (409 ``upload_parts_mismatch`` when they are
    not the parts stored). The dataset's or model's own checks apply (422, 413)."""
    upload = pending(session, tenant, upload_id, lock=True)
    parts = UploadRepository(session).parts(upload_id)
    check_parts(upload, parts, claimed)
    upload.status = UploadStatus.COMPLETING
    purpose, name, filename = upload.purpose, upload.name, upload.filename
    keys = [(p.number, p.key, p.bytes, p.sha256) for p in parts]
    session.commit()
    store = store_from(settings)
    try:
        with store_reachable():
            stream = io.BufferedReader(PartsReader(store, keys), buffer_size=datasets.CHUNK)
            if purpose == "dataset":
                result_id = datasets.upload_dataset(session, tenant, stream, name, settings, filename).id
            else:
                result_id = models.upload_model(session, tenant, stream, name, settings).id
            done = pending_row(session, tenant, upload_id)
            done.status, done.result_id = UploadStatus.COMPLETED, result_id
            on_commit(session, partial(delete_all, store, [key for _, key, _, _ in keys]))
            session.commit()
    except BaseException:
        session.rollback()
        with transaction(settings) as again:
            pending_row(again, tenant, upload_id).status = UploadStatus.PENDING  # to fix a part and try again
        raise
    return pending_row(session, tenant, upload_id)


def pending_row(session: Session, tenant: TenantRef, upload_id: str) -> Upload:
    upload = UploadRepository(session).get(upload_id, tenant.id, lock=True)
    assert upload is not None, upload_id
    return upload


def check_parts(upload: Upload, parts: list[UploadPart], claimed: list[tuple[int, str]]) -> None:
    """409 ``upload_parts_mismatch`` unless ``claimed`` names exactly the parts stored, 1 to N,
    with their sha256, and they add up to the upload's declared size."""
    stored = {p.number: p.sha256 for p in parts}
    numbers = [n for n, _ in claimed]
    if numbers != list(range(1, len(claimed) + 1)):
        raise UploadPartsMismatch("the parts listed must be numbered 1 to N, each once, in order")
    missing = [n for n in numbers if n not in stored]
    if missing:
        raise UploadPartsMismatch(f"part(s) {', '.join(map(str, missing[:10]))} not received; send them again")
    extra = sorted(set(stored) - set(numbers))
    if extra:
        raise UploadPartsMismatch(f"part(s) {', '.join(map(str, extra[:10]))} were received but not listed")
    wrong = [n for n, sha in claimed if stored[n] != sha]
    if wrong:
        raise UploadPartsMismatch(
            f"part(s) {', '.join(map(str, wrong[:10]))}: the sha256 received is not the one listed; send them again"
        )
    total = sum(p.bytes for p in parts)
    if total != upload.bytes:
        raise UploadPartsMismatch(f"the parts add up to {total:,} bytes; the upload was created for {upload.bytes:,}")


def cancel_upload(session: Session, tenant: TenantRef, upload_id: str, settings: Settings) -> Upload:
    """Cancel a pending upload; its parts are deleted once that commits."""
    upload = pending(session, tenant, upload_id, lock=True)
    upload.status = UploadStatus.CANCELLED
    keys = [p.key for p in UploadRepository(session).parts(upload_id)]
    on_commit(session, partial(delete_all, store_from(settings), keys))
    return upload


def sweep_expired(session: Session, settings: Settings) -> int:
    """Mark the pending (or abandoned completing) uploads past their expiry expired and delete their
    parts' objects once that commits; how many."""
    repo = UploadRepository(session)
    expired = repo.expired(utcnow(), SWEEP_BATCH)
    keys = []
    for upload in expired:
        upload.status = UploadStatus.EXPIRED
        keys += [p.key for p in repo.parts(upload.id)]
    if keys:
        on_commit(session, partial(delete_all, store_from(settings), keys))
    return len(expired)


class PartsReader(io.RawIOBase):
    """The parts' objects, in order, as one readable stream; each verified against its row's size
    and sha256 as it is read: one changed in the store since it was received is refused (409
    ``upload_parts_mismatch``, naming it) before its last chunk."""

    def __init__(self, store: ArtifactStore, parts: list[tuple[int, str, int, str]]) -> None:
        self._chunks = self._read(store, parts)
        self._left = memoryview(b"")

    @staticmethod
    def _read(store: ArtifactStore, parts: list[tuple[int, str, int, str]]) -> Iterator[bytes]:
        for number, key, size, sha256 in parts:
            try:
                yield from verified(key, store.open_range(key), size, sha256)
            except (IntegrityError, ObjectNotFound) as exc:
                log.error("upload part %d: %s", number, exc)
                raise UploadPartsMismatch(
                    f"part {number} changed in the service's storage since it was received; send it again"
                ) from None

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self._left:
            chunk = next(self._chunks, None)
            if chunk is None:
                return 0
            self._left = memoryview(chunk)
        n = min(len(buffer), len(self._left))
        buffer[:n] = self._left[:n]
        self._left = self._left[n:]
        return n
