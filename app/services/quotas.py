"""Per-tenant limits of the API: open event streams, request rate, the pace of refusals, threads.

``TenantLimits`` bounds a tenant's open event streams, its request rate and the pace of its
refusals. With Redis (full mode) each figure is shared by every API process on every host
(app.messaging.shared_limits: one atomic script per check), so N processes hold a tenant to the
same limits as one. Without Redis (embedded mode, one process), or while Redis does not answer,
each process counts on its own (``StreamSlots``, ``RequestRate``, ``RefusalPacer``): the
limits then hold per process, never lapse. A Redis that stops answering costs one request its
timeout, then is left alone for ``RETRY_SECONDS`` (a line in the log each way).

``TenantThreads`` bounds what one tenant can take of a process's thread pool: a share of one
process's resource, counted per process by nature.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from functools import partial
from typing import Any, TypeVar

import anyio
import redis.exceptions
from starlette.concurrency import run_in_threadpool

from app.errors import RateLimited
from app.messaging.shared_limits import SharedLimits
from app.settings import Settings

V = TypeVar("V")
log = logging.getLogger("muonforge.api")

TENANTS_KEPT = 100_000  # per-tenant tables of an API process hold at most this many tenants
RETRY_SECONDS = 5.0  # after Redis failed to answer, per-process limits for this long, then ask again
STREAM_LEASE_SECONDS = 30.0  # a stream's shared slot outlives its process by at most this


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

    def refusal(self) -> RateLimited:
        return RateLimited(f"this tenant already has {self.cap} open event streams; close one first", retry_after=5)

    @contextmanager
    def hold(self, tenant_id: str) -> Iterator[None]:
        """One of the tenant's slots while the block runs, or RateLimited if it holds all of them."""
        if self.open[tenant_id] >= self.cap:
            raise self.refusal()
        self.open[tenant_id] += 1
        try:
            yield
        finally:
            self.open[tenant_id] -= 1
            if not self.open[tenant_id]:
                del self.open[tenant_id]


class RequestRate:
    """A token bucket per tenant: ``rate`` requests a second on average, bursts of ``burst`` (used
    from the event loop only)."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate, self.burst = rate, burst
        self._buckets: dict[str, tuple[float, float]] = {}  # tenant -> (tokens, at)

    def take(self, tenant_id: str) -> None:
        """One request's token, or RateLimited with the seconds until the next one."""
        if self.rate <= 0:
            return
        now = time.monotonic()
        tokens, at = self._buckets.get(tenant_id, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - at) * self.rate)
        if tokens < 1.0:
            self._buckets[tenant_id] = (tokens, now)
            raise self.refusal((1.0 - tokens) / self.rate)
        self._buckets[tenant_id] = (tokens - 1.0, now)
        forget_oldest_half(self._buckets, at=lambda entry: entry[1])

    def refusal(self, wait: float) -> RateLimited:
        """The answer to a request ``wait`` seconds before the tenant's next token."""
        return RateLimited(
            f"this tenant is over {self.rate:g} requests a second; slow down", retry_after=max(1, math.ceil(wait))
        )


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

    def tell(self, tenant_id: str, retry_after: float) -> bool:
        """Record a refusal that says ``Retry-After: retry_after``; whether it comes before the time
        the tenant's previous refusal told it to wait for (this process's record)."""
        now = time.monotonic()
        told = self._told.get(tenant_id)
        self._told[tenant_id] = now + retry_after
        forget_oldest_half(self._told, at=lambda at: at)
        return told is not None and now < told

    async def pause(self, tenant_id: str, retry_after: float, early: bool) -> bool:
        """Before a refusal to ``tenant_id`` that says ``Retry-After: retry_after`` and came
        ``early`` (see ``tell``): wait as above.

        False when the refusal should close its connection (the tenant has ``cap`` refusals waiting
        already).
        """
        if self.seconds <= 0 or not early:
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


class TenantLimits:
    """A tenant's open streams, request rate and refusal pace: shared through Redis when there is
    one and it answers, else per process (the module's docstring)."""

    def __init__(self, settings: Settings, shared: SharedLimits | None = None) -> None:
        self.rate = RequestRate(settings.tenant_rate_per_second, settings.tenant_burst)
        self.streams = StreamSlots(settings.tenant_stream_cap)  # this process's streams (and its metric)
        self.pacer = RefusalPacer(settings.refusal_pace_seconds)
        self.shared = shared
        self._retry_at = 0.0  # monotonic: Redis is asked again from then on
        self._leases: dict[str, str] = {}  # shared slot -> its tenant, for the streams open here

    async def _ask(self, call: Callable[[SharedLimits], Awaitable[V]]) -> V | None:
        """Redis' answer, or None when the limit is to be counted in this process."""
        if self.shared is None or time.monotonic() < self._retry_at:
            return None
        try:
            answer = await call(self.shared)
        except (redis.exceptions.RedisError, OSError) as exc:
            if self._retry_at == 0.0:
                log.warning("Redis does not answer (%s): per-tenant limits are counted per API process", exc)
            self._retry_at = time.monotonic() + RETRY_SECONDS
            return None
        if self._retry_at:
            log.warning("Redis answers again: per-tenant limits are shared by the API processes again")
            self._retry_at = 0.0
        return answer

    async def take_request(self, tenant_id: str) -> None:
        """One request's token, or RateLimited with the seconds until the next one."""
        if self.rate.rate <= 0:
            return
        wait = await self._ask(lambda shared: shared.take_token(tenant_id, self.rate.rate, self.rate.burst))
        if wait is None:
            self.rate.take(tenant_id)
        elif wait > 0:
            raise self.rate.refusal(wait)

    @asynccontextmanager
    async def stream_slot(self, tenant_id: str) -> AsyncIterator[None]:
        """One of the tenant's stream slots while the block runs, or RateLimited if it holds all."""
        with self.streams.hold(tenant_id):  # this process's count: the limit while Redis is down
            slot = uuid.uuid4().hex
            took = await self._ask(
                lambda shared: shared.take_slot(tenant_id, slot, self.streams.cap, STREAM_LEASE_SECONDS)
            )
            if took is False:
                raise self.streams.refusal()
            if took:
                self._leases[slot] = tenant_id
            try:
                yield
            finally:
                if took:
                    del self._leases[slot]
                    with anyio.CancelScope(shield=True):  # a stream ends by its client leaving, often
                        await self._ask(lambda shared: shared.free_slot(tenant_id, slot))

    async def renew_leases(self) -> None:
        """Keep the shared slots of this process's open streams, every third of a lease, forever."""
        while True:
            await asyncio.sleep(STREAM_LEASE_SECONDS / 3)
            held = [(tenant_id, slot) for slot, tenant_id in self._leases.items()]
            await self._ask(partial(SharedLimits.renew, slots=held, lease=STREAM_LEASE_SECONDS))

    async def close(self) -> None:
        if self.shared is not None:
            await self.shared.close()

    async def pause_refusal(self, tenant_id: str, retry_after: float) -> bool:
        """Before a 429 to the tenant: its pause (``RefusalPacer``); False if the answer should
        close its connection."""
        if self.pacer.seconds <= 0:
            return True
        early = await self._ask(lambda shared: shared.tell(tenant_id, retry_after))
        if early is None:
            early = self.pacer.tell(tenant_id, retry_after)
        return await self.pacer.pause(tenant_id, retry_after, early)
