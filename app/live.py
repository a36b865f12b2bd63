"""The live bus: telemetry and job events on their way to the events stream, ahead of the database.

With Redis (full mode), each job has one Redis Stream: the worker's sink appends every telemetry
step as it happens (XADD, trimmed to about ``live_stream_maxlen`` entries), and whoever commits a
job event (status, checkpoint, log) appends it once committed. The events stream reads it with
XREAD BLOCK. The database stays the record: the stream only brings events sooner, and the
events stream falls back to the database for anything the stream no longer holds.

Without Redis (embedded mode) there is no bus: publishing does nothing and the events stream
polls the database.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import redis
import redis.asyncio

from app.settings import Settings

log = logging.getLogger("muonforge.live")
STREAM_TTL_SECONDS = 24 * 3600  # a job's stream outlives its last event by a day


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
        self._client = redis.Redis.from_url(url)

    def publish_metrics(self, job_id: str, steps: Sequence[tuple[int, str]]) -> list[str]:
        """Append telemetry steps, (step, JSON of its values), in one round trip; their stream ids."""
        key = stream_key(job_id)
        pipe = self._client.pipeline(transaction=False)
        for step, data in steps:
            pipe.xadd(key, {"kind": "metrics", "step": step, "data": data}, maxlen=self.maxlen, approximate=True)
        pipe.expire(key, STREAM_TTL_SECONDS)
        return [entry_id.decode() for entry_id in pipe.execute()[:-1]]

    def publish_events(self, events: Sequence[dict[str, Any]]) -> None:
        """Append committed job events ({job_id, seq, step, kind, payload}) in one round trip."""
        pipe = self._client.pipeline(transaction=False)
        for e in events:
            fields = {"kind": e["kind"], "seq": e["seq"], "step": -1 if e["step"] is None else e["step"]}
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


@lru_cache(maxsize=8)
def _bus(url: str | None, maxlen: int) -> RedisBus | NoBus:
    return RedisBus(url, maxlen) if url else NoBus()


def live_bus(settings: Settings) -> RedisBus | NoBus:
    return _bus(settings.redis_url, settings.live_stream_maxlen)


class LiveReader:
    """Reads the per-job Redis Streams from an event loop (the API's events stream)."""

    def __init__(self, url: str) -> None:
        self._client = redis.asyncio.Redis.from_url(url)

    async def read(self, job_id: str, after: str, block_ms: int, count: int = 1000) -> list[tuple[str, dict]]:
        """Entries after ``after`` ("0-0": from the start), waiting up to ``block_ms`` for one."""
        reply = await self._client.xread({stream_key(job_id): after}, count=count, block=block_ms)
        if not reply:
            return []
        return [(entry_id.decode(), decode_entry(fields)) for entry_id, fields in reply[0][1]]

    async def holds(self, job_id: str, entry_id: str) -> bool:
        """Whether the stream still holds ``entry_id``: reading after it then misses nothing."""
        return bool(await self._client.xrange(stream_key(job_id), entry_id, entry_id, count=1))

    async def close(self) -> None:
        await self._client.aclose()


def decode_entry(fields: dict[bytes, bytes]) -> dict[str, Any]:
    """A stream entry as {kind, step, seq?, data} with the data parsed."""
    entry: dict[str, Any] = {"kind": fields[b"kind"].decode(), "step": int(fields[b"step"])}
    if b"seq" in fields:
        entry["seq"] = int(fields[b"seq"])
    entry["data"] = json.loads(fields[b"data"])
    return entry
