"""Webhook endpoints (create, list, get, delete, their delivery log) and the outbox's ``enqueue``.

A delivery is inserted in the transaction of the change it reports, so both commit or neither
does; app.services.webhook_delivery sends it (docs/service.md, "Webhooks", "The outbox"). Services
never commit.
"""

from __future__ import annotations

import base64
import secrets
from typing import Any

from sqlalchemy.orm import Session

from app.db.base import new_id, utcnow
from app.db.models import WebhookEndpoint
from app.errors import Conflict, NotFound, ValidationFailed
from app.repositories.tenants import TenantRepository
from app.repositories.webhooks import WebhookRepository
from app.schemas import api as schemas
from app.services.auth import TenantRef
from app.services.webhook_destinations import NotAllowed, Unresolved, resolve
from app.settings import Settings
from contract.webhooks import DeliveryStatus, WebhookEventType

SECRET_PREFIX = "whsec_"
SECRET_BYTES = 32  # Standard Webhooks asks for 24 to 64 random bytes


def new_secret() -> str:
    """``whsec_`` and the base64 of a random key, as Standard Webhooks libraries read it."""
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(SECRET_BYTES)).decode()


def create_endpoint(
    session: Session, tenant: TenantRef, url: str, events: list[WebhookEventType], settings: Settings
) -> WebhookEndpoint:
    """A new endpoint, with its secret (returned this once).

    Its URL must lead where the allow-list lets deliveries go, now (422 ``url``; checked again at
    every attempt, since DNS answers change); over the tenant's endpoint cap, 409.
    """
    try:  # before any query: a lookup may take seconds, and no connection is held meanwhile
        resolve(url, settings.webhook_allow_list, settings.webhook_require_https)
    except (NotAllowed, Unresolved) as exc:
        raise ValidationFailed(str(exc), param="url") from None
    TenantRepository(session).lock([tenant.id])  # the cap holds under concurrent creates
    repo = WebhookRepository(session)
    if repo.count(tenant.id) >= settings.webhook_tenant_cap:
        cap = settings.webhook_tenant_cap
        raise Conflict(f"a tenant may have {cap} webhook endpoints (MUONFORGE_WEBHOOK_TENANT_CAP): delete one first")
    wanted = [str(e) for e in dict.fromkeys(events)]
    return repo.add(WebhookEndpoint(tenant_id=tenant.id, url=url, events=wanted, secret=new_secret()))


def get_endpoint(session: Session, tenant: TenantRef, endpoint_id: str) -> WebhookEndpoint:
    endpoint = WebhookRepository(session).get(endpoint_id, tenant.id)
    if endpoint is None:
        raise NotFound(f"no webhook endpoint {endpoint_id!r}", param="webhook_id")
    return endpoint


def list_endpoints(session: Session, tenant: TenantRef, limit: int, after: str | None) -> schemas.WebhookList:
    rows = WebhookRepository(session).page(tenant.id, limit, after)
    page = rows[:limit]
    more = len(rows) > limit
    return schemas.WebhookList(
        data=[schemas.Webhook.model_validate(e) for e in page], has_more=more, next_after=page[-1].id if more else None
    )


def delete_endpoint(session: Session, tenant: TenantRef, endpoint_id: str) -> None:
    """The endpoint and its delivery log; a delivery in flight is not recorded."""
    WebhookRepository(session).delete(get_endpoint(session, tenant, endpoint_id))


def list_deliveries(
    session: Session, tenant: TenantRef, endpoint_id: str, limit: int, after: str | None
) -> schemas.WebhookDeliveryList:
    get_endpoint(session, tenant, endpoint_id)  # 404 for another tenant's
    repo = WebhookRepository(session)
    rows = repo.deliveries_page(endpoint_id, limit, after)
    page = rows[:limit]
    more = len(rows) > limit
    attempts = repo.attempts_of([d.id for d in page])
    return schemas.WebhookDeliveryList(
        data=[schemas.WebhookDelivery.of(d, attempts[d.id]) for d in page],
        has_more=more,
        next_after=page[-1].id if more else None,
    )


def enqueue(session: Session, tenant_id: str, event_type: WebhookEventType, data: dict[str, Any]) -> int:
    """A delivery of the event to each of the tenant's endpoints that takes it, due now, in the
    caller's transaction; returns how many."""
    repo = WebhookRepository(session)
    endpoints = [endpoint_id for endpoint_id, events in repo.subscriptions(tenant_id) if event_type in events]
    if not endpoints:
        return 0
    now = utcnow()
    body = schemas.WebhookMessage(type=event_type, timestamp=now, data=data).model_dump_json()
    rows = [
        {
            "id": new_id("msg"),
            "endpoint_id": e,
            "event_type": str(event_type),
            "body": body,
            "status": DeliveryStatus.PENDING,
            "attempts": 0,
            "next_attempt_at": now,
            "created_at": now,
        }
        for e in endpoints
    ]
    repo.add_deliveries(rows)
    return len(rows)
