"""The clients' retries against a real local HTTP server that answers as each test scripts it;
every test runs with Client and with AsyncClient. Waits are read from the injected sleep, never
from a clock."""

from __future__ import annotations

import asyncio
import inspect
import json
import os
from datetime import UTC, datetime
from email.utils import format_datetime

import httpx
import pytest

from muonforge import AsyncClient, Client, Retry
from muonforge.errors import (
    ConnectionFailed,
    MuonforgeError,
    NotFound,
    RateLimited,
    ServerError,
    ValidationError,
)
from muonforge.retry import Repeat, retry_after_seconds, retry_delay
from tests.support.http_stub import DROP, Reply, StubServer, scripted
from tests.support.net import closed_port_url

JOB = {"id": "job_1", "status": "queued"}
DATASET = {"id": "ds_1", "name": "corpus.txt", "bytes": 3, "sha256": "x", "created_at": "2025-01-01T00:00:00Z"}


def error(code: str, message: str = "m", param: str | None = None) -> dict:
    return {"error": {"code": code, "message": message, "param": param}}


@pytest.fixture(params=["sync", "async"])
def call(request):
    """``call(url, method, *args, retry=..., **kwargs)``: the method of a Client or an
    AsyncClient; returns (its result, or the MuonforgeError it raised; the sleeps it asked for).
    Iterators are read to their end."""

    def run(url: str, method: str, *args, retry: Retry = Retry(), **kwargs):  # noqa: B008
        sleeps: list[float] = []
        if request.param == "sync":
            with Client(url, "key", retry=retry, sleep=sleeps.append) as client:
                try:
                    value = getattr(client, method)(*args, **kwargs)
                    return (list(value) if inspect.isgenerator(value) else value), sleeps
                except MuonforgeError as exc:
                    return exc, sleeps

        async def sleep(seconds: float) -> None:
            sleeps.append(seconds)

        async def main():
            async with AsyncClient(url, "key", retry=retry, sleep=sleep) as client:
                try:
                    value = getattr(client, method)(*args, **kwargs)
                    if inspect.isasyncgen(value):
                        return [item async for item in value]
                    return await value
                except MuonforgeError as exc:
                    return exc

        return asyncio.run(main()), sleeps

    return run


def test_503_and_429_are_retried_after_the_servers_retry_after(call):
    handler = scripted(
        Reply(503, error("internal"), {"Retry-After": "2"}),
        Reply(429, error("rate_limited"), {"Retry-After": "7"}),
        Reply(200, JOB),
    )
    with StubServer(handler) as server:
        result, sleeps = call(server.url, "get_job", "job_1")
    assert result == JOB
    assert sleeps == [2.0, 7.0]
    assert len(server.requests) == 3


def test_backoff_doubles_with_jitter_up_to_its_bound(call):
    failures = [Reply(status, error("internal")) for status in (500, 502, 503, 504, 503)]
    with StubServer(scripted(*failures, Reply(200, JOB))) as server:
        result, sleeps = call(server.url, "get_job", "job_1", retry=Retry(max_retries=5, backoff=1.0, max_backoff=4.0))
    assert result == JOB and len(server.requests) == 6
    bounds = [1.0, 2.0, 4.0, 4.0, 4.0]
    assert len(sleeps) == 5 and all(b / 2 <= s <= b for s, b in zip(sleeps, bounds)), sleeps


def test_retries_are_bounded_and_the_last_answer_is_raised(call):
    with StubServer(scripted(Reply(503, error("internal", "overloaded")))) as server:
        result, sleeps = call(server.url, "get_job", "job_1", retry=Retry(max_retries=3))
    assert isinstance(result, ServerError) and result.status == 503 and result.message == "overloaded"
    assert len(server.requests) == 4 and len(sleeps) == 3


def test_a_retry_after_longer_than_max_wait_is_raised_not_waited_for(call):
    with StubServer(scripted(Reply(429, error("rate_limited", "cap"), {"Retry-After": "120"}))) as server:
        result, sleeps = call(server.url, "create_job", {}, retry=Retry(max_wait=60))
    assert isinstance(result, RateLimited) and result.retry_after == 120.0
    assert len(server.requests) == 1 and sleeps == []


@pytest.mark.parametrize(
    ("status", "body", "kind"),
    [
        (404, error("not_found", "no job 'x'", "job_id"), NotFound),
        (422, error("validation_error", "Input should be greater than 0", "optimizer.lr"), ValidationError),
    ],
)
def test_answers_a_repeat_cannot_change_are_raised_at_once(call, status, body, kind):
    with StubServer(scripted(Reply(status, body))) as server:
        result, sleeps = call(server.url, "get_job", "x")
    assert type(result) is kind
    assert (result.status, result.code, result.message, result.param) == (status, *body["error"].values())
    assert len(server.requests) == 1 and sleeps == []


def test_a_refused_connection_is_retried_then_reported_with_the_url(call):
    url = closed_port_url()
    result, sleeps = call(url, "healthz", retry=Retry(max_retries=2))
    assert isinstance(result, ConnectionFailed) and result.url == url
    assert str(result) == f"cannot reach the server at {url}: connection refused"
    assert len(sleeps) == 2


def test_create_job_sends_a_lost_request_again_with_the_same_idempotency_key(call):
    with StubServer(scripted(DROP, Reply(201, JOB), then=Reply(201, JOB))) as server:
        result, sleeps = call(server.url, "create_job", {"model": {"arch": "gpt"}})
        assert result == JOB and len(sleeps) == 1
        call(server.url, "create_job", {"model": {"arch": "gpt"}})
    keys = [r.headers["idempotency-key"] for r in server.requests]
    assert len(keys) == 3 and keys[0] == keys[1] != keys[2], "one key per call, kept across its retries"
    assert server.requests[0].body == server.requests[1].body


