"""Checkpoints of a job, tenant-scoped."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy.orm import Session

from app.db.models import Checkpoint
from app.errors import NotFound
from app.repositories.jobs import JobRepository
from app.services.auth import TenantRef
from app.services.jobs import get_job
from app.settings import Settings


def list_checkpoints(session: Session, tenant: TenantRef, job_id: str) -> list[Checkpoint]:
    get_job(session, tenant, job_id)  # 404 for another tenant's job
    return JobRepository(session).checkpoints(job_id)


def checkpoint_file(session: Session, tenant: TenantRef, job_id: str, step: int, settings: Settings) -> Path:
    found = next((c for c in list_checkpoints(session, tenant, job_id) if c.step == step), None)
    path = settings.artifact_dir / found.path if found else None
    if path is None or not path.is_file():
        raise NotFound(f"job {job_id} has no checkpoint at step {step}", param="step")
    return path
