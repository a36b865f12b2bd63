"""SQL about uploaded models."""

from __future__ import annotations

from collections.abc import Collection

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from app.db.models import UploadedModel


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
