"""The service's real pieces for tests and benchmarks: throwaway Postgres databases, the
environment a service process reads, and `muonforge api` and `muonforge worker` processes."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis

from tests.support.net import free_port, http_ready, wait_for

ROOT = Path(__file__).resolve().parents[2]
PG_ADMIN = os.environ.get("MUONFORGE_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")


def unavailable(reason: str) -> None:
    """Skip with one line naming what this machine lacks, or fail where CI demands every test
    (MUONFORGE_TEST_REQUIRE_SERVICES=1)."""
    if os.environ.get("MUONFORGE_TEST_REQUIRE_SERVICES") == "1":
        pytest.fail(f"{reason} (MUONFORGE_TEST_REQUIRE_SERVICES=1)", pytrace=False)
    pytest.skip(reason)


def create_database(label: str = "test", admin: str = PG_ADMIN) -> str:
    """A new empty database on the Postgres server ``admin`` connects to; returns its name."""
    name = f"muonforge_{label}_{os.getpid()}_{secrets.token_hex(3)}"
    try:
        with psycopg.connect(admin, autocommit=True, connect_timeout=5) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
    except psycopg.OperationalError as exc:
        unavailable(f"needs Postgres at {admin} (MUONFORGE_TEST_PG): {str(exc).strip().splitlines()[0]}")
    return name


def drop_database(name: str, admin: str = PG_ADMIN) -> None:
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def database_url(name: str, admin: str = PG_ADMIN) -> str:
    """The SQLAlchemy URL of the database ``name`` beside ``admin``'s."""
    return admin.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://") + f"/{name}"


@contextmanager
def redis_server(log_path: Path | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """A throwaway redis-server (no persistence) from the installed binary, on a free port:
    (its URL, its process), once it answers; stopped (and resumed first, if paused) at the end."""
    server = shutil.which("redis-server")
    if server is None:
        unavailable("needs a redis-server binary")
    port = free_port()
    logfile = ["--logfile", str(log_path)] if log_path else []
    proc = subprocess.Popen(
        [str(server), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", *logfile],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    url = f"redis://127.0.0.1:{port}/0"
    try:
        client = redis.Redis.from_url(url, socket_timeout=1)
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    log = log_path.read_text()[-500:] if log_path and log_path.exists() else ""
                    unavailable(f"redis-server did not start: {log}")
                time.sleep(0.05)
        yield url, proc
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.terminate()
        proc.wait(timeout=10)


def clean_env(**settings: str) -> dict[str, str]:
    """This environment without any MUONFORGE_ setting, plus ``settings``; one torch thread."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MUONFORGE_")}
    return env | {"OMP_NUM_THREADS": "1"} | settings


def service_env(settings: Any) -> dict[str, str]:
    """What a service process started for ``settings`` (app.settings.Settings) reads."""
    return clean_env(
        MUONFORGE_DATABASE_URL=settings.database_url,
        MUONFORGE_REDIS_URL=settings.redis_url,
        MUONFORGE_ARTIFACT_DIR=str(settings.artifact_dir),
        MUONFORGE_CACHE_DIR=str(settings.cache_dir),
        MUONFORGE_LEASE_SECONDS=str(settings.lease_seconds),
        MUONFORGE_HEARTBEAT_SECONDS=str(settings.heartbeat_seconds),
        MUONFORGE_REAPER_SECONDS=str(settings.reaper_seconds),
        MUONFORGE_CANCEL_POLL_SECONDS=str(settings.cancel_poll_seconds),
        MUONFORGE_TENANT_JOB_CAP=str(settings.tenant_job_cap),
        MUONFORGE_TELEMETRY_FLUSH_SECONDS=str(settings.telemetry_flush_seconds),
        MUONFORGE_WEBHOOK_ALLOW=settings.webhook_allow,
        MUONFORGE_WEBHOOK_RETRY_BASE_SECONDS=str(settings.webhook_retry_base_seconds),
        MUONFORGE_WEBHOOK_POLL_SECONDS=str(settings.webhook_poll_seconds),
    )


def launch(args: list[str], env: Mapping[str, str], log_path: Path, **popen: Any) -> subprocess.Popen:
    """``muonforge ARGS`` from this checkout, its output appended to ``log_path``."""
    with log_path.open("ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "muonforge.cli", *args],
            cwd=ROOT,
            env=dict(env),
            stdout=log,
            stderr=subprocess.STDOUT,
            **popen,
        )


def wait_api(url: str, proc: subprocess.Popen, log_path: Path, timeout: float = 60) -> None:
    """Until the API at ``url`` is ready; raises with its log's tail if it exits first."""
    wait_for(lambda: http_ready(url) or proc.poll() is not None, timeout=timeout)
    if proc.poll() is not None:
        raise RuntimeError(f"the API exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")


def wait_worker(proc: subprocess.Popen, log_path: Path, timeout: float = 60) -> None:
    """Until the worker's log says Celery is consuming; raises with the log's tail otherwise."""
    deadline = time.monotonic() + timeout
    while b" ready." not in log_path.read_bytes():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the worker did not start:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.1)


def stop(proc: subprocess.Popen, timeout: float = 15) -> None:
    """SIGTERM, then SIGKILL what has not exited after ``timeout`` seconds."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def running_api(settings: Any, log_dir: Path, *args: str, **env: str) -> Iterator[str]:
    """A real `muonforge api` process (streaming responses need a real server); ``args`` are
    more options of `muonforge api` (one process unless they say ``--workers``), ``env`` more
    MUONFORGE_* settings. Yields its URL."""
    port = free_port()
    log_path = log_dir / "api.log"
    workers = [] if "--workers" in args else ["--workers", "1"]
    command = ["api", "--port", str(port), "--no-access-log", *workers, *args]
    proc = launch(command, {**service_env(settings), **env}, log_path)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_api(url, proc, log_path)
        yield url
    finally:
        stop(proc, timeout=20)


class Worker:
    """A real `celery worker` process (solo pool, one job at a time)."""

    def __init__(self, settings: Any, log_path: Path) -> None:
        self.log_path = log_path
        self.proc = launch(["worker", "--queues", "default,cpu"], service_env(settings), log_path)
        wait_worker(self.proc, log_path)

    def kill(self) -> None:
        """SIGKILL: no cleanup, the worker's lease just stops being renewed."""
        self.proc.kill()
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        stop(self.proc)
