"""Faults of four kinds (five with --store moto) under training jobs: no job lost, run twice or
failed, no telemetry point lost or stored twice, no gap in any follower's event stream.

    .venv/bin/python bench/chaos.py [--jobs 50] [--faults 100] [--seed 0] [--quick] [--store moto]
        [--json PATH]

Setup: a fresh Postgres database (dropped at the end), a redis-server of its own on a free port
(append-only file, as deployed), one API process and --workers Celery workers, the API and the
workers reaching Postgres through a TCP proxy (bench/faults.py), 3 s leases as in
bench/kill_chaos.py. Jobs are submitted over HTTP so that --in-flight are unfinished at any
time, and every job's event stream is followed from its submission to its ``done`` by
muonforge.AsyncClient (which resumes with Last-Event-ID), recording every event id and metrics
step received.

Faults, one at a time, --gap seconds apart (uniform), in an order drawn with --seed:
  worker    kill -9 of a worker that holds a running job's lease (as kill_chaos picks it), and a
            replacement started;
  api       kill -9 of the API while clients follow the jobs' streams, restarted on the same port;
  redis     kill -9 of redis-server, restarted on the same port 0.5-3 s later; or a pause
            (SIGSTOP, 2-8 s, then SIGCONT);
  postgres  a restart: the proxy drops every connection and refuses new ones for 1-5 s; and once,
            an outage of --outage seconds (30);
  store     with --store moto (the API and the workers on an S3 bucket of moto's server, started
            here): the server stopped, and started again on the same port 1-10 s later.
--faults and --jobs are minimums: faults go on (kinds drawn with the same weights) until --jobs
jobs have been submitted, and jobs are submitted until --faults faults are done.

Checks, once every job has finished: every job succeeded (else lost; failed ones are failed for
infrastructure: the jobs are valid); no job ran twice and every job's invariants hold
(stack.check_job); its stored ``loss`` history holds steps 0..N-1 each once; every follower got
each stored metrics step once, in order, every job event (seq 1..last) once, and a final
``done``; with a bucket, every checkpoint a job's rows record is in it with its recorded size.
Prints a table; exits 1 if a target is missed or an invariant fails (logs and artifacts are then
kept).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import statistics
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import psycopg
from faults import RedisServer, TcpProxy
from stack import FINISHED, PG_ADMIN, Stack, chaos_spec, check_job, free_port, pick_victim, task_outcomes

from app.storage.s3 import S3Store
from muonforge import AsyncClient, Client, MuonforgeError, Retry
from tests.support.s3 import BUCKET, MOTO_ENV, moto_server

STEP_BITS = 32  # an event id is seq << 32 | next step (app/services/event_stream.py)
# The clients wait through a 30 s outage: 120 retries, at most 2 s apart, counted afresh at every event.
PATIENT = Retry(max_retries=120, backoff=0.25, max_backoff=2.0, max_wait=60.0)
WEIGHTS = {"worker_kill": 35, "api_kill": 25, "redis_kill": 10, "redis_pause": 10, "pg_restart": 20}
KIND_OF = {
    "worker_kill": "worker",
    "api_kill": "api",
    "redis_kill": "redis",
    "redis_pause": "redis",
    "pg_restart": "postgres",
    "pg_outage": "postgres",
    "store_restart": "store",
}
STORE_WEIGHT = 15  # with --store: the share of the store's restarts


def plan(rng: random.Random, faults: int, weights: dict[str, int]):
    """Fault names: first ``faults`` of them in a random order, shares as ``weights`` says (at least
    one of each, one Postgres restart replaced by the outage), then, for as long as asked, more
    drawn with the same weights (no outage)."""
    counts = {name: max(1, round(faults * w / sum(weights.values()))) for name, w in weights.items()}
    counts["worker_kill"] += faults - sum(counts.values())
    counts["pg_restart"] -= 1
    first = [name for name, n in counts.items() for _ in range(n)] + ["pg_outage"]
    rng.shuffle(first)
    yield from first
    while True:
        yield rng.choices(list(weights), weights=list(weights.values()))[0]


@dataclass
class Fault:
    name: str
    at: float  # seconds since the start
    seconds: float  # how long it lasted (down, paused, cut), or how long the restart took
    running: int  # jobs running when it began
    followed: int  # open follower streams when it began
    detail: str = ""


class Followers:
    """Every job's event stream followed from its submission to its ``done``, each by a task of one
    asyncio loop in a thread of its own, through muonforge.AsyncClient (resumes with
    Last-Event-ID). ``received[job]``: (event, id, metrics step) in arrival order; ``losses[job]``:
    step -> the loss streamed (the first one, if a step came twice)."""

    def __init__(self, url: str, key: str) -> None:
        self.received: dict[str, list[tuple[str, str | None, int | None]]] = {}
        self.losses: dict[str, dict[int, float]] = {}
        self.errors: dict[str, str] = {}
        self.retries = 0  # reconnects and retried requests, all streams together
        self._futures: dict[str, object] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="followers", daemon=True)
        self._thread.start()
        self._client = self._run(self._make_client(url, key)).result(30)

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def _make_client(self, url: str, key: str) -> AsyncClient:
        return AsyncClient(url, key, retry=PATIENT, sleep=self._sleep)

    async def _sleep(self, delay: float) -> None:
        self.retries += 1
        await asyncio.sleep(delay)

    def follow(self, job_id: str) -> None:
        self.received[job_id], self.losses[job_id] = [], {}
        self._futures[job_id] = self._run(self._follow(job_id))

    async def _follow(self, job_id: str) -> None:
        got, losses = self.received[job_id], self.losses[job_id]
        try:
            async for event in self._client.events(job_id):
                step = event.data.get("step") if event.event == "metrics" else None
                got.append((event.event, event.id, step))
                if step is not None and "loss" in event.data["metrics"]:
                    losses.setdefault(step, event.data["metrics"]["loss"])
        except MuonforgeError as exc:
            self.errors[job_id] = f"{type(exc).__name__}: {exc}"

    def open(self) -> int:
        return sum(not f.done() for f in self._futures.values())

    def wait(self, timeout: float) -> int:
        """Until every stream has ended or ``timeout`` s; returns how many are still open."""
        deadline = time.monotonic() + timeout
        while self.open() and time.monotonic() < deadline:
            time.sleep(0.2)
        return self.open()

    def close(self) -> None:
        for future in self._futures.values():
            future.cancel()
        self._run(self._client.aclose()).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


class Chaos:
    """The deployment, its faults and its jobs."""

    def __init__(
        self,
        stack: Stack,
        redis_server: RedisServer,
        proxy: TcpProxy,
        args: argparse.Namespace,
        store: tuple[Any, S3Store] | None = None,
    ) -> None:
        """``store``: moto's server and the bucket the API and the workers use (None: the local store)."""
        self.stack, self.redis, self.proxy, self.args = stack, redis_server, proxy, args
        self.store, self.bucket = store if store is not None else (None, None)
        self.weights = {**WEIGHTS, "store_restart": STORE_WEIGHT} if store is not None else dict(WEIGHTS)
        self.rng = random.Random(args.seed)
        random.seed(args.seed)  # stack.pick_victim's choice
        self.db = psycopg.connect(stack.db_url, autocommit=True)  # direct, not through the proxy
        key = stack.api_key("chaos")
        self.url = stack.start_api()
        for _ in range(args.workers):
            stack.start_worker()
        stack.wait_workers_ready(args.workers)
        self.client = Client(self.url, key, retry=PATIENT)
        self.followers = Followers(self.url, key)
        self.key = key
        self.jobs: dict[str, int] = {}  # id -> steps
        self.faults: list[Fault] = []
        self.killed_at: dict[str, int] = {}
        self.crashes: list[str] = []
        self.start = time.monotonic()

    def now(self) -> float:
        return time.monotonic() - self.start

    def unfinished(self) -> int:
        return self.db.execute("SELECT count(*) FROM jobs WHERE status <> ALL(%s)", (list(FINISHED),)).fetchone()[0]

    def running(self) -> int:
        return self.db.execute("SELECT count(*) FROM jobs WHERE status = 'running'").fetchone()[0]

    def tick(self, submit: bool) -> None:
        """Replace processes that exited on their own; top the unfinished jobs up to --in-flight."""
        for pid in self.stack.crashed_workers():
            self.crashes.append(f"worker {pid} exited on its own at {self.now():.0f} s")
            self.stack.start_worker()
        if self.stack.api is not None and self.stack.api.poll() is not None:
            self.crashes.append(f"the API exited on its own ({self.stack.api.returncode}) at {self.now():.0f} s")
            self.stack.start_api(port=self.stack.api_port)
        if submit:
            for _ in range(self.args.in_flight - self.unfinished()):
                job = self.client.create_job(chaos_spec(self.args.steps, len(self.jobs)))
                self.jobs[job["id"]] = self.args.steps
                self.followers.follow(job["id"])

    def idle(self, seconds: float, submit: bool = True) -> None:
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            self.tick(submit)
            time.sleep(0.2)

    def inject(self, name: str) -> Fault:
        fault = Fault(name, self.now(), 0.0, self.running(), self.followers.open())
        t0 = time.monotonic()
        if name == "worker_kill":
            fault.detail = self.kill_worker()
        elif name == "api_kill":
            self.stack.kill_api()
            t0 = time.monotonic()
            self.stack.start_api(port=self.stack.api_port)
        elif name == "redis_kill":
            self.redis.kill()
            time.sleep(self.rng.uniform(0.5, 3.0))
            self.redis.start()
        elif name == "redis_pause":
            self.redis.pause()
            time.sleep(self.rng.uniform(2.0, 8.0))
            self.redis.resume()
        elif name in ("pg_restart", "pg_outage"):
            dropped = self.proxy.dropped
            self.proxy.cut()
            time.sleep(self.args.outage if name == "pg_outage" else self.rng.uniform(1.0, 5.0))
            self.proxy.restore()
            fault.detail = f"{self.proxy.dropped - dropped} connections dropped"
        elif name == "store_restart":
            self.store.stop()
            time.sleep(self.rng.uniform(1.0, 10.0))
            self.store.start()
        fault.seconds = time.monotonic() - t0
        return fault

    def kill_worker(self) -> str:
        """kill -9 a worker that holds a running job's lease (pick_victim), waiting up to 15 s for
        one; else any worker. A replacement is started."""
        deadline = time.monotonic() + 15
        while (victim := pick_victim(self.db, self.stack.workers, self.killed_at)) is None:
            if time.monotonic() > deadline:
                break
            self.tick(submit=True)
            time.sleep(0.2)
        if victim is None:
            victim = (random.choice(list(self.stack.workers)), None)
        pid, job_id = victim
        self.stack.kill_worker(pid)
        self.stack.start_worker()
        return f"running {job_id}" if job_id else "idle"

    def run(self) -> float:
        """Faults and jobs until both minimums are reached (or --timeout), then the jobs finish
        (--grace); returns the wall time."""
        self.tick(submit=True)
        names = plan(self.rng, self.args.faults, self.weights)
        while len(self.faults) < self.args.faults or len(self.jobs) < self.args.jobs:
            if self.now() > self.args.timeout:
                print(f"  --timeout: faults stop at {self.now():.0f} s", flush=True)
                break
            self.idle(self.rng.uniform(*self.args.gap), submit=True)
            fault = self.inject(next(names))
            self.faults.append(fault)
            print(
                f"  {fault.at:6.1f} s  {len(self.faults):3d} {fault.name:<11} {fault.seconds:5.1f} s  "
                f"running {fault.running}, followed {fault.followed}, jobs {len(self.jobs)}"
                f"{'  ' + fault.detail if fault.detail else ''}",
                flush=True,
            )
        deadline = time.monotonic() + self.args.grace
        while self.unfinished() and time.monotonic() < deadline:
            self.tick(submit=False)
            time.sleep(0.5)
        wall = self.now()
        self.followers.wait(60)
        return wall


