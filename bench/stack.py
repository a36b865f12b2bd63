"""What the service benchmarks share: a throwaway deployment on this machine's Postgres and Redis
(a fresh database, migrations, API keys, API and worker processes, all stopped at the end) and
CPU accounting per process group, with the time the hypervisor stole from the machine.

    with Stack("api_load", "redis://127.0.0.1:6379/14", {"MUONFORGE_TENANT_JOB_CAP": "10000000"}) as stack:
        key = stack.api_key("load")
        url = stack.start_api(processes=1)
        ...
"""

from __future__ import annotations

import json
import os
import random
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import httpx
import psycopg
import redis

ROOT = Path(__file__).resolve().parents[1]
PG_ADMIN = os.environ.get("MUONFORGE_BENCH_PG", "postgresql://postgres@127.0.0.1:5432/postgres")


def free_port() -> int:
    """A TCP port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Stack:
    """A fresh Postgres database (dropped on exit), a flushed Redis database, an artifact
    directory, and every process started through it (stopped on exit). Logs and artifacts are
    kept when the block raises or ``keep`` is set, and deleted otherwise."""

    def __init__(
        self, label: str, redis_url: str, settings: dict[str, str] | None = None, db_port: int | None = None
    ) -> None:
        """``db_port``: where the processes started here reach Postgres (a proxy in front of it);
        ``db_url`` (the bench's own connections) goes to the server directly."""
        self.name = f"muonforge_{label}_{secrets.token_hex(3)}"
        self.db_url = PG_ADMIN.rsplit("/", 1)[0] + f"/{self.name}"
        via = urlsplit(self.db_url)
        if db_port is not None:
            via = via._replace(netloc=f"{via.username or 'postgres'}@127.0.0.1:{db_port}")
        self.redis_url = redis_url
        self.tmp = Path(tempfile.mkdtemp(prefix=f"{label}_"))
        self.logs = self.tmp / "logs"
        self.logs.mkdir()
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("MUONFORGE_")}
        self.env.update(
            MUONFORGE_DATABASE_URL=urlunsplit(via).replace("postgresql://", "postgresql+psycopg://"),
            MUONFORGE_REDIS_URL=redis_url, MUONFORGE_ARTIFACT_DIR=str(self.tmp / "artifacts"), OMP_NUM_THREADS="1",
            **(settings or {}),
        )  # fmt: skip
        self.procs: list[subprocess.Popen] = []
        self.workers: dict[int, subprocess.Popen] = {}  # pid -> live worker
        self.api: subprocess.Popen | None = None
        self.api_port: int | None = None
        self.keep = False

    def __enter__(self) -> Stack:
        with psycopg.connect(PG_ADMIN, autocommit=True) as admin:
            admin.execute(f'CREATE DATABASE "{self.name}"')
        redis.Redis.from_url(self.redis_url).flushdb()
        self.muonforge("migrate")
        return self

    def __exit__(self, exc_type, *_) -> None:
        self.close()
        with psycopg.connect(PG_ADMIN, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')
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
        cmd = [sys.executable, "-m", "muonforge.cli", *args]
        pin = None if cpus is None else lambda: os.sched_setaffinity(0, cpus)
        with (self.logs / log_name).open("ab") as log:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=pin)
        self.procs.append(proc)
        return proc

    def start_api(self, processes: int = 1, port: int | None = None, cpus: set[int] | None = None) -> str:
        """`muonforge api` (no access log) on ``port`` (else a free one), on the CPUs ``cpus`` alone
        if given (its threads and processes inherit them); returns its URL once /readyz answers 200."""
        port = self.api_port = port or free_port()
        args = ["api", "--port", str(port), "--processes", str(processes), "--no-access-log"]
        self.api = self._start(args, "api.log", cpus)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.api.poll() is not None:
                raise RuntimeError(f"the API exited with {self.api.returncode}; see {self.logs / 'api.log'}")
            try:
                with urllib.request.urlopen(f"{url}/readyz", timeout=1) as response:
                    if response.status == 200:
                        return url
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError("the API did not become ready")

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
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# -- jobs under faults (bench/kill_chaos.py, bench/chaos.py) --------------------------------------
FINISHED = ("succeeded", "failed", "cancelled")
STATUS_SEQUENCE = re.compile(r"queued( running queued)* running succeeded")


