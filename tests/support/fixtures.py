"""Fixtures on the real services: a fresh Postgres database migrated for this run, a Redis
database, the API in-process (FastAPI TestClient) and Celery workers as real processes."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from fastapi.testclient import TestClient

from app.db.migrate import upgrade
from app.main import create_app
from app.settings import Settings
from contract.status import UNFINISHED
from tests.support.api import new_key
from tests.support.net import wait_for
from tests.support.services import Worker, create_database, drop_database, redis_server, running_api, unavailable
from tests.support.services import database_url as url_of

REDIS = os.environ.get("MUONFORGE_TEST_REDIS")  # unset: a throwaway redis-server for this run
REDIS_FALLBACK = "redis://127.0.0.1:6379/13"  # where no redis-server binary is installed


@pytest.fixture(scope="session")
def database_url() -> Iterator[str]:
    """A database of its own on the Postgres server, dropped at the end."""
    name = create_database()
    yield url_of(name)
    drop_database(name)


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory) -> Iterator[str]:
    """A Redis no other run shares: a throwaway redis-server started from the installed binary
    (no persistence), or MUONFORGE_TEST_REDIS, or the local server's database 13."""
    server = shutil.which("redis-server")
    if REDIS or not server:
        url = REDIS or REDIS_FALLBACK
        try:
            redis.Redis.from_url(url, socket_connect_timeout=5).flushdb()
        except redis.RedisError as exc:
            unavailable(f"needs Redis at {url} (MUONFORGE_TEST_REDIS) or a redis-server binary: {exc}")
        yield url
        return
    with redis_server(tmp_path_factory.mktemp("redis") / "redis.log") as (url, _):
        yield url


@pytest.fixture(scope="session")
def settings(database_url, redis_url, tmp_path_factory) -> Settings:
    s = Settings(
        database_url=database_url,
        redis_url=redis_url,
        artifact_dir=tmp_path_factory.mktemp("artifacts"),
        cache_dir=tmp_path_factory.mktemp("cache"),  # the token arrays: never the checkout's var/cache
        tenant_job_cap=100,
        lease_seconds=3.0,
        heartbeat_seconds=0.5,
        reaper_seconds=0.5,
        requeue_after_seconds=30.0,
        cancel_poll_seconds=0.1,
        # One loopback address only: a receiver on 127.0.0.2 is reachable but outside (test_webhooks).
        webhook_allow="127.0.0.1",
        webhook_retry_base_seconds=0.2,
        webhook_poll_seconds=0.2,
    )
    upgrade(s)
    return s


@pytest.fixture(scope="session")
def client(settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings)) as c:
        yield c


@pytest.fixture
def auth(settings) -> dict[str, str]:
    """Headers of a fresh tenant."""
    return {"Authorization": f"Bearer {new_key(settings)}"}


@pytest.fixture(scope="session")
def api_url(settings, tmp_path_factory) -> Iterator[str]:
    with running_api(settings, tmp_path_factory.mktemp("api")) as url:
        yield url


class SharedWorker:
    """The worker a test module's tests share, started on first use. A test that starts workers of
    its own stops it first, so that no job of that test runs anywhere else."""

    def __init__(self, settings: Settings, log_path: Path) -> None:
        self.settings, self.log_path, self.worker = settings, log_path, None

    def get(self) -> Worker:
        if self.worker is None or self.worker.proc.poll() is not None:
            self.worker = Worker(self.settings, self.log_path)
        return self.worker

    def stop(self) -> None:
        if self.worker is not None:
            self.worker.stop()
            self.worker = None


@pytest.fixture(scope="module")
def shared_worker(settings, tmp_path_factory) -> Iterator[SharedWorker]:
    shared = SharedWorker(settings, tmp_path_factory.mktemp("worker") / "worker.log")
    yield shared
    shared.stop()


@pytest.fixture
def worker(shared_worker, client, auth) -> Iterator[Worker]:
    """The module's shared worker, for a test that neither kills nor counts workers. The test's
    tenant (``auth``) is settled after it: what it left unfinished is cancelled and ended, so that
    the next test finds the worker idle."""
    yield shared_worker.get()
    settle(client, auth)


@pytest.fixture
def no_worker(shared_worker) -> None:
    """No worker runs during the test: the module's shared worker is stopped first."""
    shared_worker.stop()


@pytest.fixture
def start_worker(settings, tmp_path, shared_worker) -> Iterator[Callable[[], Worker]]:
    """Workers of this test alone, for a test that kills, stops or counts them (the module's shared
    worker is stopped first); stopped after it."""
    shared_worker.stop()
    workers: list[Worker] = []

    def start() -> Worker:
        w = Worker(settings, tmp_path / f"worker{len(workers)}.log")
        workers.append(w)
        return w

    yield start
    for w in workers:
        w.stop()


def settle(client: TestClient, auth: dict[str, str], timeout: float = 60) -> None:
    """Cancel the tenant's sweeps and unfinished jobs, and wait until every job has ended."""
    for sweep in client.get("/v1/sweeps", params={"limit": 100}, headers=auth).json()["data"]:
        client.post(f"/v1/sweeps/{sweep['id']}/cancel", headers=auth)

    def unfinished() -> list[str]:
        jobs = client.get("/v1/jobs", params={"limit": 100}, headers=auth).json()["data"]
        return [j["id"] for j in jobs if j["status"] in UNFINISHED]

    for job_id in unfinished():
        client.post(f"/v1/jobs/{job_id}/cancel", headers=auth)
    wait_for(lambda: not unfinished(), timeout=timeout, interval=0.2)
