"""All SQL about checkpoints.

The files a job's attempts wrote, by step, and the steps that other jobs start from (a warm
start's ``init_from``), which the job's retention keeps.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from sqlalchemy import delete, select, tuple_
from sqlalchemy.orm import Session

from app.db.models import Checkpoint, Job


class CheckpointRepository:
    def __init__(self, session: Session) -> None:
        self.session = session

    def add_checkpoint(
        self, job_id: str, attempt: int, step: int, path: str, nbytes: int, sha256: str, metrics: dict[str, float]
    ) -> None:
        existing = self.checkpoint(job_id, step)
        if existing is None:
            row = Checkpoint(job_id=job_id, attempt=attempt, step=step, path=path, bytes=nbytes, sha256=sha256)
            row.metrics = metrics
            self.session.add(row)
        else:  # a resumed attempt rewrote the same step: the object is at the same key
            existing.attempt, existing.bytes, existing.sha256, existing.metrics = attempt, nbytes, sha256, metrics

    def delete_checkpoints(self, job_id: str, steps: Sequence[int]) -> None:
        self.session.execute(delete(Checkpoint).where(Checkpoint.job_id == job_id, Checkpoint.step.in_(steps)))

    def checkpoint(self, job_id: str, step: int) -> Checkpoint | None:
        query = select(Checkpoint).where(Checkpoint.job_id == job_id, Checkpoint.step == step)
        return self.session.scalars(query).one_or_none()

    def checkpoints_page(self, job_id: str, limit: int, before_step: int | None) -> list[Checkpoint]:
        """Up to ``limit`` checkpoints, newest first, below ``before_step`` when given."""
        query = select(Checkpoint).where(Checkpoint.job_id == job_id)
        if before_step is not None:
            query = query.where(Checkpoint.step < before_step)
        return list(self.session.scalars(query.order_by(Checkpoint.step.desc()).limit(limit)))

    def checkpoints(self, job_id: str) -> list[Checkpoint]:
        query = select(Checkpoint).where(Checkpoint.job_id == job_id).order_by(Checkpoint.step.desc())
        return list(self.session.scalars(query))

    def warm_start_steps(self, job_id: str) -> set[int]:
        """The steps of the job's checkpoints that other jobs start from (their ``init_from``)."""
        return set(self.session.scalars(select(Job.parent_step).where(Job.parent_job_id == job_id)))

    def existing_checkpoints(self, keys: Collection[tuple[str, int]]) -> set[tuple[str, int]]:
        """Which of these (job, step) checkpoints exist."""
        if not keys:
            return set()
        query = select(Checkpoint.job_id, Checkpoint.step).where(
            tuple_(Checkpoint.job_id, Checkpoint.step).in_(list(keys))
        )
        return {(job_id, step) for job_id, step in self.session.execute(query)}
