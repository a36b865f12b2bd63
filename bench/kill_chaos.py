"""Worker kills: SIGKILL workers mid-job and check that no job is lost or run twice.

    .venv/bin/python bench/kill_chaos.py [--jobs 24] [--workers 2] [--kill-every 4] [--timeout 600] [--quick]

Starts its own API (`muonforge api`) and N Celery workers on a fresh Postgres database (dropped at the
end) and Redis db 12 (flushed), with 3 s leases. Submits small training jobs over HTTP, then
every --kill-every seconds SIGKILLs a random worker that holds a job's lease and starts a
replacement. A job is killed again only once it has written a new checkpoint since its last
kill, so that every job makes progress. Kills stop when all jobs are finished or at --timeout;
the jobs then get --grace seconds more. Then it checks, per job: it ended succeeded at the last
step; its status events read queued, (running, queued)*, running, succeeded; one "running"
event per attempt; checkpoints strictly increasing; loss and val_loss in the database summary
and in summary.json. Exits 1 if any check fails (logs and artifacts are then kept).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx
import psycopg
from stack import FINISHED, Stack, chaos_spec, check_job, pick_victim, task_outcomes

REDIS = "redis://127.0.0.1:6379/12"


def chaos(db: psycopg.Connection, cluster: Stack, kill_every: float, kill_until: float, grace: float):
    """Kill a job-holding worker every ``kill_every`` s (as soon as one is eligible) and start a
    replacement, until no job is queued or running; kills stop at ``kill_until``, the wait
    ``grace`` s later. Returns the kills as (job id, UTC time) and the count of workers that
    exited on their own (replaced too)."""
    kills, crashes, killed_at = [], 0, {}
    start, next_kill = time.monotonic(), time.monotonic() + kill_every
    while time.monotonic() < kill_until + grace:
        unfinished = db.execute("SELECT count(*) FROM jobs WHERE status <> ALL(%s)", (list(FINISHED),)).fetchone()[0]
        if unfinished == 0:
            break
        for pid in cluster.crashed_workers():
            print(f"  worker pid {pid} exited on its own; see its log", flush=True)
            crashes += 1
            cluster.start_worker()
        now = time.monotonic()
        if next_kill <= now < kill_until and (victim := pick_victim(db, cluster.workers, killed_at)):
            cluster.kill_worker(victim[0])
            kills.append((victim[1], datetime.now(UTC)))
            cluster.start_worker()
            next_kill = time.monotonic() + kill_every
            print(
                f"  {now - start:6.1f} s  kill {len(kills)}: worker {victim[0]} running {victim[1]}"
                f" ({unfinished} jobs left)",
                flush=True,
            )
        time.sleep(0.2)
    return kills, crashes


def recovery(db: psycopg.Connection, kills: list[tuple[str, datetime]]) -> dict[str, list[float]]:
    """Seconds from each kill to its job's next status events: back to "queued" (the lease
    expired and was reaped) and "running" again (a worker claimed the next attempt)."""
    delays: dict[str, list[float]] = {"queued": [], "running": []}
    for job_id, at in kills:
        rows = db.execute(
            "SELECT payload->>'status', created_at FROM job_events WHERE job_id = %s AND kind = 'status'"
            " AND created_at > %s ORDER BY id",
            (job_id, at),
        ).fetchall()
        for status in delays:
            first = next((t for s, t in rows if s == status), None)
            if first is not None:
                delays[status].append((first - at).total_seconds())
    return delays


def verify(db: psycopg.Connection, http: httpx.Client, jobs: dict[str, int], artifacts: Path) -> tuple[list, dict]:
    """Check every job's invariants (``stack.check_job``); returns (failures as "job: reason", counts)."""
    failures: list[str] = []
    counts = {"succeeded": 0, "lost": 0, "doubly_run": 0, "interrupted": 0, "max_attempts": 0, "resumes": 0}
    for job_id, steps in jobs.items():
        check = check_job(db, http, job_id, steps, artifacts)
        counts["lost" if check.lost else "succeeded"] += 1
        counts["doubly_run"] += bool(check.run_twice)
        failures += [f"{job_id}: {reason}" for reason in check.problems]
        counts["interrupted"] += check.attempt > 1
        counts["max_attempts"] = max(counts["max_attempts"], check.attempt)
        counts["resumes"] += check.resumes
    return failures, counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=24)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--kill-every", type=float, default=4.0, help="seconds between kills")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds after which the kills stop")
    parser.add_argument("--grace", type=float, default=120.0, help="seconds to wait for the jobs after --timeout")
    parser.add_argument("--steps", type=int, default=400, help="optimizer steps per job")
    parser.add_argument("--seed", type=int, default=0, help="seeds the choice of victims")
    parser.add_argument("--quick", action="store_true", help="6 jobs of 200 steps, 180 s timeout")
    args = parser.parse_args()
    if args.quick:
        args.jobs, args.steps, args.timeout = 6, 200, 180.0
    random.seed(args.seed)

    settings = {
        "MUONFORGE_LEASE_SECONDS": "3",
        "MUONFORGE_HEARTBEAT_SECONDS": "0.5",
        "MUONFORGE_REAPER_SECONDS": "0.5",
        "MUONFORGE_TENANT_JOB_CAP": "100000",
        "MUONFORGE_TENANT_RATE_PER_SECOND": "0",
        "MUONFORGE_TENANT_STREAM_CAP": "100000",
    }
    try:
        with Stack("chaos", REDIS, settings) as stack:
            ok = run(stack, args)
            stack.keep = not ok  # a failure keeps its logs and artifacts
            return 0 if ok else 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def run(stack: Stack, args: argparse.Namespace) -> bool:
    """Submit, kill, verify, report; True if every invariant holds."""
    headers = {"Authorization": f"Bearer {stack.api_key('chaos')}"}
    url = stack.start_api()
    for _ in range(args.workers):
        stack.start_worker()
    stack.wait_workers_ready(args.workers)
    with (
        httpx.Client(base_url=url, headers=headers, timeout=30) as http,
        psycopg.connect(stack.db_url, autocommit=True) as db,
    ):
        start = time.monotonic()
        jobs = {}
        for i in range(args.jobs):
            response = http.post("/v1/jobs", json=chaos_spec(args.steps, i))
            response.raise_for_status()
            jobs[response.json()["id"]] = args.steps
        print(f"submitted {len(jobs)} jobs of {args.steps} steps to {args.workers} workers", flush=True)
        kills, crashes = chaos(db, stack, args.kill_every, start + args.timeout, args.grace)
        wall = time.monotonic() - start
        failures, counts = verify(db, http, jobs, stack.tmp / "artifacts")
        delays = recovery(db, kills)
    failures += [f"{crashes} worker(s) exited on their own"] if crashes else []
    print(f"\njobs {len(jobs)} x {args.steps} steps, workers {args.workers}, kill every {args.kill_every:g} s")
    print(f"wall {wall:.1f} s{' (kills stopped at --timeout)' if wall > args.timeout else ''}")
    print(
        f"kills {len(kills)}; interrupted jobs (attempt > 1) {counts['interrupted']}; "
        f"max attempts {counts['max_attempts']}; resumes from a checkpoint {counts['resumes']}"
    )
    for status, values in delays.items():
        if values:
            print(f"kill -> {status:<7}: median {statistics.median(values):.2f} s, max {max(values):.2f} s")
    outcomes = task_outcomes(stack.logs)
    print(f"tasks that found their lease lost {outcomes['lease_lost']}; deliveries skipped {outcomes['skipped']}")
    print(f"succeeded {counts['succeeded']}; lost or stuck {counts['lost']}; run twice {counts['doubly_run']}")
    for failure in failures[:40]:
        print(f"  FAIL {failure}")
    target = counts["lost"] == counts["doubly_run"] == 0
    print(f"target (zero lost, zero doubly-run jobs): {'met' if target else 'NOT met'}")
    print(f"all invariants: {'hold' if not failures else f'{len(failures)} failure(s)'}")
    return not failures


if __name__ == "__main__":
    sys.exit(main())
