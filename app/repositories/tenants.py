"""SQL about tenants, their API keys and their datasets."""

from __future__ import annotations

from collections.abc import Collection
from datetime import datetime
from typing import NamedTuple

from sqlalchemy import BigInteger, cast, delete, func, or_, select, update
from sqlalchemy.orm import Session

from app.db.models import ApiKey, Dataset, Tenant, UploadedModel


class TenantFigures(NamedTuple):
    """A tenant with what it holds: queued plus running jobs, bytes of datasets, unrevoked keys."""

    id: str
    name: str
    job_cap: int | None
    active_jobs: int
    stored_bytes: int  # datasets and models together
    active_keys: int


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

    def lock(self, tenant_ids: list[str]) -> dict[str, int]:
        """Lock the tenants' rows until the transaction ends (in id order: no deadlock between two
        lockers); returns their active jobs, exact until then. SQLite has no row locks; its one
        writer at a time serializes instead.

        A job's status change locks the job's row, then (by trigger) its tenant's: a holder of
        tenant locks may insert jobs, but changing an existing job's status would close a cycle."""
        query = select(Tenant.id, Tenant.active_jobs).where(Tenant.id.in_(tenant_ids)).order_by(Tenant.id)
        return dict(self.session.execute(query.with_for_update()).all())

    def active_jobs(self, tenant_id: str) -> int:
        """The tenant's queued plus running jobs as last committed (no lock)."""
        return self.session.scalar(select(Tenant.active_jobs).where(Tenant.id == tenant_id)) or 0

    def add_key(self, tenant: Tenant, key_hash: str, prefix: str, name: str | None = None) -> ApiKey:
        key = ApiKey(tenant_id=tenant.id, key_hash=key_hash, prefix=prefix, name=name)
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

    def mark_key_used(self, key_id: str, now: datetime, unless_since: datetime) -> None:
        """Set the key's last_used_at to ``now``, unless it is ``unless_since`` or later (another
        process has just done it)."""
        fresh = or_(ApiKey.last_used_at.is_(None), ApiKey.last_used_at < unless_since)
        self.session.execute(update(ApiKey).where(ApiKey.id == key_id, fresh).values(last_used_at=now))

    def keys(self, tenant_id: str | None = None) -> list[tuple[ApiKey, str]]:
        """Keys (revoked ones too) with their tenant's name: by tenant name, then oldest first."""
        query = select(ApiKey, Tenant.name).join(Tenant, ApiKey.tenant_id == Tenant.id)
        if tenant_id is not None:
            query = query.where(ApiKey.tenant_id == tenant_id)
        return [(key, name) for key, name in self.session.execute(query.order_by(Tenant.name, ApiKey.id))]

    def keys_matching(self, id_prefix_or_hash: str) -> list[tuple[ApiKey, str]]:
        """The keys whose id, prefix or hash is the given value, with their tenant's name."""
        value = id_prefix_or_hash
        match = or_(ApiKey.id == value, ApiKey.prefix == value, ApiKey.key_hash == value)
        query = select(ApiKey, Tenant.name).join(Tenant, ApiKey.tenant_id == Tenant.id).where(match)
        return [(key, name) for key, name in self.session.execute(query.order_by(ApiKey.id))]

    def revoke_key(self, key: ApiKey, now: datetime) -> None:
        key.revoked_at = now
        self.session.flush()

    def figures(self, tenant_id: str | None = None) -> list[TenantFigures]:
        """Every tenant (or the one) with its figures, by name: one query, the active jobs from
        the tenant's row, the others counted per tenant in a grouped subquery."""

        def per_tenant(model: type[Dataset | UploadedModel | ApiKey], value, *where):
            only = (model.tenant_id == tenant_id,) if tenant_id is not None else ()
            query = select(model.tenant_id, value.label("n")).where(*where, *only)
            return query.group_by(model.tenant_id).subquery()

        datasets = per_tenant(Dataset, cast(func.sum(Dataset.bytes), BigInteger))  # not numeric
        models = per_tenant(UploadedModel, cast(func.sum(UploadedModel.bytes), BigInteger))
        keys = per_tenant(ApiKey, func.count(), ApiKey.revoked_at.is_(None))
        stored = func.coalesce(datasets.c.n, 0) + func.coalesce(models.c.n, 0)
        query = (
            select(Tenant.id, Tenant.name, Tenant.job_cap, Tenant.active_jobs, stored, func.coalesce(keys.c.n, 0))
            .outerjoin(datasets, datasets.c.tenant_id == Tenant.id)
            .outerjoin(models, models.c.tenant_id == Tenant.id)
            .outerjoin(keys, keys.c.tenant_id == Tenant.id)
            .order_by(Tenant.name)
        )
        if tenant_id is not None:
            query = query.where(Tenant.id == tenant_id)
        return [TenantFigures(*row) for row in self.session.execute(query)]

    def stored_bytes(self, tenant_id: str) -> int:
        """The bytes of the tenant's stored datasets and models together (what its storage quota bounds)."""
        total = 0
        for model in (Dataset, UploadedModel):
            query = select(func.coalesce(func.sum(model.bytes), 0)).where(model.tenant_id == tenant_id)
            total += self.session.execute(query).scalar_one()
        return total

    def set_job_cap(self, tenant_id: str, job_cap: int | None) -> None:
        self.session.execute(update(Tenant).where(Tenant.id == tenant_id).values(job_cap=job_cap))


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

    def existing_ids(self, dataset_ids: Collection[str]) -> set[str]:
        """Those of ``dataset_ids`` that name a stored dataset."""
        if not dataset_ids:
            return set()
        return set(self.session.scalars(select(Dataset.id).where(Dataset.id.in_(list(dataset_ids)))))

    def delete(self, dataset: Dataset) -> None:
        self.session.execute(delete(Dataset).where(Dataset.id == dataset.id))

    def holds_sha256(self, sha256: str) -> bool:
        """Whether any tenant's dataset has these bytes."""
        return self.session.scalars(select(Dataset.id).where(Dataset.sha256 == sha256).limit(1)).first() is not None

    def page(self, tenant_id: str, limit: int, after: str | None) -> list[Dataset]:
        query = select(Dataset).where(Dataset.tenant_id == tenant_id)
        if after:
            query = query.where(Dataset.id < after)
        return list(self.session.scalars(query.order_by(Dataset.id.desc()).limit(limit + 1)))
