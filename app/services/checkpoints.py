"""Checkpoints of a job, tenant-scoped: listed, downloaded from the artifact store, exported."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from sqlalchemy.orm import Session

from app.errors import ArtifactChanged, NotFound
from app.repositories.checkpoints import CheckpointRepository
from app.schemas import api as schemas
from app.services.auth import TenantRef
from app.services.datasets import store_reachable
from app.services.jobs import get_job
from app.settings import Settings
from app.storage import IntegrityError, ObjectNotFound, cache_from, store_from

log = logging.getLogger("muonforge.api")
EXPORTS = "exports"  # under the artifact dir: exports being written (each deleted as it is sent)
T = TypeVar("T")


def list_checkpoints(
    session: Session, tenant: TenantRef, job_id: str, limit: int, after: int | None
) -> schemas.CheckpointList:
    """A page of the job's checkpoints, newest first; ``after`` is the previous page's
    ``next_after`` (a step)."""
    get_job(session, tenant, job_id)  # 404 for another tenant's job
    rows = CheckpointRepository(session).checkpoints_page(job_id, limit + 1, after)
    page = rows[:limit]
    return schemas.CheckpointList(
        data=[schemas.Checkpoint.model_validate(c) for c in page],
        has_more=len(rows) > limit,
        next_after=str(page[-1].step) if len(rows) > limit else None,
    )


@dataclass(frozen=True)
class StoredCheckpoint:
    """A checkpoint's object in the artifact store, as its row records it."""

    key: str
    bytes: int
    sha256: str | None  # None: recorded before digests were kept


def missing(job_id: str, step: int) -> NotFound:
    return NotFound(f"job {job_id} has no checkpoint at step {step}", param="step")


def checkpoint_object(session: Session, tenant: TenantRef, job_id: str, step: int) -> StoredCheckpoint:
    """The store object of the job's checkpoint after ``step`` steps (404 without one)."""
    get_job(session, tenant, job_id)  # 404 for another tenant's job
    found = CheckpointRepository(session).checkpoint(job_id, step)
    if found is None:
        raise missing(job_id, step)
    return StoredCheckpoint(found.path, found.bytes, found.sha256)


@contextmanager
def reading(job_id: str, step: int) -> Iterator[None]:
    """The store's errors on reading a checkpoint as the API answers them: 404 for an object gone,
    502 for one changed since it was stored, 503 for a store out of reach."""
    with store_reachable():
        try:
            yield
        except ObjectNotFound:
            raise missing(job_id, step) from None
        except IntegrityError as exc:
            log.error("job %s: checkpoint %d: %s", job_id, step, exc)
            raise ArtifactChanged(
                f"the checkpoint of job {job_id} at step {step} in the service's storage is not the one recorded "
                "(its size or sha256 changed since it was written)"
            ) from None


def exported(
    settings: Settings, job_id: str, step: int, stored: StoredCheckpoint, convert: Callable[[Path, Path], T]
) -> T:
    """``convert(checkpoint file, exports dir)`` on the checkpoint, opened through this host's cache
    (with the local store, the store's own file) for as long as the conversion reads it."""
    cache = cache_from(settings, store_from(settings))
    with reading(job_id, step), cache.open(stored.key, stored.bytes, stored.sha256) as path:
        return convert(path, settings.artifact_dir / EXPORTS)
