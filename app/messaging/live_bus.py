"""The live bus: telemetry and job events on their way to the events stream, ahead of the database.

With Redis (full mode), each job has one Redis Stream: the worker's sink appends every telemetry
step as it happens (XADD, trimmed to about ``live_stream_maxlen`` entries), and whoever commits a
job event (app.services.job_journal) appends it once committed. The events stream reads it with
XREAD BLOCK. The database stays the record: the stream only brings events sooner, and the
events stream falls back to the database for anything the stream no longer holds.

Without Redis (embedded mode) there is no bus: publishing does nothing and the events stream
polls the database.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import deque
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, cast

import redis
import redis.asyncio
from redis.typing import EncodableT, FieldT

from app.settings import Settings
from contract.status import is_finished

log = logging.getLogger("muonforge.live")
STREAM_TTL_SECONDS = 24 * 3600  # a job's stream outlives its last event by a day
READ_COUNT = 1000  # entries per XREAD
FEED_BLOCK_MS = 5000  # a feed with no subscriber left stops within this
# Every Redis call but a feed's blocking read answers within this, or fails: Redis stopped or
# paused (SIGSTOP, a full disk) must never block a request, a stream or a worker's sink for long.
REDIS_TIMEOUT = 2.0
MAX_CONNECTIONS = 1000  # Redis connections an API process may open (one per followed job, plus a few)


# A stream's entries as this module's clients read them (RESP2, replies left undecoded): (id,
# {field: value}) in bytes. redis-py annotates its replies with every protocol's and decoding's
# shapes at once, so the readers below cast them to this one.
RawEntries = list[tuple[bytes, dict[bytes, bytes]]]


def stream_key(job_id: str) -> str:
    return f"muonforge:events:{job_id}"


def stream_id_key(entry_id: str) -> tuple[int, int]:
    """Redis Stream ids ("ms-seq") in their order."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


class RedisBus:
    """Publishes to the per-job Redis Streams (from worker and API threads)."""

    live = True

    def __init__(self, url: str, maxlen: int) -> None:
        self.url, self.maxlen = url, maxlen
        self._client = redis.Redis.from_url(url, socket_timeout=REDIS_TIMEOUT, socket_connect_timeout=REDIS_TIMEOUT)

    def publish_metrics(self, job_id: str, steps: Sequence[tuple[int, str]]) -> list[str]:
        """Append telemetry steps, (step, JSON of its values), in one round trip; their stream ids.

        All or none (MULTI/EXEC): a Redis that refuses some of them (loading its append-only file
        after a restart, or a connection cut midway) never keeps later steps without the earlier
        ones, which a reader tailing the stream would skip."""
        key = stream_key(job_id)
        pipe = self._client.pipeline(transaction=True)
        for step, data in steps:
            pipe.xadd(key, {"kind": "metrics", "step": step, "data": data}, maxlen=self.maxlen, approximate=True)
        pipe.expire(key, STREAM_TTL_SECONDS)
        return [entry_id.decode() for entry_id in pipe.execute()[:-1]]

    def publish_events(self, events: Sequence[dict[str, Any]]) -> None:
        """Append committed job events ({job_id, seq, step, kind, payload}) in one round trip."""
        pipe = self._client.pipeline(transaction=False)
        for e in events:
            fields: dict[FieldT, EncodableT] = {
                "kind": e["kind"],
                "seq": e["seq"],
                "step": -1 if e["step"] is None else e["step"],
            }
            key = stream_key(e["job_id"])
            pipe.xadd(key, fields | {"data": json.dumps(e["payload"])}, maxlen=self.maxlen, approximate=True)
            pipe.expire(key, STREAM_TTL_SECONDS)
        pipe.execute()


class NoBus:
    """The embedded mode's bus: nothing to publish to; readers poll the database."""

    live = False

    def publish_metrics(self, job_id: str, steps: Sequence[tuple[int, str]]) -> list[None]:
        return [None] * len(steps)

    def publish_events(self, events: Sequence[dict[str, Any]]) -> None:
        pass


LiveBus = RedisBus | NoBus


@lru_cache(maxsize=8)
def _bus(url: str | None, maxlen: int) -> LiveBus:
    return RedisBus(url, maxlen) if url else NoBus()


def live_bus(settings: Settings) -> LiveBus:
    """The process's bus for these settings: Redis Streams in full mode, none in embedded mode."""
    return _bus(settings.redis_url, settings.live_stream_maxlen)


@dataclass
class Entry:
    """A stream entry: ``data`` is its JSON text, passed on to clients as it is."""

    id: str
    kind: str  # metrics | status | checkpoint | log | sample
    step: int
    seq: int | None
    data: str

    @property
    def final_status(self) -> bool:
        return self.kind == "status" and is_finished(json.loads(self.data).get("status"))


def decode_entry(entry_id: bytes, fields: dict[bytes, bytes]) -> Entry:
    seq = fields.get(b"seq")
    return Entry(
        entry_id.decode(),
        fields[b"kind"].decode(),
        int(fields[b"step"]),
        int(seq) if seq else None,
        fields[b"data"].decode(),
    )


