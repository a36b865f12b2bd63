"""What the service benchmarks share beyond tests/support (the throwaway deployment, ports, job
specs): jobs under faults, and CPU accounting per process group with the time the hypervisor
stole from the machine."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psycopg

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the benchmarks run as scripts: tests.support from this checkout

from contract.status import FINISHED as FINISHED_STATUSES  # noqa: E402
from tests.support.net import free_port  # noqa: E402
from tests.support.services import PG_ADMIN  # noqa: E402
from tests.support.specs import chaos_spec  # noqa: E402
from tests.support.stack import Stack  # noqa: E402

__all__ = ["FINISHED", "PG_ADMIN", "ROOT", "Stack", "chaos_spec", "free_port"]


# -- jobs under faults (bench/kill_chaos.py, bench/chaos.py) --------------------------------------
FINISHED = sorted(str(s) for s in FINISHED_STATUSES)  # as stored
STATUS_SEQUENCE = re.compile(r"queued( running queued)* running succeeded")


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
        if statuses.count("running") != attempt
        else "",
        f"{statuses.count('succeeded')} succeeded events" if statuses.count("succeeded") != 1 else "",
        f"{resumes} resumes in {attempt} attempts" if resumes > attempt - 1 else "",
    ]
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
