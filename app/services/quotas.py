"""Per-tenant limits that each API process enforces on its own, with no round trip per request.

They bound a tenant's open event streams, its request rate, its threads of the thread pool and the
pace of its refusals. Being per process, they let a tenant hold up to P x the stream cap and make
up to P x the rate with P API processes. What they bound is what one tenant can take of a process
(its threads, its Redis connections, its event loop), which is the point: other tenants keep their
latency.
"""

from __future__ import annotations

import asyncio
import math
import random
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import anyio
from starlette.concurrency import run_in_threadpool

from app.errors import RateLimited

V = TypeVar("V")


TENANTS_KEPT = 100_000  # per-tenant tables of an API process hold at most this many tenants


def forget_oldest_half(table: dict[str, V], at: Callable[[V], float]) -> None:
    """Keep a per-tenant table bounded: past TENANTS_KEPT entries, forget the half whose ``at``
    (the entry's last use) is oldest."""
    if len(table) > TENANTS_KEPT:
        for key in sorted(table, key=lambda k: at(table[k]))[: len(table) // 2]:
            del table[key]


class StreamSlots:
    """Open event streams per tenant, at most ``cap`` each (used from the event loop only)."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.open: Counter[str] = Counter()

    @property
    def total(self) -> int:
        return sum(self.open.values())

    def check(self, tenant_id: str) -> None:
        """RateLimited if the tenant holds all its slots."""
        if self.open[tenant_id] >= self.cap:
            raise RateLimited(
                f"this tenant already has {self.cap} open event streams on this server; close one first",
                retry_after=5,
            )

    @contextmanager
    def hold(self, tenant_id: str) -> Iterator[None]:
        self.check(tenant_id)
        self.open[tenant_id] += 1
        try:
            yield
        finally:
            self.open[tenant_id] -= 1
            if not self.open[tenant_id]:
                del self.open[tenant_id]


class RequestRate:
    """A token bucket per tenant: ``rate`` requests a second on average, bursts of ``burst``."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate, self.burst = rate, burst
        self._buckets: dict[str, tuple[float, float]] = {}  # tenant -> (tokens, at)
        self._lock = threading.Lock()

    def take(self, tenant_id: str) -> None:
        """One request's token, or RateLimited with the seconds until the next one."""
        if self.rate <= 0:
            return
        now = time.monotonic()
        with self._lock:
            tokens, at = self._buckets.get(tenant_id, (float(self.burst), now))
            tokens = min(float(self.burst), tokens + (now - at) * self.rate)
            if tokens < 1.0:
                self._buckets[tenant_id] = (tokens, now)
                wait = math.ceil((1.0 - tokens) / self.rate)
                raise RateLimited(f"this tenant is over {self.rate:g} requests a second; slow down", retry_after=wait)
            self._buckets[tenant_id] = (tokens - 1.0, now)
            forget_oldest_half(self._buckets, at=lambda entry: entry[1])


PACED_PER_TENANT = 1000  # a tenant's refusals held back at once; past it, answered at once


class RefusalPacer:
    """The pace of a tenant's refusals (used from the event loop only).

    A tenant refused again before the time its previous refusal's Retry-After told it to wait for
    gets the answer after a pause of half to all of this refusal's Retry-After (spread, so that the
    paused requests do not come back together), at most ``seconds``. A client that retries the
    moment it is refused, as a flood does, is then paced by the server: each of its connections
    makes about one attempt per Retry-After instead of as many as the process can refuse, and
    refusing is no longer the process's main work while other tenants wait for it. A client that
    waits as told is never paused. At most ``cap`` of one tenant's refusals wait at a time (each
    holds a connection); past that, the answer comes at once and closes its connection, so a tenant
    cannot turn the pauses into a pile of them.
    """

    def __init__(self, seconds: float, cap: int = PACED_PER_TENANT) -> None:
        self.seconds, self.cap = seconds, cap
        self._told: dict[str, float] = {}  # tenant -> when its last refusal told it to come back (monotonic)
        self.waiting: Counter[str] = Counter()

    async def pause(self, tenant_id: str, retry_after: float) -> bool:
        """Before a refusal to ``tenant_id`` that says ``Retry-After: retry_after``: wait as above.

        False when the refusal should close its connection (the tenant has ``cap`` refusals waiting
        already).
        """
        now = time.monotonic()
        told = self._told.get(tenant_id)
        self._told[tenant_id] = now + retry_after
        forget_oldest_half(self._told, at=lambda at: at)
        if self.seconds <= 0 or told is None or now >= told:
            return True
        if self.waiting[tenant_id] >= self.cap:
            return False
        self.waiting[tenant_id] += 1
        try:
            await asyncio.sleep(min(retry_after, self.seconds) * random.uniform(0.5, 1.0))
        finally:
            self.waiting[tenant_id] -= 1
            if not self.waiting[tenant_id]:
                del self.waiting[tenant_id]
        return True


class TenantThreads:
    """At most ``cap`` of the thread pool's threads per tenant at a time (used from the event loop only).

    The pool (40 threads) is shared by every request of the process: without this, one tenant's
    burst (a hundred streams opening, each reading its first page) fills it, and another tenant's
    request waits behind the whole burst. With it, a tenant's work beyond ``cap`` waits for that
    tenant's own threads; other tenants' requests go straight to a free one.
    """

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._held: dict[str, tuple[anyio.Semaphore, int]] = {}  # tenant -> (its semaphore, users)

    def run(self, tenant_id: str | None, fn: Callable[..., V], *args: Any) -> Awaitable[V]:
        """``fn(*args)`` in the thread pool, within ``tenant_id``'s share (None: not counted)."""
        if tenant_id is None or self.cap <= 0:
            return run_in_threadpool(fn, *args)
        return self._run(tenant_id, fn, args)

    async def _run(self, tenant_id: str, fn: Callable[..., V], args: tuple) -> V:
        semaphore, users = self._held.get(tenant_id) or (anyio.Semaphore(self.cap), 0)
        self._held[tenant_id] = (semaphore, users + 1)
        try:
            async with semaphore:
                return await run_in_threadpool(fn, *args)
        finally:
            semaphore, users = self._held[tenant_id]
            if users == 1:
                del self._held[tenant_id]
            else:
                self._held[tenant_id] = (semaphore, users - 1)
