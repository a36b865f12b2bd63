"""A throwaway deployment on this machine's Postgres and Redis for the benchmarks and the tests
that start the service as an operator would: a fresh database, migrations, API keys, API and
worker processes, all stopped at the end.

    with Stack("api_load", "redis://127.0.0.1:6379/14", {"MUONFORGE_TENANT_JOB_CAP": "10000000"}) as stack:
        key = stack.api_key("load")
        url = stack.start_api(processes=1)
        ...
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import redis

from tests.support.net import free_port
from tests.support.services import (
    PG_ADMIN,
    ROOT,
    clean_env,
    create_database,
    database_url,
    drop_database,
    launch,
    stop,
    wait_api,
)


class Stack:
    """A fresh Postgres database (dropped on exit), a flushed Redis database, an artifact
    directory, and every process started through it (stopped on exit). Logs and artifacts are
    kept when the block raises or ``keep`` is set, and deleted otherwise."""

    def __init__(
        self, label: str, redis_url: str, settings: dict[str, str] | None = None, db_port: int | None = None
    ) -> None:
        """``db_port``: where the processes started here reach Postgres (a proxy in front of it);
        ``db_url`` (the bench's own connections) goes to the server directly."""
        self.label, self.redis_url, self.db_port = label, redis_url, db_port
        self.name = self.db_url = ""  # the database's, once created
        self.tmp = Path(tempfile.mkdtemp(prefix=f"{label}_"))
        self.logs = self.tmp / "logs"
        self.logs.mkdir()
        self.env = clean_env(
            MUONFORGE_REDIS_URL=redis_url,
            MUONFORGE_ARTIFACT_DIR=str(self.tmp / "artifacts"),
            MUONFORGE_CACHE_DIR=str(self.tmp / "cache"),
            **(settings or {}),
        )
        self.procs: list[subprocess.Popen] = []
        self.workers: dict[int, subprocess.Popen] = {}  # pid -> live worker
        self.api: subprocess.Popen | None = None
        self.api_port: int | None = None
        self.keep = False

    def __enter__(self) -> Stack:
        self.name = create_database(self.label)
        self.db_url = PG_ADMIN.rsplit("/", 1)[0] + f"/{self.name}"
        via = urlsplit(database_url(self.name))
        if self.db_port is not None:
            via = via._replace(netloc=f"{via.username or 'postgres'}@127.0.0.1:{self.db_port}")
        self.env["MUONFORGE_DATABASE_URL"] = urlunsplit(via)
        redis.Redis.from_url(self.redis_url).flushdb()
        self.muonforge("migrate")
        return self

    def __exit__(self, exc_type, *_) -> None:
        self.close()
        drop_database(self.name)
        if exc_type is None and not self.keep:
            shutil.rmtree(self.tmp, ignore_errors=True)
        else:
            print(f"logs and artifacts kept in {self.tmp}", file=sys.stderr)

    def muonforge(self, *args: str) -> str:
        """Run a muonforge command to completion; returns its standard output."""
        cmd = [sys.executable, "-m", "muonforge.cli", *args]
        return subprocess.run(cmd, env=self.env, cwd=ROOT, check=True, capture_output=True, text=True).stdout

    def api_key(self, tenant: str) -> str:
        return self.muonforge("keys", "create", "--tenant", tenant).strip().splitlines()[-1]

    def _start(self, args: list[str], log_name: str, cpus: set[int] | None = None) -> subprocess.Popen:
        pin = None if cpus is None else lambda: os.sched_setaffinity(0, cpus)
        proc = launch(args, self.env, self.logs / log_name, preexec_fn=pin)
        self.procs.append(proc)
        return proc

    def start_api(self, processes: int = 1, port: int | None = None, cpus: set[int] | None = None) -> str:
        """`muonforge api` (no access log) on ``port`` (else a free one), on the CPUs ``cpus`` alone
        if given (its threads and processes inherit them); returns its URL once /readyz answers 200."""
        port = self.api_port = port or free_port()
        args = ["api", "--port", str(port), "--workers", str(processes), "--no-access-log"]
        self.api = self._start(args, "api.log", cpus)
        url = f"http://127.0.0.1:{port}"
        wait_api(url, self.api, self.logs / "api.log")
        return url

    def start_worker(self, queues: str = "default,cpu") -> int:
        """A `muonforge worker` (solo pool, one job at a time); returns its pid."""
        proc = self._start(["worker", "--queues", queues], f"worker-{len(self.procs)}.log")
        self.workers[proc.pid] = proc
        return proc.pid

    def wait_workers_ready(self, count: int, timeout: float = 120.0) -> None:
        """Until ``count`` worker logs say " ready." (Celery is consuming)."""
        deadline = time.monotonic() + timeout
        while sum(b" ready." in p.read_bytes() for p in self.logs.glob("worker-*.log")) < count:
            if time.monotonic() > deadline:
                raise RuntimeError(f"workers did not start; see {self.logs}")
            time.sleep(0.2)

    def kill_api(self) -> None:
        """SIGKILL the API (one process: ``start_api(processes=1)``); start it again with
        ``start_api(port=stack.api_port)``."""
        assert self.api is not None, "start_api() first"
        self.api.send_signal(signal.SIGKILL)
        self.api.wait(timeout=10)

    def crashed_workers(self) -> list[int]:
        """Workers that exited without being killed (forgotten here; the caller replaces them)."""
        dead = [pid for pid, proc in self.workers.items() if proc.poll() is not None]
        for pid in dead:
            del self.workers[pid]
        return dead

    def kill_worker(self, pid: int) -> None:
        """SIGKILL: no cleanup, the worker's lease just stops being renewed."""
        proc = self.workers.pop(pid)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)

    def close(self) -> None:
        """SIGTERM everything still running, then SIGKILL what has not exited after 20 s."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            stop(proc, timeout=20)
