"""All SQL about webhooks: endpoints, their deliveries (the outbox) and each delivery's attempts.

A delivery is claimed for one attempt by moving its ``next_attempt_at`` past the attempt's lease
and counting the attempt (the fencing token of its outcome), in a short transaction of its own:
no row lock or connection is held while the request is in flight. Claimers skip the rows another
holds (``FOR UPDATE SKIP LOCKED`` on Postgres; SQLite's single writer serializes them instead),
and a claim whose process died is taken again once its lease has passed: at least once."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy import delete, func, insert, select, update
from sqlalchemy.orm import Session

from app.db.models import WebhookAttempt, WebhookDelivery, WebhookEndpoint
from app.repositories.statements import changed_rows
from contract.webhooks import DeliveryStatus


class Claimed(NamedTuple):
    """A delivery claimed for one attempt, with what sending it needs."""

    id: str
    attempt: int  # this attempt's number: its outcome is recorded only while it is the latest
    body: str
    created_at: datetime
    url: str
    secret: str


class WebhookRepository:
    def __init__(self, session: Session) -> None:
        self.session = session

    # -- endpoints --------------------------------------------------------------------------------
    def add(self, endpoint: WebhookEndpoint) -> WebhookEndpoint:
        self.session.add(endpoint)
        self.session.flush()
        return endpoint

    def get(self, endpoint_id: str, tenant_id: str) -> WebhookEndpoint | None:
        query = select(WebhookEndpoint).where(WebhookEndpoint.id == endpoint_id, WebhookEndpoint.tenant_id == tenant_id)
        return self.session.scalars(query).one_or_none()

    def page(self, tenant_id: str, limit: int, after: str | None) -> list[WebhookEndpoint]:
        """Newest first; ``limit + 1`` rows so the caller can tell whether there is more."""
        query = select(WebhookEndpoint).where(WebhookEndpoint.tenant_id == tenant_id)
        if after:
            query = query.where(WebhookEndpoint.id < after)
        return list(self.session.scalars(query.order_by(WebhookEndpoint.id.desc()).limit(limit + 1)))

    def count(self, tenant_id: str) -> int:
        return self.session.scalar(select(func.count()).where(WebhookEndpoint.tenant_id == tenant_id)) or 0

    def subscriptions(self, tenant_id: str) -> list[tuple[str, list[str]]]:
        """(id, event types) of every endpoint of the tenant."""
        query = select(WebhookEndpoint.id, WebhookEndpoint.events).where(WebhookEndpoint.tenant_id == tenant_id)
        return [(row[0], row[1]) for row in self.session.execute(query)]

    def delete(self, endpoint: WebhookEndpoint) -> None:
        """The endpoint, its deliveries and their attempts (the foreign keys cascade)."""
        self.session.execute(delete(WebhookEndpoint).where(WebhookEndpoint.id == endpoint.id))

    # -- deliveries -------------------------------------------------------------------------------
    def add_deliveries(self, rows: list[dict[str, Any]]) -> None:
        """INSERT deliveries (rows with the same keys) in one statement."""
        if rows:
            self.session.execute(insert(WebhookDelivery.__table__), rows)

    def prune_finished(self, before: datetime, limit: int) -> int:
        """Delete up to ``limit`` deliveries that ended (delivered or failed) before ``before``,
        with their attempts (the foreign key cascades); returns how many."""
        oldest = select(WebhookDelivery.id).where(WebhookDelivery.finished_at < before).limit(limit)
        return changed_rows(self.session, delete(WebhookDelivery).where(WebhookDelivery.id.in_(oldest)))

    def deliveries_page(self, endpoint_id: str, limit: int, after: str | None) -> list[WebhookDelivery]:
        """Newest first; ``limit + 1`` rows so the caller can tell whether there is more."""
        query = select(WebhookDelivery).where(WebhookDelivery.endpoint_id == endpoint_id)
        if after:
            query = query.where(WebhookDelivery.id < after)
        return list(self.session.scalars(query.order_by(WebhookDelivery.id.desc()).limit(limit + 1)))

    def attempts_of(self, delivery_ids: Sequence[str]) -> dict[str, list[WebhookAttempt]]:
        """The attempts of each delivery, oldest first (one query for a page of deliveries)."""
        found: dict[str, list[WebhookAttempt]] = {d: [] for d in delivery_ids}
        if delivery_ids:
            query = select(WebhookAttempt).where(WebhookAttempt.delivery_id.in_(delivery_ids))
            for attempt in self.session.scalars(query.order_by(WebhookAttempt.delivery_id, WebhookAttempt.number)):
                found[attempt.delivery_id].append(attempt)
        return found

    def claim_due(self, now: datetime, lease_until: datetime, limit: int) -> list[Claimed]:
        """Up to ``limit`` deliveries due by ``now`` (the longest waiting first), each claimed for
        one attempt until ``lease_until``."""
        due = (
            select(
                WebhookDelivery.id,
                WebhookDelivery.body,
                WebhookDelivery.created_at,
                WebhookEndpoint.url,
                WebhookEndpoint.secret,
            )
            .join(WebhookEndpoint, WebhookEndpoint.id == WebhookDelivery.endpoint_id)
            .where(WebhookDelivery.next_attempt_at <= now)
            .order_by(WebhookDelivery.next_attempt_at)
            .limit(limit)
            .with_for_update(skip_locked=True, of=WebhookDelivery)
        )
        rows = {row.id: row for row in self.session.execute(due)}
        if not rows:
            return []
        # Due again: on SQLite (no row locks) another process may have claimed one since the select.
        claimed = self.session.execute(
            update(WebhookDelivery)
            .where(WebhookDelivery.id.in_(list(rows)), WebhookDelivery.next_attempt_at <= now)
            .values(attempts=WebhookDelivery.attempts + 1, next_attempt_at=lease_until)
            .returning(WebhookDelivery.id, WebhookDelivery.attempts)
        )
        return [Claimed(delivery_id, attempt, *rows[delivery_id][1:]) for delivery_id, attempt in claimed]

    def record_attempt(
        self,
        delivery_id: str,
        attempt: int,
        at: datetime,
        duration_ms: int,
        status_code: int | None,
        error: str | None,
        **values: Any,
    ) -> bool:
        """Log attempt number ``attempt`` and set the delivery's ``values`` (status, next try,
        ...), if that attempt is still the latest of a pending delivery (False otherwise: the
        endpoint was deleted, or the lease passed and another attempt took over)."""
        stmt = update(WebhookDelivery).where(
            WebhookDelivery.id == delivery_id,
            WebhookDelivery.attempts == attempt,
            WebhookDelivery.status == DeliveryStatus.PENDING,
        )
        if changed_rows(self.session, stmt.values(last_error=error, **values)) != 1:
            return False
        row = {
            "delivery_id": delivery_id,
            "number": attempt,
            "at": at,
            "duration_ms": duration_ms,
            "status_code": status_code,
            "error": error,
        }
        self.session.execute(insert(WebhookAttempt.__table__), row)
        return True