def job_spec(steps: int, index: int) -> dict:
    """A tiny GPT on the builtin synthetic task: about 1 s per 100 steps on one CPU thread,
    checkpoints and evals every steps / 4. max_restarts is the cap (10) so that a job that is
    interrupted often does not end worker_lost."""
    every = steps // 4
    train = {"steps": steps, "batch_size": 4, "eval_every": every, "checkpoint_every": every, "max_restarts": 10}
    return {
        "name": f"chaos-{index}",
        "model": {"arch": "gpt", "n_layer": 1, "n_head": 2, "d_model": 16, "seq_len": 16},
        "data": {"builtin": "synthetic"},
        "train": train | {"seed": index},
    }


def pick_victim(
    db: psycopg.Connection, workers: dict[int, subprocess.Popen], killed_at: dict[str, int]
) -> tuple[int, str] | None:
    """(pid, job id) of a random live worker that holds a running job's lease, among jobs never
    killed or with a newer checkpoint than at their last kill; None if there is none. Without the
    checkpoint rule a job can be killed every time before it reaches a checkpoint (a livelock)."""
    rows = db.execute(
        "SELECT j.id, j.lease_owner, COALESCE(MAX(c.step), 0) FROM jobs j LEFT JOIN checkpoints c"
        " ON c.job_id = j.id WHERE j.status = 'running' AND j.lease_owner IS NOT NULL GROUP BY j.id"
    ).fetchall()
    candidates = []
    for job_id, owner, checkpoint in rows:
        pid = int(owner.split(":")[1])  # host:pid:task id
        if pid in workers and checkpoint > killed_at.get(job_id, -1):
            candidates.append((pid, job_id, checkpoint))
    if not candidates:
        return None
    pid, job_id, checkpoint = random.choice(candidates)
    killed_at[job_id] = checkpoint
    return pid, job_id


@dataclass
class JobCheck:
    """One finished job's checks: ``run_twice`` holds the signs that two attempts ran the same
    steps, ``problems`` every failed check (those included)."""

    status: str
    error: dict | None
    attempt: int
    resumes: int  # "resumed from" log lines
    run_twice: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def lost(self) -> bool:
        return self.status != "succeeded"


def check_job(db: psycopg.Connection, http: httpx.Client, job_id: str, steps: int, artifacts: Path) -> JobCheck:
    """From the database and ``GET /v1/jobs/{id}``: the job ended succeeded at the last step with
    no lease owner; its status events read queued (running queued)* running succeeded, with one
    running event per attempt and no more resumes than attempts after the first; checkpoint
    events strictly increasing up to the last step; loss and val_loss in the summary and in
    summary.json."""
    api = http.get(f"/v1/jobs/{job_id}").json()
    status, attempt, owner = db.execute(
        "SELECT status, attempt, lease_owner FROM jobs WHERE id = %s", (job_id,)
    ).fetchone()
    events = db.execute("SELECT kind, payload FROM job_events WHERE job_id = %s ORDER BY seq", (job_id,)).fetchall()
    statuses = [p["status"] for kind, p in events if kind == "status"]
    checkpoints = [p["step"] for kind, p in events if kind == "checkpoint"]
    resumes = sum(kind == "log" and "resumed from" in p["message"] for kind, p in events)
    check = JobCheck(status, api.get("error"), attempt, resumes)
    if status != "succeeded" or api["status"] != "succeeded":
        check.problems.append(f"ended {status} (API: {api['status']}, error {api['error']})")
    check.run_twice = [
        f"status events {statuses}" if not STATUS_SEQUENCE.fullmatch(" ".join(statuses)) else "",
        f"{statuses.count('running')} running events, attempt {attempt}"
        if statuses.count("running") != attempt else "",
        f"{statuses.count('succeeded')} succeeded events" if statuses.count("succeeded") != 1 else "",
        f"{resumes} resumes in {attempt} attempts" if resumes > attempt - 1 else "",
    ]  # fmt: skip
    check.run_twice = [r for r in check.run_twice if r]
    check.problems += check.run_twice
    if api["progress"] != {"step": steps, "total_steps": steps}:
        check.problems.append(f"progress {api['progress']}")
    if checkpoints != sorted(set(checkpoints)) or not checkpoints or checkpoints[-1] != steps:
        check.problems.append(f"checkpoint events {checkpoints}")
    if owner is not None:
        check.problems.append(f"lease_owner still {owner}")
    if api["summary"].get("loss") is None or api["summary"].get("val_loss") is None:
        check.problems.append(f"summary {api['summary']}")
    summary_file = artifacts / "jobs" / job_id / "summary.json"
    on_disk = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
    if on_disk.get("steps") != steps or on_disk.get("loss") is None or on_disk.get("val_loss") is None:
        check.problems.append(f"summary.json {on_disk or 'missing'}")
    return check


