"""The per-tenant cap on queued plus running jobs, without a COUNT on every submission.

Counting a tenant's active jobs costs Postgres O(active jobs): nothing for a tenant with a
handful, milliseconds per submission for one running a sweep of thousands (rows written since
the last vacuum cost a heap visit each). Each API process therefore keeps, per tenant, an exact
count at most ``refresh_seconds`` old plus the jobs it admitted since, and admits without
counting while that estimate is below half the cap. Near the cap, and before every rejection, it
counts exactly, so a tenant is never refused on a stale figure. Jobs that other API processes
admitted within the refresh interval are not in the estimate: with P processes at most
max(1, P/2) x cap jobs can be active, never more than the cap with one or two processes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from app.services.quotas import forget_oldest_half


class Admission:
    def __init__(self, refresh_seconds: float = 1.0) -> None:
        self.refresh_seconds = refresh_seconds
        self._counts: dict[str, tuple[float, int]] = {}  # tenant -> (counted at, count + admitted since)
        self._lock = threading.Lock()

    def admit(self, tenant_id: str, cap: int, count_active: Callable[[], int]) -> bool:
        """Whether the tenant may queue one more job; ``count_active`` counts exactly."""
        now = time.monotonic()
        with self._lock:
            at, estimate = self._counts.get(tenant_id, (-float("inf"), cap))
            if now - at < self.refresh_seconds and 2 * (estimate + 1) <= cap:
                self._counts[tenant_id] = (at, estimate + 1)
                return True
        exact = count_active()
        with self._lock:
            if exact >= cap:
                self._counts[tenant_id] = (now, exact)
                return False
            self._counts[tenant_id] = (now, exact + 1)
            forget_oldest_half(self._counts, at=lambda entry: entry[0])
            return True
