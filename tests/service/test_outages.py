"""Infrastructure faults during a running job are survived, not turned into failures: a
Postgres restart and an outage longer than the job's lease, with the API and the worker both
behind it, and a paused Redis under a followed job."""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import time
from urllib.parse import urlsplit, urlunsplit

import httpx
import pytest

from app.db.session import transaction
from app.repositories.jobs import JobRepository
from bench.faults import TcpProxy
from tests.support.api import new_key
from tests.support.net import free_port, wait_for
from tests.support.services import Worker, redis_server, running_api
from tests.support.specs import tiny_spec

pytestmark = pytest.mark.system  # its tests start processes: the service's, torchrun's or a command's

STEPS = 300


def job_row(settings, job_id: str):
    with transaction(settings) as session:
        return JobRepository(session).fresh(job_id)


def run_through(settings, tmp_path, fault) -> None:
    """A 300-step job with the API and the worker behind a proxy to Postgres; ``fault(proxy)``
    once the job is past step 60; the job must succeed with every step's loss stored once."""
    parts = urlsplit(settings.database_url)
    proxy = TcpProxy((parts.hostname or "127.0.0.1", parts.port or 5432))
    netloc = f"{parts.username or 'postgres'}@127.0.0.1:{proxy.port}"
    behind = settings.model_copy(update={"database_url": urlunsplit(parts._replace(netloc=netloc))})
    headers = {"Authorization": f"Bearer {new_key(settings)}"}
    spec = tiny_spec(STEPS, eval_every=50, checkpoint_every=50)
    worker = None
    try:
        with running_api(behind, tmp_path) as api:
            worker = Worker(behind, tmp_path / "worker.log")
            job_id = httpx.post(f"{api}/v1/jobs", json=spec, headers=headers).json()["id"]
            wait_for(lambda: job_row(settings, job_id).progress_step >= 60, timeout=120)
            fault(proxy)
            job = wait_for(
                lambda: (j := job_row(settings, job_id)).status in ("succeeded", "failed") and j, timeout=240
            )
            assert job.status == "succeeded", (job.error, (tmp_path / "worker.log").read_text()[-3000:])
            history = httpx.get(
                f"{api}/v1/jobs/{job_id}/metrics", params={"names": "loss", "max_points": 1000}, headers=headers
            ).json()
            (loss,) = [series for series in history["series"] if series["name"] == "loss"]
            steps = [point[0] for point in loss["points"]]
            missing, twice = sorted(set(range(STEPS)) - set(steps)), len(steps) - len(set(steps))
            assert (missing, twice) == ([], 0), (missing, twice)  # each step once
    finally:
        if worker is not None:
            worker.stop()
        proxy.close()


def test_a_postgres_restart_during_a_job_does_not_fail_it(settings, tmp_path):
    def restart(proxy: TcpProxy) -> None:  # every connection dropped, the server back at once
        for _ in range(2):
            proxy.cut()
            proxy.restore()
            time.sleep(1.5)

    run_through(settings, tmp_path, restart)


def test_a_postgres_outage_longer_than_the_lease_neither_fails_nor_loses_the_job(settings, tmp_path):
    def outage(proxy: TcpProxy) -> None:  # longer than the lease: the reaper may requeue the job
        proxy.cut()
        time.sleep(3 * settings.lease_seconds)
        proxy.restore()

    run_through(settings, tmp_path, outage)


def test_a_paused_redis_neither_blocks_the_job_nor_its_followers(settings, tmp_path):
    """Redis paused (SIGSTOP: connections stay open, nothing answers) while a client follows a
    running job: events keep coming, from the database, while Redis is paused; the job succeeds
    and the stream carries every step exactly once."""
    steps, headers = 4000, {"Authorization": f"Bearer {new_key(settings)}"}
    spec = tiny_spec(steps, eval_every=1000, checkpoint_every=1000)
    received: list[tuple[float, str, int | None]] = []
    worker = None
    with redis_server() as (own_redis, proc):
        own = settings.model_copy(update={"redis_url": own_redis})
        try:
            with running_api(own, tmp_path) as api:
                worker = Worker(own, tmp_path / "worker.log")
                job_id = httpx.post(f"{api}/v1/jobs", json=spec, headers=headers).json()["id"]

                def follow() -> None:
                    with httpx.stream("GET", f"{api}/v1/jobs/{job_id}/events", headers=headers, timeout=60) as r:
                        event = None
                        for line in r.iter_lines():
                            if line.startswith("event: "):
                                event = line[7:]
                            elif line.startswith("data: ") and event:
                                step = json.loads(line[6:]).get("step") if event == "metrics" else None
                                received.append((time.monotonic(), event, step))
                                event = None

                follower = threading.Thread(target=follow, daemon=True)
                follower.start()
                wait_for(lambda: job_row(settings, job_id).progress_step >= 200, timeout=120)
                proc.send_signal(signal.SIGSTOP)
                paused_at = time.monotonic()
                time.sleep(15)
                resumed_at = time.monotonic()
                proc.send_signal(signal.SIGCONT)
                follower.join(timeout=240)
                job = job_row(settings, job_id)
                assert job.status == "succeeded", job.error
                during = [s for t, e, s in received if e == "metrics" and paused_at < t < resumed_at]
                assert during, "no event arrived while Redis was paused"
                metrics = [s for _, e, s in received if e == "metrics"]
                assert metrics == list(range(steps + 1)) and received[-1][1] == "done"  # the last eval is step N
        finally:
            if worker is not None:
                worker.stop()


def test_a_stream_polls_the_database_at_a_bounded_rate_while_redis_refuses_connections(client, settings, monkeypatch):
    """A followed job with nothing on the bus yet (queued) and a Redis that refuses connections:
    the stream reads the database every POLL_SECONDS, not as fast as the failures come back."""
    import asyncio

    from app.messaging.live_bus import LiveReader
    from app.services import event_stream

    auth = {"Authorization": f"Bearer {new_key(settings)}"}
    job_id = client.post("/v1/jobs", json=tiny_spec(), headers=auth).json()["id"]
    reads = []
    original = event_stream.read_page
    monkeypatch.setattr(event_stream, "read_page", lambda *args: reads.append(1) or original(*args))

    async def follow_for(seconds: float) -> None:
        reader = LiveReader(f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
        stream = event_stream.follow(settings, reader, job_id, event_stream.Cursor.parse(None))
        try:
            await asyncio.wait_for(anext(stream), seconds)  # the queued status
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(anext(stream), seconds)  # nothing more: the job stays queued
        finally:
            await stream.aclose()
            await reader.close()

    asyncio.run(follow_for(2.0))
    # About 2 / POLL_SECONDS + 1 reads; without the pause it was hundreds.
    assert 2 <= len(reads) <= 2 / event_stream.POLL_SECONDS + 4, len(reads)