def test_cancel_is_sent_again_only_when_the_server_surely_did_not_act(call):
    with StubServer(scripted(DROP)) as server:  # the answer is lost: the job may be cancelled already
        result, sleeps = call(server.url, "cancel_job", "job_1")
    assert isinstance(result, ConnectionFailed) and len(server.requests) == 1 and sleeps == []
    with StubServer(scripted(Reply(429, error("rate_limited"), {"Retry-After": "1"}), Reply(200, JOB))) as server:
        result, sleeps = call(server.url, "cancel_job", "job_1")
    assert result == JOB and sleeps == [1.0] and len(server.requests) == 2


def test_a_rewindable_upload_is_sent_whole_again(call, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(b"to be or not to be " * 10_000)
    reports: list[tuple[int, int | None]] = []
    with StubServer(scripted(Reply(503, error("internal")), Reply(201, DATASET))) as server:
        result, sleeps = call(server.url, "upload_dataset", corpus, progress=lambda *r: reports.append(r))
    assert result == DATASET and len(sleeps) == 1
    size = corpus.stat().st_size
    assert [r.body.count(corpus.read_bytes()) for r in server.requests] == [1, 1]
    assert b'name="name"\r\n\r\ncorpus.txt' in server.requests[1].body
    assert reports[-1] == (size, size)
    restarts = [i for i in range(1, len(reports)) if reports[i][0] < reports[i - 1][0]]
    assert len(restarts) == 1, "the second attempt counts from the start again"


def test_an_upload_that_cannot_be_read_again_is_not_retried(call):
    read_end, write_end = os.pipe()
    os.write(write_end, b"some text")
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe, StubServer(scripted(Reply(503, error("internal")))) as server:
        assert not pipe.seekable()
        result, sleeps = call(server.url, "upload_dataset", pipe, name="piped")
    assert isinstance(result, ServerError) and len(server.requests) == 1 and sleeps == []
    assert b"some text" in server.requests[0].body


def test_readyz_returns_a_not_ready_report_instead_of_retrying(call):
    report = {"status": "unavailable", "checks": {"database": "ok", "broker": "down"}}
    with StubServer(scripted(Reply(503, report))) as server:
        result, sleeps = call(server.url, "readyz")
    assert result == report and len(server.requests) == 1 and sleeps == []


def sse(event_id: str | None, kind: str, data: dict) -> bytes:
    return (f"id: {event_id}\n" if event_id else "").encode() + f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode()


def test_events_reconnect_after_a_cut_with_the_last_event_id(call):
    def handle(request):
        if "last-event-id" not in request.headers:  # two events, a comment, then the connection ends
            return [sse("1", "log", {"n": 1}), b": ping\n\n", sse("2", "log", {"n": 2}), b"id: 3\nevent: log\nda"]
        return [sse("3", "log", {"n": 3}), sse(None, "done", {})]

    with StubServer(handle) as server:
        events, sleeps = call(server.url, "events", "job_1")
    assert [(e.event, e.id, e.data) for e in events] == [
        ("log", "1", {"n": 1}),
        ("log", "2", {"n": 2}),
        ("log", "3", {"n": 3}),
        ("done", None, {}),
    ]
    assert [r.headers.get("last-event-id") for r in server.requests] == [None, "2"]
    assert len(sleeps) == 1


# -- the pure parts -------------------------------------------------------------------------------
NOW = datetime(2025, 6, 1, 12, 0, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("5", 5.0),
        ("0", 0.0),
        (format_datetime(NOW.replace(second=30), usegmt=True), 30.0),
        (format_datetime(NOW.replace(hour=11), usegmt=True), 0.0),
        ("soon", None),
        (None, None),
    ],
)
def test_retry_after_is_seconds_or_an_http_date(value, seconds):
    assert retry_after_seconds(value, NOW.timestamp()) == seconds


POLICY = Retry(max_retries=3, backoff=1.0, max_backoff=10.0, max_wait=30.0)
REFUSED = httpx.ConnectError("refused")
LOST = httpx.ReadTimeout("no answer")


@pytest.mark.parametrize(
    ("retries", "repeat", "outcome", "delay"),
    [
        (0, Repeat.SAFE, {"status": 503}, 1.0),
        (2, Repeat.SAFE, {"status": 503}, 4.0),
        (3, Repeat.SAFE, {"status": 503}, None),  # retries spent
        (0, Repeat.SAFE, {"status": 503, "retry_after": 12.0}, 12.0),
        (0, Repeat.SAFE, {"status": 429, "retry_after": 31.0}, None),  # over max_wait
        (0, Repeat.SAFE, {"status": 404}, None),
        (0, Repeat.SAFE, {"status": 501}, None),
        (0, Repeat.SAFE, {"error": LOST}, 1.0),
        (0, Repeat.UNSENT, {"error": LOST}, None),  # it may have been done
        (0, Repeat.UNSENT, {"status": 503}, None),
        (0, Repeat.UNSENT, {"status": 429, "retry_after": 3.0}, 3.0),
        (0, Repeat.UNSENT, {"error": REFUSED}, 1.0),
        (0, Repeat.NEVER, {"error": REFUSED}, None),
        (0, Repeat.SAFE, {"error": httpx.UnsupportedProtocol("ftp")}, None),
    ],
)
def test_retry_delay(retries, repeat, outcome, delay):
    assert retry_delay(POLICY, retries, repeat, jitter=1.0, **outcome) == delay