@dataclass
class Result:
    failures: list[str]
    counts: Counter


def verify(chaos: Chaos) -> Result:
    """Every job's checks, its stored telemetry and its followers' streams."""
    failures: list[str] = []
    counts: Counter = Counter()
    headers = {"Authorization": f"Bearer {chaos.key}"}
    with httpx.Client(base_url=chaos.url, headers=headers, timeout=60) as http:
        for job_id, steps in chaos.jobs.items():
            check = check_job(chaos.db, http, job_id, steps, chaos.stack.tmp / "artifacts")
            counts["succeeded"] += not check.lost
            counts["lost"] += check.lost
            counts["failed"] += check.status == "failed"
            counts["run_twice"] += bool(check.run_twice)
            counts["interrupted"] += check.attempt > 1
            counts["attempts"] += check.attempt
            counts["max_attempts"] = max(counts["max_attempts"], check.attempt)
            counts["resumes"] += check.resumes
            problems = list(check.problems)
            counts["other"] += not check.lost and len(check.problems) > len(check.run_twice)

            series = http.get(f"/v1/jobs/{job_id}/metrics", params={"max_points": 100_000}).json()["series"]
            loss = [p[0] for s in series if s["name"] == "loss" for p in s["points"]]
            stored_loss = {p[0]: p[1] for s in series if s["name"] == "loss" for p in s["points"]}
            streamed = chaos.followers.losses.get(job_id, {})
            unlike = sum(stored_loss.get(step) != value for step, value in streamed.items())
            counts["values_unlike"] += unlike
            if unlike:
                problems.append(f"{unlike} streamed loss values unlike the stored ones")
            lost_points = len(set(range(steps)) - set(loss))
            twice_points = len(loss) - len(set(loss)) + len(set(loss) - set(range(steps)))
            counts["points"] += len(loss)
            counts["points_lost"] += lost_points
            counts["points_twice"] += twice_points
            if lost_points or twice_points:
                problems.append(f"loss history: {lost_points} steps missing, {twice_points} repeated or extra")

            stored = sorted({p[0] for s in series for p in s["points"]})
            rows = chaos.db.execute("SELECT seq FROM job_events WHERE job_id = %s ORDER BY seq", (job_id,))
            seqs = [seq for (seq,) in rows]
            gap = stream_problems(chaos.followers.received.get(job_id, []), stored, seqs)
            if job_id in chaos.followers.errors:
                gap.insert(0, f"gave up: {chaos.followers.errors[job_id]}")
            counts["stream_gaps"] += bool(gap)
            counts["events_received"] += len(chaos.followers.received.get(job_id, []))
            problems += [f"stream: {g}" for g in gap]
            if chaos.bucket is not None:
                problems += missing_from_store(chaos, job_id)
            failures += [f"{job_id}: {p}" for p in problems]
    return Result(failures, counts)


