"""A job's events stream: history from the database, then the live bus, resumable exactly.

Every event but ``done`` has an id that encodes a ``Cursor`` (the last job event's seq, the next
telemetry step). The stream replays pages from the database, then tails the job's Redis Stream,
and reads the database again whenever the bus cannot bring the rest in order; in embedded mode it
polls the database (docs/service.md, "The events stream"). An open stream outlives the API-key
cache, so ``while_key_valid`` checks its key again every ``auth_cache_seconds``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi.sse import ServerSentEvent
from redis.exceptions import RedisError
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from app.db.models import Job
from app.db.session import open_session
from app.errors import ValidationFailed
from app.messaging.live_bus import REDIS_TIMEOUT, LiveReader, Resync
from app.repositories.job_events import JobEventRepository
from app.repositories.jobs import JobRepository
from app.services.auth import TenantRef
from app.services.jobs import get_job
from app.services.metric_history import MAX_STEP, steps_from
from app.settings import Settings
from contract.status import is_finished

STEP_BITS = 32  # the id packs (seq, next step) into one increasing integer
log = logging.getLogger("muonforge.api")
PAGE_STEPS = 500  # telemetry steps per database page
PAGE_EVENTS = 500  # job events per database page
POLL_SECONDS = 0.5  # embedded mode, and after the bus lost its place
RECHECK_SECONDS = 15.0  # the database is read again when the bus brought nothing for this long
MIN_KEY_CHECK_SECONDS = 1.0  # an open stream's key checks, at most this often (auth_cache_seconds may be 0)
READ_AHEAD = 256  # events read before they are sent, at most (one database page is up to 500 steps)


@dataclass
class Cursor:
    seq: int = 0  # the last job event delivered
    next_step: int = 0  # the first telemetry step not yet delivered

    @classmethod
    def parse(cls, last_event_id: str | None, param: str = "Last-Event-ID") -> Cursor:
        if not last_event_id:
            return cls()
        try:
            value = int(last_event_id)
        except ValueError:
            value = -1
        seq, next_step = value >> STEP_BITS, value & ((1 << STEP_BITS) - 1)
        if value < 0 or seq > MAX_STEP or next_step > MAX_STEP:  # no stream sends those (int32 columns)
            raise ValidationFailed(f"{param} must be an id this stream sent", param=param)
        return cls(seq, next_step)

    @property
    def id(self) -> str:
        return str(self.seq << STEP_BITS | self.next_step)

    def job_event(self, seq: int, kind: str, payload: dict[str, Any] | str) -> ServerSentEvent | None:
        """The event if it is a job event not yet delivered (``payload`` as a dict or as JSON); None
        otherwise."""
        if seq <= self.seq:
            return None
        self.seq = seq
        raw = payload if isinstance(payload, str) else json.dumps(payload)
        return ServerSentEvent(event=kind, raw_data=raw, id=self.id)

    def metrics(self, step: int, values: dict[str, float] | str) -> ServerSentEvent | None:
        """The event if its step is not behind the cursor (``values`` as a dict or as JSON); None
        otherwise."""
        if step < self.next_step:
            return None
        self.next_step = step + 1
        values = values if isinstance(values, str) else json.dumps(values)
        return ServerSentEvent(event="metrics", raw_data=f'{{"step": {step}, "metrics": {values}}}', id=self.id)


@dataclass
class Page:
    events: list[ServerSentEvent] = field(default_factory=list)
    more: bool = False  # a full page of steps: read the next one at once
    done: bool = False  # the job has finished and everything has been delivered
    mark: str | None = None  # the bus position up to which the database holds the metrics


def read_page(settings: Settings, job_id: str, cursor: Cursor) -> Page:
    """What the database holds after ``cursor`` (``page_of``), in a session of its own."""
    with open_session(settings) as session:
        return page_of(session, JobRepository(session).get(job_id), cursor)


def first_page(session: Session, tenant: TenantRef, job_id: str, cursor: Cursor) -> Page:
    """A stream's first page, the job known to be the tenant's first (NotFound): one unit of
    work, one database round of reads, before the stream starts."""
    return page_of(session, get_job(session, tenant, job_id), cursor)


def page_of(session: Session, job: Job | None, cursor: Cursor) -> Page:
    """What the database holds of ``job`` after ``cursor``, one page, in order; advances the cursor.

    A page is up to PAGE_STEPS telemetry steps and PAGE_EVENTS job events (it costs the same however
    long the job). ``job`` None (deleted meanwhile): the end.
    """
    if job is None:
        return Page(done=True)
    job_id = job.id
    # Read first: the rows below are at least as new.
    mark, status, last_seq = job.telemetry_mark, job.status, job.event_seq
    events = JobEventRepository(session).events(job_id, after_seq=cursor.seq, limit=PAGE_EVENTS)
    steps = steps_from(session, job_id, cursor.next_step, PAGE_STEPS)
    full_steps, more_events = len(steps) == PAGE_STEPS, len(events) == PAGE_EVENTS
    page = Page(more=full_steps or more_events, mark=mark)
    pending = [(e.seq, e.kind, e.payload, step_of(e.kind, e.payload, e.step)) for e in events]
    found: list[ServerSentEvent | None] = []  # None: delivered already
    i, stopped = 0, False
    for step, values in steps:  # job events in seq order, each before the steps after it
        while i < len(pending) and pending[i][3] <= step:
            found.append(cursor.job_event(*pending[i][:3]))
            i += 1
        if more_events and i == len(pending):  # events not read yet may come before this step
            stopped = True
            break
        found.append(cursor.metrics(step, values))
    if not full_steps and not stopped:
        found += [cursor.job_event(*p[:3]) for p in pending[i:]]
    page.done = not page.more and is_finished(status) and cursor.seq >= last_seq
    page.events = [e for e in found if e is not None]
    return page


def step_of(kind: str, payload: dict[str, Any], step: int | None) -> float:
    """Where a job event goes among the telemetry steps: a final status after all of them."""
    if kind == "status" and is_finished(payload.get("status", "")):
        return float("inf")
    return -1 if step is None else step


async def follow(
    settings: Settings,
    reader: LiveReader | None,
    job_id: str,
    cursor: Cursor,
    first: Page | None = None,
    in_thread: Callable[..., Awaitable[Page]] = run_in_threadpool,
) -> AsyncGenerator[ServerSentEvent, None]:
    """The job's events after ``cursor``, then ``done`` once it has finished.

    ``first``: the first page, read already; ``in_thread`` runs each later page's reads in the
    thread pool, within the tenant's share of it. Without the bus (embedded mode, or Redis stopped
    or paused) the database is polled every POLL_SECONDS.
    """
    while True:
        page, first = first or await in_thread(read_page, settings, job_id, cursor), None
        for event in page.events:
            yield event
        if page.done:
            yield ServerSentEvent(event="done", data={})
            return
        if page.more:
            continue
        if reader is None or not await bus_takes_over(reader, job_id, page.mark):
            await asyncio.sleep(POLL_SECONDS)  # no bus, or the bus lost what the database does not hold yet
            continue
        try:
            async for event in tail(reader, job_id, page.mark or "0-0", cursor):
                yield event
        except (RedisError, OSError, TimeoutError) as exc:  # the bus failed mid-tail: the database has it all
            log.warning("job %s: live stream unavailable (%s); reading the database", job_id, exc)
            await asyncio.sleep(POLL_SECONDS)


async def bus_takes_over(reader: LiveReader, job_id: str, mark: str | None) -> bool:
    """Whether the bus holds everything after ``mark`` (the database's position), within REDIS_TIMEOUT.

    Redis stopped or paused means no, and the stream polls the database. Without a mark (nothing
    published yet) the bus takes over if it answers at all: a Redis that refuses connections would
    otherwise fail every subscription at once, and the stream would read the database again and
    again without a pause.
    """
    try:
        check = reader.holds(job_id, mark) if mark else reader.ping()
        return await asyncio.wait_for(check, REDIS_TIMEOUT)
    except (RedisError, OSError, TimeoutError):
        return False


async def tail(reader: LiveReader, job_id: str, position: str, cursor: Cursor) -> AsyncIterator[ServerSentEvent]:
    """Events from the bus after ``position``, until it has nothing for RECHECK_SECONDS, a job
    event arrives out of order, the job finishes, or the subscription lost entries."""
    try:
        async with reader.subscribe(job_id, position) as subscription:
            while True:
                try:
                    entry = await asyncio.wait_for(subscription.get(), RECHECK_SECONDS)
                except TimeoutError:
                    return
                if entry.kind == "metrics":
                    event = cursor.metrics(entry.step, entry.data)
                elif entry.seq is None or entry.seq > cursor.seq + 1:
                    return  # its predecessor has not arrived: the database has them in order
                else:
                    event = cursor.job_event(entry.seq, entry.kind, entry.data)
                    if entry.final_status:
                        if event is not None:
                            yield event
                        return  # the database has the rest, and the end
                if event is not None:
                    yield event
    except Resync:
        return


async def while_key_valid(
    events: AsyncGenerator[ServerSentEvent, None], key_valid: Callable[[], Awaitable[bool]], every: float
) -> AsyncIterator[ServerSentEvent]:
    """``events`` until ``key_valid()`` answers False: then the stream ends, without ``done``.

    ``key_valid`` is asked every ``every`` seconds (at least MIN_KEY_CHECK_SECONDS) by a task of
    its own, and ``events`` read by another: events keep flowing while a check waits for its
    thread and its query. (A check on the stream's path held the 200 streams of one tenant, whose
    checks all fall due together, for up to 2.7 s every ``every``: docs/benchmarks.md.)
    """
    every = max(every, MIN_KEY_CHECK_SECONDS)
    ahead: asyncio.Queue[ServerSentEvent | Exception | None] = asyncio.Queue(maxsize=READ_AHEAD)
    key_failed = asyncio.Event()
    check_raised: list[Exception] = []

    async def read() -> None:
        try:
            async with contextlib.aclosing(events):
                async for event in events:
                    await ahead.put(event)
        except Exception as exc:  # raised below, where the stream is served
            await ahead.put(exc)
            return
        await ahead.put(None)  # the end

    async def check() -> None:
        try:
            while True:
                await asyncio.sleep(every)
                if not await key_valid():
                    break
        except Exception as exc:  # raised below, where the stream is served
            check_raised.append(exc)
        key_failed.set()
        with contextlib.suppress(asyncio.QueueFull):
            ahead.put_nowait(None)  # wakes the loop below if it waits for an event

    tasks = [asyncio.create_task(read()), asyncio.create_task(check())]
    try:
        while True:
            try:
                item = ahead.get_nowait()  # most events: no wait
            except asyncio.QueueEmpty:
                item = await ahead.get()
            if key_failed.is_set():
                if check_raised:
                    raise check_raised[0]
                return
            if item is None:
                return
            if isinstance(item, Exception):
                raise item
            yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
