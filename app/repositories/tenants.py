"""SQL about tenants, their API keys and their datasets."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.db.models import ApiKey, Dataset, Tenant


class TenantRepository:
    def __init__(self, session: Session) -> None:
        self.session = session

    def by_name(self, name: str) -> Tenant | None:
        return self.session.scalars(select(Tenant).where(Tenant.name == name)).one_or_none()

    def get_or_create(self, name: str) -> Tenant:
        tenant = self.by_name(name)
        if tenant is None:
            tenant = Tenant(name=name)
            self.session.add(tenant)
            self.session.flush()
        return tenant

    def lock(self, tenant_ids: list[str]) -> None:
        """Lock the tenants' rows until the transaction ends (in id order: no deadlock between two
        lockers). SQLite has no row locks; its one writer at a time serializes instead."""
        query = select(Tenant.id).where(Tenant.id.in_(tenant_ids)).order_by(Tenant.id).with_for_update()
        self.session.execute(query).all()

    def add_key(self, tenant: Tenant, key_hash: str, prefix: str) -> ApiKey:
        key = ApiKey(tenant_id=tenant.id, key_hash=key_hash, prefix=prefix)
        self.session.add(key)
        self.session.flush()
        return key

    def tenant_for_key_hash(self, key_hash: str) -> tuple[Tenant, ApiKey] | None:
        query = (
            select(Tenant, ApiKey)
            .join(ApiKey, ApiKey.tenant_id == Tenant.id)
            .where(ApiKey.key_hash == key_hash, ApiKey.revoked_at.is_(None))
        )
        row = self.session.execute(query).one_or_none()
        return (row[0], row[1]) if row else None


class DatasetRepository:
    def __init__(self, session: Session) -> None:
        self.session = session

    def add(self, dataset: Dataset) -> Dataset:
        self.session.add(dataset)
        self.session.flush()
        return dataset

    def get(self, dataset_id: str, tenant_id: str) -> Dataset | None:
        query = select(Dataset).where(Dataset.id == dataset_id, Dataset.tenant_id == tenant_id)
        return self.session.scalars(query).one_or_none()

    def get_any(self, dataset_id: str) -> Dataset | None:
        return self.session.get(Dataset, dataset_id)

    def page(self, tenant_id: str, limit: int, after: str | None) -> list[Dataset]:
        query = select(Dataset).where(Dataset.tenant_id == tenant_id)
        if after:
            query = query.where(Dataset.id < after)
        return list(self.session.scalars(query.order_by(Dataset.id.desc()).limit(limit + 1)))
