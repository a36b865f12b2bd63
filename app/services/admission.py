"""The per-tenant job cap checked at the edge, mostly without a database round trip.

The cap holds exactly where jobs are inserted (app.services.intake: the tenants' rows locked,
their ``active_jobs`` read). This earlier check only refuses early: most submissions over the
cap are answered in the request's own thread instead of taking a place in the JobWriter's
batch. The exact figure is one row read by primary key: cheap, but a round trip, where a
submission with a cached key, no Idempotency-Key and no dataset makes none at all. Each API
process therefore keeps, per tenant, an exact figure at most ``refresh_seconds`` old plus the
jobs it admitted since, and admits without reading while that estimate is below half the cap.
Near the cap, and before every refusal, it reads the exact figure, so a tenant is never
refused on a stale one. Jobs that other API processes admitted since are not in the estimate:
the insert's check refuses those that would pass the cap.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from app.services.quotas import forget_oldest_half


class Admission:
    def __init__(self, refresh_seconds: float = 1.0) -> None:
        self.refresh_seconds = refresh_seconds
        self._counts: dict[str, tuple[float, int]] = {}  # tenant -> (read at, figure + admitted since)
        self._lock = threading.Lock()

    def admit(self, tenant_id: str, cap: int, active_jobs: Callable[[], int]) -> bool:
        """Whether the tenant may queue one more job; ``active_jobs`` reads the exact figure."""
        now = time.monotonic()
        with self._lock:
            at, estimate = self._counts.get(tenant_id, (-float("inf"), cap))
            if now - at < self.refresh_seconds and 2 * (estimate + 1) <= cap:
                self._counts[tenant_id] = (at, estimate + 1)
                return True
        exact = active_jobs()
        with self._lock:
            if exact >= cap:
                self._counts[tenant_id] = (now, exact)
                return False
            self._counts[tenant_id] = (now, exact + 1)
            forget_oldest_half(self._counts, at=lambda entry: entry[0])
            return True