def missing_from_store(chaos: Chaos, job_id: str) -> list[str]:
    """The job's recorded checkpoints that are not in the bucket with their recorded size."""
    rows = chaos.db.execute("SELECT step, path, bytes FROM checkpoints WHERE job_id = %s", (job_id,)).fetchall()
    problems = []
    for step, key, size in rows:
        found = chaos.bucket.stat(key)
        if found is None or found.size != size:
            problems.append(f"checkpoint {step}: {'missing from' if found is None else 'another size in'} the bucket")
    return problems


def stream_problems(received: list[tuple[str, str | None, int | None]], steps: list[int], seqs: list[int]) -> list[str]:
    """What a follower's events lack or repeat against the job's history: every stored metrics
    step once, in order, every job event once, in order, ids increasing, one final ``done``."""
    problems = []
    if not received or received[-1][0] != "done" or sum(e == "done" for e, _, _ in received) != 1:
        problems.append(f"ends {received[-1][0] if received else 'with no event'}, not with one done")
    ids = [int(i) for e, i, _ in received if e != "done" and i is not None]
    if any(b <= a for a, b in itertools.pairwise(ids)):
        problems.append("event ids not increasing")
    got = [s for e, _, s in received if e == "metrics"]
    if got != steps:
        missing, repeated = sorted(set(steps) - set(got)), len(got) - len(set(got))
        order = "" if missing or repeated else ", out of order"
        problems.append(
            f"metrics steps: {len(missing)} missing {missing[:5]}, {repeated} repeated, "
            f"{len(set(got) - set(steps))} not stored{order}"
        )
    got_seqs = [int(i) >> STEP_BITS for e, i, _ in received if e not in ("metrics", "done")]
    if got_seqs != seqs:
        missing = sorted(set(seqs) - set(got_seqs))
        repeated = len(got_seqs) - len(set(got_seqs))
        problems.append(f"job events: {len(missing)} missing {missing[:5]}, {repeated} repeated")
    return problems


