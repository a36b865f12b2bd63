"""Tenants, keys, jobs and their stored events, the way the service tests reach them."""

from __future__ import annotations

import secrets
from typing import Any

from app.db.session import transaction
from app.repositories.job_events import JobEventRepository
from app.services.auth import create_api_key
from app.settings import Settings


def new_key(settings: Settings, tenant: str | None = None) -> str:
    """An API key of ``tenant`` (created if new; a fresh tenant if None)."""
    with transaction(settings) as session:
        return create_api_key(session, tenant or f"tenant-{secrets.token_hex(4)}")


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def key_of(auth: dict[str, str]) -> str:
    """The API key in Authorization headers."""
    return auth["Authorization"].split()[1]


def job(client: Any, auth: dict[str, str], job_id: str) -> dict:
    """GET /v1/jobs/{id} as the tenant of ``auth``."""
    return client.get(f"/v1/jobs/{job_id}", headers=auth).json()


def events(settings: Settings, job_id: str) -> list[tuple[str, dict]]:
    """The job's stored events, oldest first, as (kind, payload)."""
    with transaction(settings) as session:
        return [(e.kind, e.payload) for e in JobEventRepository(session).events(job_id)]