def task_outcomes(logs: Path) -> dict[str, int]:
    """How the workers' tasks ended, from celery's "succeeded in ...: 'outcome'" log lines:
    'lease_lost' is an attempt that outlived its lease (fenced off), 'skipped' a delivery for a
    job that was not queued (a duplicate send)."""
    text = "\n".join(p.read_text(errors="replace") for p in logs.glob("worker-*.log"))
    return {
        outcome: len(re.findall(rf"succeeded in [0-9.]+s: '{outcome}'", text)) for outcome in ("lease_lost", "skipped")
    }


def processes() -> dict[int, tuple[str, int, float]]:
    """pid -> (command name, parent pid, CPU seconds so far) of every process, from /proc."""
    tick, procs = os.sysconf("SC_CLK_TCK"), {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            comm = stat[stat.index("(") + 1 : stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2 :].split()
            procs[int(entry)] = (comm, int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
    return procs


class CpuMeter:
    """CPU used over a window by process groups, from /proc (Linux only): the API (the process
    ``api_pid`` and its children), Postgres, Redis and this process; and the machine's busy and
    stolen time. Processes that exit inside the window (a closed Postgres connection) are missed."""

    def __init__(self, api_pid: int | None) -> None:
        self.api_pid = api_pid
        self.tick = os.sysconf("SC_CLK_TCK")
        self._start: tuple[dict[int, tuple[str, float]], list[int]] | None = None
        self._t0 = 0.0

    def _snapshot(self) -> dict[int, tuple[str, float]]:
        """pid -> (group, CPU seconds so far) of every process in a group."""
        procs = processes()
        api = {self.api_pid} if self.api_pid else set()
        grew = True
        while grew:  # the API's process tree (uvicorn's workers)
            children = {pid for pid, (_, ppid, _) in procs.items() if ppid in api} - api
            api |= children
            grew = bool(children)
        out = {}
        for pid, (comm, _, cpu) in procs.items():
            if pid in api:
                out[pid] = ("api", cpu)
            elif comm == "postgres":
                out[pid] = ("postgres", cpu)
            elif comm.startswith("redis-server"):
                out[pid] = ("redis", cpu)
        own = os.times()
        out[os.getpid()] = ("load generator", own.user + own.system)
        return out

    @staticmethod
    def _machine() -> list[int]:
        with open("/proc/stat") as f:
            return [int(v) for v in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal

    def start(self) -> None:
        self._start = (self._snapshot(), self._machine())
        self._t0 = time.perf_counter()

    def stop(self) -> dict[str, float]:
        """Cores used per group over the window, plus "machine busy" and "stolen" (cores)."""
        assert self._start is not None, "start() first"
        wall = time.perf_counter() - self._t0
        procs0, machine0 = self._start
        procs1, machine1 = self._snapshot(), self._machine()
        out = dict.fromkeys(("api", "postgres", "redis", "load generator"), 0.0)
        for pid, (group, cpu) in procs1.items():  # a process started in the window counts from 0
            out[group] += (cpu - procs0.get(pid, (group, 0.0))[1]) / wall
        delta = [b - a for a, b in zip(machine0, machine1)]
        out["machine busy"] = (sum(delta) - delta[3] - delta[4] - delta[7]) / self.tick / wall
        out["stolen"] = delta[7] / self.tick / wall
        return out
