"""Fixtures on the real services: a fresh Postgres database migrated for this run, a Redis
database, the API in-process (FastAPI TestClient) and Celery workers as real processes."""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import psycopg
import pytest
import redis
from fastapi.testclient import TestClient

from app.db.migrate import upgrade
from app.db.session import transaction
from app.main import create_app
from app.services.auth import create_api_key
from app.settings import Settings

PG_ADMIN = os.environ.get("MUONFORGE_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")
REDIS = os.environ.get("MUONFORGE_TEST_REDIS")  # unset: a throwaway redis-server for this run
REDIS_FALLBACK = "redis://127.0.0.1:6379/13"  # where no redis-server binary is installed
ROOT = Path(__file__).resolve().parents[2]


def unavailable(reason: str):
    """Skip with one line naming what this machine lacks, or fail where CI demands every test
    (MUONFORGE_TEST_REQUIRE_SERVICES=1)."""
    if os.environ.get("MUONFORGE_TEST_REQUIRE_SERVICES") == "1":
        pytest.fail(f"{reason} (MUONFORGE_TEST_REQUIRE_SERVICES=1)", pytrace=False)
    pytest.skip(reason)


def _create_database() -> str:
    name = f"muonforge_test_{os.getpid()}_{secrets.token_hex(3)}"
    try:
        with psycopg.connect(PG_ADMIN, autocommit=True, connect_timeout=5) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
    except psycopg.OperationalError as exc:
        unavailable(f"needs Postgres at {PG_ADMIN} (MUONFORGE_TEST_PG): {str(exc).strip().splitlines()[0]}")
    return name


def _drop_database(name: str) -> None:
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def database_url() -> Iterator[str]:
    """A database of its own on the Postgres server, dropped at the end."""
    name = _create_database()
    base = PG_ADMIN.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://")
    yield f"{base}/{name}"
    _drop_database(name)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
    port = free_port()
    log = tmp_path_factory.mktemp("redis") / "redis.log"
    proc = subprocess.Popen(
        [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--logfile", str(log)],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"redis://127.0.0.1:{port}/0"
    try:
        client = redis.Redis.from_url(url)
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    unavailable(f"redis-server did not start: {log.read_text()[-500:] if log.exists() else ''}")
                time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture(scope="session")
def settings(database_url, redis_url, tmp_path_factory) -> Settings:
    s = Settings(
        database_url=database_url,
        redis_url=redis_url,
        artifact_dir=tmp_path_factory.mktemp("artifacts"),
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


def service_env(settings: Settings) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MUONFORGE_")}
    env.update(
        MUONFORGE_DATABASE_URL=settings.database_url,
        MUONFORGE_REDIS_URL=settings.redis_url,
        MUONFORGE_ARTIFACT_DIR=str(settings.artifact_dir),
        MUONFORGE_LEASE_SECONDS=str(settings.lease_seconds),
        MUONFORGE_HEARTBEAT_SECONDS=str(settings.heartbeat_seconds),
        MUONFORGE_REAPER_SECONDS=str(settings.reaper_seconds),
        MUONFORGE_CANCEL_POLL_SECONDS=str(settings.cancel_poll_seconds),
        MUONFORGE_TENANT_JOB_CAP=str(settings.tenant_job_cap),
        MUONFORGE_TELEMETRY_FLUSH_SECONDS=str(settings.telemetry_flush_seconds),
        MUONFORGE_WEBHOOK_ALLOW=settings.webhook_allow,
        MUONFORGE_WEBHOOK_RETRY_BASE_SECONDS=str(settings.webhook_retry_base_seconds),
        MUONFORGE_WEBHOOK_POLL_SECONDS=str(settings.webhook_poll_seconds),
        OMP_NUM_THREADS="1",
    )
    return env


@pytest.fixture(scope="session")
def client(settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings)) as c:
        yield c


def new_key(settings: Settings, tenant: str | None = None) -> str:
    with transaction(settings) as session:
        return create_api_key(session, tenant or f"tenant-{secrets.token_hex(4)}")


@pytest.fixture
def auth(settings) -> dict[str, str]:
    """Headers of a fresh tenant."""
    return {"Authorization": f"Bearer {new_key(settings)}"}


@contextmanager
def running_api(settings: Settings, log_dir: Path, *args: str, **env: str) -> Iterator[str]:
    """A real `muonforge api` process (streaming responses need a real server); ``args`` are
    more options of `muonforge api`, ``env`` more MUONFORGE_* settings. Yields its URL."""
    port = free_port()
    log_path = log_dir / "api.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "muonforge.cli", "api", "--port", str(port), "--no-access-log", *args],
            cwd=ROOT, env={**service_env(settings), **env}, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _ready(url) or proc.poll() is not None, timeout=60)
        if proc.poll() is not None:
            raise RuntimeError(f"the API did not start:\n{log_path.read_text()[-3000:]}")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=20)


@pytest.fixture(scope="session")
def api_url(settings, tmp_path_factory) -> Iterator[str]:
    with running_api(settings, tmp_path_factory.mktemp("api")) as url:
        yield url


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/readyz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


class Worker:
    """A real `celery worker` process (solo pool, one job at a time)."""

    def __init__(self, settings: Settings, log_path: Path) -> None:
        self.log_path = log_path
        cmd = [sys.executable, "-m", "muonforge.cli", "worker", "--queues", "default,cpu"]
        self.log = log_path.open("ab")
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env=service_env(settings), stdout=self.log, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + 60
        while b" ready." not in log_path.read_bytes():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"worker did not start:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.2)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


@pytest.fixture
def start_worker(settings, tmp_path):
    workers: list[Worker] = []

    def start() -> Worker:
        w = Worker(settings, tmp_path / f"worker{len(workers)}.log")
        workers.append(w)
        return w

    yield start
    for w in workers:
        w.stop()


def wait_for(predicate, timeout: float = 60.0, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError("condition not met in time")


def tiny_spec(steps: int = 20, **train) -> dict:
    return {
        "name": "tiny",
        "model": {"arch": "gpt", "n_layer": 1, "n_head": 2, "d_model": 16, "seq_len": 16},
        "data": {"builtin": "synthetic"},
        "train": {"steps": steps, "batch_size": 4, "eval_every": 10, "checkpoint_every": 10, **train},
    }
