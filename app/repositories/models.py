"""SQL about uploaded models (and the jobs that start from one)."""

from __future__ import annotations

from collections.abc import Collection

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from app.db.models import Job, UploadedModel
from contract.status import FINISHED


class ModelRepository:
    def __init__(self, session: Session) -> None:
        self.session = session

    def add(self, model: UploadedModel) -> UploadedModel:
        self.session.add(model)
        self.session.flush()
        return model

    def get(self, model_id: str, tenant_id: str) -> UploadedModel | None:
        query = select(UploadedModel).where(UploadedModel.id == model_id, UploadedModel.tenant_id == tenant_id)
        return self.session.scalars(query).one_or_none()

    def existing_ids(self, model_ids: Collection[str]) -> set[str]:
        """Those of ``model_ids`` that name a stored model."""
        if not model_ids:
            return set()
        return set(self.session.scalars(select(UploadedModel.id).where(UploadedModel.id.in_(list(model_ids)))))

    def delete(self, model: UploadedModel) -> None:
        self.session.execute(delete(UploadedModel).where(UploadedModel.id == model.id))

    def page(self, tenant_id: str, limit: int, after: str | None) -> list[UploadedModel]:
        query = select(UploadedModel).where(UploadedModel.tenant_id == tenant_id)
        if after:
            query = query.where(UploadedModel.id < after)
        return list(self.session.scalars(query.order_by(UploadedModel.id.desc()).limit(limit + 1)))

    def unfinished_jobs_using(self, tenant_id: str, model_id: str) -> list[tuple[str, str]]:
        """The tenant's unfinished jobs (queued, running, or a trial paused at a rung) whose spec
        starts from the model (``model.hf.model_id``), oldest first, as (id, status)."""
        named = Job.spec[("model", "hf", "model_id")].as_string()  # one JSON path: Postgres and SQLite alike
        query = (
            select(Job.id, Job.status)
            .where(Job.tenant_id == tenant_id, Job.status.not_in(FINISHED), named == model_id)
            .order_by(Job.id)
        )
        return [(job_id, str(status)) for job_id, status in self.session.execute(query).all()]