def report(chaos: Chaos, result: Result, wall: float) -> dict:
    """Print the table of targets and the figures around it; return them, with ``ok``: whether
    every target is met and every invariant holds."""
    c, args = result.counts, chaos.args
    by_name = Counter(f.name for f in chaos.faults)
    by_kind = Counter(KIND_OF[f.name] for f in chaos.faults)
    hold = sum(f.name == "worker_kill" and f.detail.startswith("running") for f in chaos.faults)
    seconds = {n: [f.seconds for f in chaos.faults if f.name == n] for n in by_name}
    span = {n: f"{min(v):.1f}-{max(v):.1f} s" for n, v in seconds.items()}
    outcomes = task_outcomes(chaos.stack.logs)
    print(
        f"\njobs {len(chaos.jobs)} x {args.steps} steps, {args.workers} workers, {args.in_flight} unfinished at "
        f"a time, seed {args.seed}; wall {wall:.0f} s"
    )
    print(f"faults {len(chaos.faults)}: " + ", ".join(f"{k} {n}" for k, n in sorted(by_kind.items())))
    print(
        f"  worker kill {by_name['worker_kill']} ({hold} holding a job's lease), API kill {by_name['api_kill']} "
        f"(restart {span.get('api_kill', '-')}), Redis kill {by_name['redis_kill']} "
        f"(down {span.get('redis_kill', '-')}), "
        f"Redis pause {by_name['redis_pause']} ({span.get('redis_pause', '-')}), Postgres restart "
        f"{by_name['pg_restart']} ({span.get('pg_restart', '-')}), Postgres outage {by_name['pg_outage']} "
        f"({span.get('pg_outage', '-')})"
    )
    api = [f for f in chaos.faults if f.name == "api_kill"]
    if api:
        print(
            f"  streams open at an API kill: median {statistics.median(f.followed for f in api):g}, "
            f"max {max(f.followed for f in api)}; jobs running at a fault: median "
            f"{statistics.median(f.running for f in chaos.faults):g}"
        )
    print(
        f"attempts {c['attempts']} ({c['interrupted']} jobs interrupted, max {c['max_attempts']}), resumes from a "
        f"checkpoint {c['resumes']}; tasks that found their lease lost {outcomes['lease_lost']}, deliveries "
        f"skipped {outcomes['skipped']}; client retries and reconnects {chaos.followers.retries}; events "
        f"streamed {c['events_received']}; loss points stored {c['points']}"
    )
    rows = [
        ("jobs", len(chaos.jobs), f">= {args.jobs}", len(chaos.jobs) >= args.jobs),
        (
            "faults",
            len(chaos.faults),
            f">= {args.faults}, all {len(set(KIND_OF[n] for n in chaos.weights))} kinds",
            len(chaos.faults) >= args.faults and len(by_kind) == len({KIND_OF[n] for n in chaos.weights}),
        ),
        ("lost jobs (not succeeded)", c["lost"], "0", c["lost"] == 0),
        ("jobs run twice", c["run_twice"], "0", c["run_twice"] == 0),
        ("jobs failed for infrastructure", c["failed"], "0", c["failed"] == 0),
        (
            "loss points lost / stored twice",
            f"{c['points_lost']} / {c['points_twice']}",
            "0 / 0",
            c["points_lost"] == c["points_twice"] == 0,
        ),
        ("jobs with a stream gap", c["stream_gaps"], "0", c["stream_gaps"] == 0),
        ("streamed loss values unlike stored", c["values_unlike"], "0", c["values_unlike"] == 0),
        ("jobs failing another invariant", c["other"], "0", c["other"] == 0),
    ]
    print(f"\n{'check':<34} {'result':>10}  {'target':<24} met")
    for name, value, target, met in rows:
        print(f"{name:<34} {value!s:>10}  {target:<24} {'yes' if met else 'NO'}")
    failures = chaos.crashes + result.failures
    for failure in failures[:40]:
        print(f"  FAIL {failure}")
    if len(failures) > 40:
        print(f"  ... {len(failures) - 40} more")
    ok = all(met for *_, met in rows) and not failures
    print(f"targets {'met' if ok else 'NOT met'}")
    return {
        "ok": ok,
        "seed": args.seed,
        "workers": args.workers,
        "steps": args.steps,
        "wall_s": round(wall, 1),
        "faults": dict(sorted(by_name.items())),
        "fault_seconds": span,
        "counts": c,
        "task_outcomes": outcomes,
        "client_retries": chaos.followers.retries,
        "targets": {name: [value, target, met] for name, value, target, met in rows},
        "failures": [str(f) for f in failures],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=50, help="jobs at least")
    parser.add_argument("--faults", type=int, default=100, help="faults at least")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--in-flight", type=int, default=4, help="unfinished jobs kept at a time")
    parser.add_argument("--steps", type=int, default=1600, help="optimizer steps per job")
    parser.add_argument("--gap", type=float, nargs=2, default=(2.0, 6.0), help="seconds between faults (uniform)")
    parser.add_argument("--outage", type=float, default=30.0, help="seconds of the Postgres outage")
    parser.add_argument("--timeout", type=float, default=1500.0, help="seconds after which the faults stop")
    parser.add_argument("--grace", type=float, default=300.0, help="seconds the jobs get to finish after the faults")
    parser.add_argument("--seed", type=int, default=0, help="seeds the faults' order, gaps, lengths and victims")
    parser.add_argument("--quick", action="store_true", help="6 jobs of 400 steps, 12 faults, a 10 s outage")
    parser.add_argument("--store", choices=["local", "moto"], default="local", help="moto: an S3 bucket, restarted")
    parser.add_argument("--json", type=Path, help="also write the figures and the targets to PATH")
    args = parser.parse_args()
    if args.quick:
        args.jobs, args.faults, args.steps, args.outage, args.in_flight = 6, 12, 400, 10.0, 3

    settings = {
        "MUONFORGE_LEASE_SECONDS": "3",
        "MUONFORGE_HEARTBEAT_SECONDS": "0.5",
        "MUONFORGE_REAPER_SECONDS": "0.5",
        "MUONFORGE_REQUEUE_AFTER_SECONDS": "20",
        "MUONFORGE_TENANT_JOB_CAP": "100000",
        "MUONFORGE_TENANT_RATE_PER_SECOND": "0",
        "MUONFORGE_TENANT_STREAM_CAP": "100000",
    }
    store_server = store = None
    if args.store == "moto":
        store_server, endpoint = moto_server()
        httpx.put(f"{endpoint}/{BUCKET}", timeout=10).raise_for_status()
        reach = {**MOTO_ENV, "AWS_ENDPOINT_URL": endpoint}
        settings |= {**reach, "MUONFORGE_ARTIFACT_URL": f"s3://{BUCKET}/chaos"}
        store = (store_server, S3Store.from_url(f"s3://{BUCKET}/chaos", env=reach))
    pg = urlsplit(PG_ADMIN)
    proxy = TcpProxy((pg.hostname or "127.0.0.1", pg.port or 5432))
    redis_port = free_port()
    stack = Stack("chaos", f"redis://127.0.0.1:{redis_port}/0", settings, db_port=proxy.port)
    redis_server = RedisServer(redis_port, stack.tmp / "redis", stack.logs / "redis.log")
    try:
        redis_server.start()
        try:
            with stack:
                chaos = Chaos(stack, redis_server, proxy, args, store)
                try:
                    wall = chaos.run()
                    figures = report(chaos, verify(chaos), wall)
                    ok = figures["ok"]
                    if args.json:
                        args.json.write_text(json.dumps(figures, indent=2, default=str))
                finally:
                    chaos.followers.close()
                    chaos.client.close()
                    chaos.db.close()
                stack.keep = not ok
                return 0 if ok else 1
        finally:
            redis_server.close()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        proxy.close()
        if store_server is not None:
            store_server.stop()


if __name__ == "__main__":
    sys.exit(main())
