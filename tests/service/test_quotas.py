"""Per-tenant limits: open event streams, request rate, threads and the pace of refusals. One
tenant at its limit gets 429 with Retry-After (or, for threads, waits for its own; refused again
at once, its refusals wait); another tenant is not affected. Streams, rate and pace are shared
by the API processes through Redis, and counted per process while Redis does not answer."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
import time
import uuid

import anyio
import httpx
import pytest

from app.errors import RateLimited
from app.messaging.shared_limits import SharedLimits
from app.services.quotas import TenantLimits, TenantThreads
from app.settings import Settings
from tests.support.api import new_key
from tests.support.net import wait_for
from tests.support.services import redis_server, running_api
from tests.support.specs import tiny_spec

pytestmark = pytest.mark.system  # its tests start processes: the service's, torchrun's or a command's


@pytest.fixture(scope="module")
def few_streams_api(settings, tmp_path_factory):
    with running_api(settings, tmp_path_factory.mktemp("streams-api"), MUONFORGE_TENANT_STREAM_CAP="3") as url:
        yield url


@pytest.fixture(scope="module")
def slow_rate_api(settings, tmp_path_factory):
    """A token every 5 s after a burst of 20: a busy machine cannot refill the bucket mid-test.
    Refusals come at once (the pace is tested on its own below)."""
    with running_api(
        settings,
        tmp_path_factory.mktemp("rate-api"),
        MUONFORGE_TENANT_RATE_PER_SECOND="0.2",
        MUONFORGE_TENANT_BURST="20",
        MUONFORGE_REFUSAL_PACE_SECONDS="0",
    ) as url:
        yield url


def test_a_tenant_holds_at_most_its_cap_of_open_streams(few_streams_api, settings):
    mine, theirs = ({"Authorization": f"Bearer {new_key(settings)}"} for _ in range(2))
    with httpx.Client(base_url=few_streams_api, timeout=30) as client, contextlib.ExitStack() as streams:
        job = client.post("/v1/jobs", json=tiny_spec(), headers=mine).json()["id"]  # queued: its stream stays open
        other = client.post("/v1/jobs", json=tiny_spec(), headers=theirs).json()["id"]
        path = f"/v1/jobs/{job}/events"
        held = [streams.enter_context(client.stream("GET", path, headers=mine)) for _ in range(3)]
        assert all(r.status_code == 200 for r in held)
        for _ in range(2):  # the second refusal comes after a pause (the default pace), the same answer
            refused = client.get(path, headers=mine)
            error = refused.json()["error"]
            assert refused.status_code == 429 and error["code"] == "rate_limited"
            assert refused.headers["retry-after"] == "5" and "3 open event streams" in error["message"]
            assert refused.headers.get("connection") != "close"
        with client.stream("GET", f"/v1/jobs/{other}/events", headers=theirs) as r:
            assert r.status_code == 200  # another tenant is not affected
        held[0].close()  # a closed stream frees its slot, once the server has seen the disconnect

        def reopened() -> bool:
            with client.stream("GET", path, headers=mine) as r:
                return r.status_code == 200

        wait_for(reopened, timeout=30, interval=0.2)
        for job_id, headers in ((job, mine), (other, theirs)):
            client.post(f"/v1/jobs/{job_id}/cancel", headers=headers)


def test_a_tenant_over_its_request_rate_is_told_when_to_come_back(slow_rate_api, settings):
    mine, theirs = ({"Authorization": f"Bearer {new_key(settings)}"} for _ in range(2))
    with httpx.Client(base_url=slow_rate_api, timeout=30) as client:
        codes = [client.get("/v1/jobs", headers=mine).status_code for _ in range(40)]
        assert codes[:20] == [200] * 20 and codes.count(429) >= 15  # a burst of 20, then one every 5 s
        refused = client.get("/v1/jobs", headers=mine)
        assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
        assert "requests a second" in refused.json()["error"]["message"]
        r = client.post("/v1/jobs", json=tiny_spec(), headers=mine)  # a body's request is counted too
        assert r.status_code == 429 and r.headers["retry-after"]
        assert client.get("/v1/jobs", headers=theirs).status_code == 200


def fresh_connections() -> httpx.Client:
    """A client that opens a connection per request: the kernel hands each to either API process."""
    return httpx.Client(timeout=30, limits=httpx.Limits(max_keepalive_connections=0))


def test_streams_rate_and_pace_are_one_figure_across_two_api_processes(settings, tmp_path):
    """Two API processes on one port, each request on a connection of its own: 8 streams opened
    at once, 3 get a slot (the cap, not 3 per process); of 30 requests, the burst of 20 passes
    (not 20 per process); a refusal that comes before the previous one's Retry-After is held,
    whichever process answers it."""
    env = dict(
        MUONFORGE_TENANT_STREAM_CAP="3",
        MUONFORGE_TENANT_RATE_PER_SECOND="0.01",  # one token per 100 s: none refills during the test
        MUONFORGE_TENANT_BURST="20",
        MUONFORGE_REFUSAL_PACE_SECONDS="1",
    )
    streamer, caller = ({"Authorization": f"Bearer {new_key(settings)}"} for _ in range(2))
    with running_api(settings, tmp_path, "--workers", "2", **env) as url, fresh_connections() as client:
        job = client.post(f"{url}/v1/jobs", json=tiny_spec(), headers=streamer).json()["id"]
        with contextlib.ExitStack() as streams:
            events = f"{url}/v1/jobs/{job}/events"
            opened = [streams.enter_context(client.stream("GET", events, headers=streamer)) for _ in range(8)]
            assert sorted(r.status_code for r in opened) == [200] * 3 + [429] * 5
        codes = [client.get(f"{url}/v1/jobs", headers=caller).status_code for _ in range(30)]
        assert codes == [200] * 20 + [429] * 10
        # Each refusal above came before the previous one's Retry-After: all but the first were
        # held for half to all of the pace (1 s), on either process.
        started = time.monotonic()
        for _ in range(4):
            assert client.get(f"{url}/v1/jobs", headers=caller).status_code == 429
        assert time.monotonic() - started >= 4 * 0.5
        client.post(f"{url}/v1/jobs/{job}/cancel", headers=streamer)


def test_a_redis_that_stops_answering_leaves_each_process_its_own_limits(settings, tmp_path):
    """The limits' Redis paused (SIGSTOP): the API logs it once and counts each tenant's rate in
    the process (a bucket of its own: the burst again, then 429, never no limit); resumed, the
    shared buckets count again, and the API logs that too."""
    env = dict(
        MUONFORGE_TENANT_RATE_PER_SECOND="0.01",  # one token per 100 s: none refills during the test
        MUONFORGE_TENANT_BURST="5",
        MUONFORGE_REFUSAL_PACE_SECONDS="0",
    )
    first, second = ({"Authorization": f"Bearer {new_key(settings)}"} for _ in range(2))
    with redis_server() as (own_redis, redis_proc):
        own = settings.model_copy(update={"redis_url": own_redis})
        with running_api(own, tmp_path, **env) as url, fresh_connections() as client:
            log = tmp_path / "api.log"

            def status(headers: dict[str, str]) -> int:
                return client.get(f"{url}/v1/jobs", headers=headers).status_code

            assert [status(first) for _ in range(6)] == [200] * 5 + [429]  # the shared bucket
            redis_proc.send_signal(signal.SIGSTOP)
            assert [status(second) for _ in range(8)] == [200] * 5 + [429] * 3  # the process's bucket
            assert log.read_text().count("Redis does not answer") == 1
            assert status(first) == 200  # the process's bucket knows nothing of the shared one
            redis_proc.send_signal(signal.SIGCONT)
            wait_for(lambda: status(second) and "Redis answers again" in log.read_text(), timeout=30, interval=0.5)
            assert status(first) == 429  # the shared bucket again: empty


def test_concurrent_requests_take_exactly_the_tokens_of_the_shared_bucket(settings):
    """25 requests of tenant a and 3 of tenant b at once, on shared buckets of 20: 20 of a's pass
    and 5 are refused with the wait for a token (100 s at 0.01 a second); b's 3 pass."""
    limits = TenantLimits(Settings(tenant_rate_per_second=0.01, tenant_burst=20), SharedLimits(settings.redis_url))
    a, b = (f"tenant-{uuid.uuid4().hex}" for _ in range(2))

    async def scenario() -> list[object]:
        requests = [limits.take_request(a) for _ in range(25)] + [limits.take_request(b) for _ in range(3)]
        answers = await asyncio.gather(*requests, return_exceptions=True)
        await limits.close()
        return answers

    answers = asyncio.run(scenario())
    assert answers[:25].count(None) == 20 and answers[25:] == [None] * 3
    refused = [r for r in answers[:25] if r is not None]
    assert all(isinstance(r, RateLimited) and r.headers["Retry-After"] == "100" for r in refused), refused