class Resync(Exception):
    """The subscription lost entries (too slow, or the stream dropped them unread): read the
    database, then subscribe again."""


class Subscription:
    """The entries of one job's stream after a position, in order, for one reader."""

    def __init__(self, after: str, limit: int) -> None:
        self.last = stream_id_key(after)
        self.limit = limit
        self.backlog: deque[Entry] = deque()  # the catch-up: before anything in the queue
        self.queue: asyncio.Queue[Entry | None] = asyncio.Queue()
        self.broken = False

    def offer(self, entry: Entry | None) -> None:
        """From the feed: an entry, or None when entries were lost."""
        if self.broken:
            return
        if entry is None or self.queue.qsize() >= self.limit:
            self.broken = True
            self.queue.put_nowait(None)
        else:
            self.queue.put_nowait(entry)

    async def get(self) -> Entry:
        while True:
            entry = self.backlog.popleft() if self.backlog else await self.queue.get()
            if entry is None:
                raise Resync()
            key = stream_id_key(entry.id)
            if key > self.last:  # the catch-up and the live feed may overlap
                self.last = key
                return entry


class JobFeed:
    """One XREAD BLOCK loop per followed job and API process, shared by all its subscribers."""

    def __init__(self, reader: LiveReader, job_id: str, position: str) -> None:
        self.reader, self.job_id, self.position = reader, job_id, position
        self.subscribers: set[Subscription] = set()
        self.task = asyncio.create_task(self._run(), name=f"feed-{job_id}")

    async def _run(self) -> None:
        try:
            while self.subscribers:
                entries = await self.reader.read(self.job_id, self.position, FEED_BLOCK_MS, READ_COUNT)
                for entry in entries:
                    for sub in list(self.subscribers):
                        sub.offer(entry)
                if entries:
                    self.position = entries[-1].id
                if len(entries) == READ_COUNT and not await self.reader.holds(self.job_id, self.position):
                    for sub in list(self.subscribers):  # behind, and the stream trimmed what was next
                        sub.offer(None)
        except Exception:
            log.exception("live feed of job %s failed", self.job_id)
            for sub in list(self.subscribers):
                sub.offer(None)
        finally:
            if self.reader.feeds.get(self.job_id) is self:
                del self.reader.feeds[self.job_id]


class LiveReader:
    """Reads the per-job Redis Streams for an API process's events streams: one feed (one Redis
    connection) per followed job, however many clients follow it."""

    def __init__(self, url: str) -> None:
        self._client = redis.asyncio.Redis.from_url(
            url,
            max_connections=MAX_CONNECTIONS,
            socket_timeout=FEED_BLOCK_MS / 1000 + REDIS_TIMEOUT,  # a blocking read waits up to FEED_BLOCK_MS
            socket_connect_timeout=REDIS_TIMEOUT,
        )
        self.feeds: dict[str, JobFeed] = {}

    async def read(self, job_id: str, after: str, block_ms: int, count: int = READ_COUNT) -> list[Entry]:
        """Entries after ``after`` ("0-0": from the start), waiting up to ``block_ms`` for one."""
        answer = await self._client.xread({stream_key(job_id): after}, count=count, block=block_ms)
        reply = cast(list[tuple[bytes, RawEntries]], answer)  # [(the stream's key, its entries)]
        return [decode_entry(entry_id, fields) for entry_id, fields in reply[0][1]] if reply else []

    async def ping(self) -> bool:
        return bool(await self._client.ping())

    async def holds(self, job_id: str, entry_id: str) -> bool:
        """Whether nothing after ``entry_id`` has been trimmed from the stream (its first entry is
        not after it): reading after it then misses nothing."""
        first = cast(RawEntries, await self._client.xrange(stream_key(job_id), "-", "+", count=1))
        return bool(first) and stream_id_key(first[0][0].decode()) <= stream_id_key(entry_id)

    @asynccontextmanager
    async def subscribe(self, job_id: str, after: str, limit: int = 10_000) -> AsyncIterator[Subscription]:
        """Every entry of the job's stream after ``after``.

        What the job's feed has read past it is caught up with one XRANGE, the rest comes from the
        feed. More than ``limit`` entries waiting (a slow reader) breaks the subscription (Resync).
        """
        sub = Subscription(after, limit)
        feed = self.feeds.get(job_id)
        if feed is None:
            feed = self.feeds[job_id] = JobFeed(self, job_id, after)
            feed.subscribers.add(sub)
        else:
            feed.subscribers.add(sub)  # no await since reading feed.position: nothing slips between
            if stream_id_key(feed.position) > stream_id_key(after):  # what the feed has read past ``after``
                reply = cast(RawEntries, await self._client.xrange(stream_key(job_id), f"({after}", feed.position))
                sub.backlog.extend(decode_entry(entry_id, fields) for entry_id, fields in reply)
        try:
            yield sub
        finally:
            feed.subscribers.discard(sub)

    async def close(self) -> None:
        for feed in list(self.feeds.values()):
            feed.task.cancel()
        await self._client.aclose()
