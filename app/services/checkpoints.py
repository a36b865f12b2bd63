"""Checkpoints of a job, tenant-scoped."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy.orm import Session

from app.errors import NotFound
from app.repositories.checkpoints import CheckpointRepository
from app.schemas import api as schemas
from app.services.auth import TenantRef
from app.services.jobs import get_job
from app.settings import Settings


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


def checkpoint_file(session: Session, tenant: TenantRef, job_id: str, step: int, settings: Settings) -> Path:
    get_job(session, tenant, job_id)  # 404 for another tenant's job
    found = CheckpointRepository(session).checkpoint(job_id, step)
    path = settings.artifact_dir / found.path if found else None
    if path is None or not path.is_file():
        raise NotFound(f"job {job_id} has no checkpoint at step {step}", param="step")
    return path