def test_a_tenant_uses_at_most_its_share_of_the_thread_pool():
    """Two threads for tenant a: its third and fourth calls wait for its own threads while
    tenant b's call runs at once; the waiting ones run as a's first ones finish."""
    threads, release = TenantThreads(2), threading.Event()
    running, most, order, lock = [0], [0], [], threading.Lock()

    def blocked(name: str) -> str:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        release.wait(10)
        with lock:
            running[0] -= 1
            order.append(name)
        return name

    async def scenario() -> list[str]:
        results: list[str] = []

        async def call(tenant: str, name: str, fn) -> None:
            results.append(await threads.run(tenant, fn, name))

        async with anyio.create_task_group() as group:
            for i in range(4):
                group.start_soon(call, "a", f"a{i}", blocked)
            await anyio.sleep(0.2)
            assert running[0] == 2  # a's share is taken; its other two calls wait
            with anyio.fail_after(5):
                await call("b", "b", lambda name: name)  # b is not behind a's queue
            assert results == ["b"] and running[0] == 2
            release.set()
        return results

    results = anyio.run(scenario)
    assert sorted(results) == ["a0", "a1", "a2", "a3", "b"] and most[0] == 2
    assert not threads._held  # nothing kept for tenants with no call in flight


def test_a_tenant_refused_again_at_once_gets_its_refusals_after_a_pause():
    """Tenant a's first refusal comes at once; refused again before its Retry-After, its answers
    wait (two at most here, the third comes at once and closes its connection) while tenant b's
    first refusal is not held behind them; after the pause both of a's held refusals are
    answered. A tenant that comes back once its Retry-After has passed is answered at once."""
    limits = TenantLimits(Settings(refusal_pace_seconds=5.0))  # no Redis: this process's record
    limits.pacer.cap = 2
    pacer = limits.pacer

    async def at_once(tenant: str, retry_after: float) -> bool:
        task = asyncio.create_task(limits.pause_refusal(tenant, retry_after))
        await asyncio.sleep(0)  # one turn of the loop: a pause would still be sleeping
        assert task.done(), "answered without a pause"
        return task.result()

    async def scenario() -> None:
        assert await at_once("a", 0.3)  # the first: no pause
        held = [asyncio.create_task(limits.pause_refusal("a", 0.3)) for _ in range(2)]
        await asyncio.sleep(0)
        assert not any(task.done() for task in held) and pacer.waiting["a"] == 2
        assert await at_once("a", 0.3) is False  # past the cap: at once, close
        assert await at_once("b", 0.3)  # another tenant's first: at once
        assert await asyncio.wait_for(asyncio.gather(*held), 5) == [True, True]
        assert not pacer.waiting
        await asyncio.sleep(0.35)  # longer than the last Retry-After: waited as told
        assert await at_once("a", 0.3)

    asyncio.run(scenario())
