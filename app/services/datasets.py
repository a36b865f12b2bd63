"""Dataset uploads: streamed to disk with a size limit, checked as UTF-8, hashed, recorded."""

from __future__ import annotations

import codecs
import hashlib
from pathlib import Path
from typing import BinaryIO

from sqlalchemy.orm import Session

from app.db.base import new_id
from app.db.models import Dataset
from app.errors import NotFound, PayloadTooLarge, ValidationFailed
from app.repositories.tenants import DatasetRepository
from app.schemas import api as schemas
from app.services.auth import TenantRef
from app.settings import Settings

CHUNK = 1 << 20


def upload_dataset(session: Session, tenant: TenantRef, stream: BinaryIO, name: str, settings: Settings) -> Dataset:
    dataset_id = new_id("ds")
    relative = Path("datasets") / tenant.id / f"{dataset_id}.txt"
    target = settings.artifact_dir / relative
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".part")
    digest, decoder, chars, size = hashlib.sha256(), codecs.getincrementaldecoder("utf-8")(), set(), 0
    try:
        with tmp.open("wb") as out:
            while chunk := stream.read(CHUNK):
                size += len(chunk)
                if size > settings.upload_limit_bytes:
                    raise PayloadTooLarge(f"the upload exceeds {settings.upload_limit_bytes:,} bytes", param="file")
                try:
                    chars.update(decoder.decode(chunk))
                except UnicodeDecodeError as exc:
                    where = size - len(chunk) + exc.start
                    raise ValidationFailed(f"the file is not UTF-8 text (byte {where})", "file") from None
                digest.update(chunk)
                out.write(chunk)
            decoder.decode(b"", final=True)
        if size == 0:
            raise ValidationFailed("the file is empty", param="file")
        tmp.replace(target)
    except UnicodeDecodeError:
        tmp.unlink(missing_ok=True)
        raise ValidationFailed("the file ends inside a UTF-8 character", param="file") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dataset = Dataset(
        id=dataset_id, tenant_id=tenant.id, name=name[:200], bytes=size, sha256=digest.hexdigest(),
        char_vocab=len(chars), path=str(relative),
    )  # fmt: skip
    return DatasetRepository(session).add(dataset)


def get_dataset(session: Session, tenant: TenantRef, dataset_id: str) -> Dataset:
    dataset = DatasetRepository(session).get(dataset_id, tenant.id)
    if dataset is None:
        raise NotFound(f"no dataset {dataset_id!r}", param="dataset_id")
    return dataset


def list_datasets(session: Session, tenant: TenantRef, limit: int, after: str | None) -> schemas.DatasetList:
    rows = DatasetRepository(session).page(tenant.id, limit, after)
    page = rows[:limit]
    return schemas.DatasetList(
        data=[schemas.Dataset.model_validate(d) for d in page],
        has_more=len(rows) > limit,
        next_after=page[-1].id if len(rows) > limit else None,
    )
