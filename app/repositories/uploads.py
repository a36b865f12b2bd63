"""All SQL about resumable uploads and their parts."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.db.models import Upload, UploadPart
from contract.status import UploadStatus


class UploadRepository:
    def __init__(self, session: Session) -> None:
        self.session = session

    def add(self, upload: Upload) -> Upload:
        self.session.add(upload)
        self.session.flush()
        return upload

    def get(self, upload_id: str, tenant_id: str, *, lock: bool = False) -> Upload | None:
        """The tenant's upload; ``lock``: its row locked until the transaction ends."""
        query = select(Upload).where(Upload.id == upload_id, Upload.tenant_id == tenant_id)
        if lock:
            query = query.with_for_update().execution_options(populate_existing=True)
        return self.session.scalars(query).one_or_none()

    def parts(self, upload_id: str) -> list[UploadPart]:
        """The upload's parts, by number."""
        query = select(UploadPart).where(UploadPart.upload_id == upload_id).order_by(UploadPart.number)
        return list(self.session.scalars(query))

    def put_part(self, upload_id: str, number: int, nbytes: int, sha256: str, key: str) -> str | None:
        """Record the part (in place of an earlier one of that number); the key of the one it
        replaced, if any."""
        part = self.session.get(UploadPart, (upload_id, number), populate_existing=True)
        if part is None:
            self.session.add(UploadPart(upload_id=upload_id, number=number, bytes=nbytes, sha256=sha256, key=key))
            self.session.flush()
            return None
        replaced, (part.bytes, part.sha256, part.key) = part.key, (nbytes, sha256, key)
        return replaced

    def expired(self, now: datetime, limit: int) -> list[Upload]:
        """Pending uploads (and completions abandoned) past their expiry, oldest first, locked
        (others skip them)."""
        query = (
            select(Upload)
            .where(Upload.status.in_([UploadStatus.PENDING, UploadStatus.COMPLETING]), Upload.expires_at < now)
            .order_by(Upload.expires_at)
            .limit(limit)
            .with_for_update(skip_locked=True)
        )
        return list(self.session.scalars(query))
