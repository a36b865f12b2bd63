"""Webhook delivery latency on a throwaway deployment (tests/support/stack.py): one API process (its
delivery thread sends), real Postgres and Redis, a receiver on loopback.

The latency of a delivery is the time from the commit of the job's final status (its row's
``finished_at``, taken in that transaction, so the figure includes the commit itself) to the
moment the receiver has read the whole request. Jobs are queued with no worker and cancelled
through the API, so each cancel commits a final status and queues one ``job.cancelled``
delivery; with ``--workers`` some jobs also run to ``job.succeeded`` on real workers.

1. steady: ``--jobs`` cancels spread over ``--seconds`` (a job ending every few tens of ms);
2. burst: ``--burst`` cancels at once (many jobs of a tenant ending together);
3. succeeded: ``--workers`` workers run ``--succeeded`` tiny jobs to their end (0: skipped).

    python bench/webhooks.py [--jobs 200] [--seconds 10] [--burst 100] [--workers 1] [--succeeded 4] [--json PATH]

Target (issue 12): delivery p99 <= 2 s after the job's final status is committed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import psycopg
from stack import Stack

REDIS = "redis://127.0.0.1:6379/14"
SPEC = {
    "model": {"arch": "gpt", "n_layer": 1, "n_head": 2, "d_model": 16, "seq_len": 16},
    "data": {"builtin": "synthetic"},
    "train": {"steps": 20, "batch_size": 4, "eval_every": 10, "checkpoint_every": 10},
    "telemetry": {"every": 5, "sample_tokens": 0},
}
TARGET_P99_S = 2.0


class Receiver:
    """An HTTP server on loopback that answers 200 to every POST and keeps, per job, when its
    delivery arrived (wall clock, after the body was read) and its event type."""

    def __init__(self) -> None:
        self.arrivals: dict[str, tuple[float, str]] = {}
        self.count = 0
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                at = time.time()
                message = json.loads(body)
                receiver.arrivals.setdefault(message["data"]["id"], (at, message["type"]))
                receiver.count += 1
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait(self, jobs: set[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not jobs <= self.arrivals.keys() and time.monotonic() < deadline:
            time.sleep(0.05)


async def submit(client: httpx.AsyncClient, n: int) -> list[str]:
    answers = await asyncio.gather(*(client.post("/v1/jobs", json=SPEC) for _ in range(n)))
    assert all(r.status_code == 201 for r in answers), [r.text for r in answers if r.status_code != 201][:1]
    return [r.json()["id"] for r in answers]


async def cancel(client: httpx.AsyncClient, jobs: list[str], seconds: float) -> None:
    """Cancel ``jobs`` spread evenly over ``seconds`` (0: all at once)."""
    if not seconds:
        answers = await asyncio.gather(*(client.post(f"/v1/jobs/{j}/cancel") for j in jobs))
    else:
        gap, start, answers = seconds / len(jobs), time.perf_counter(), []
        for i, job in enumerate(jobs):
            await asyncio.sleep(max(0.0, start + i * gap - time.perf_counter()))
            answers.append(await client.post(f"/v1/jobs/{job}/cancel"))
    assert all(r.json()["status"] == "cancelled" for r in answers)


def latencies(db_url: str, receiver: Receiver, jobs: list[str]) -> dict:
    """Per job: arrival at the receiver minus the job's finished_at (the final status's commit)."""
    with psycopg.connect(db_url) as db:
        rows = db.execute("SELECT id, extract(epoch FROM finished_at) FROM jobs WHERE id = ANY(%s)", (jobs,)).fetchall()
    finished = {job_id: float(at) for job_id, at in rows}
    delays = sorted(receiver.arrivals[j][0] - finished[j] for j in jobs if j in receiver.arrivals)
    missing = [j for j in jobs if j not in receiver.arrivals]
    q = statistics.quantiles(delays, n=100, method="inclusive") if len(delays) > 1 else delays * 99
    return {
        "jobs": len(jobs),
        "delivered": len(delays),
        "missing": len(missing),
        "p50_s": round(q[49], 3),
        "p95_s": round(q[94], 3),
        "p99_s": round(q[98], 3),
        "max_s": round(delays[-1], 3) if delays else None,
        "min_s": round(delays[0], 3) if delays else None,
    }


async def run(args: argparse.Namespace, stack: Stack, receiver: Receiver, url: str, key: str) -> dict:
    out = {}
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as client:
        r = await client.post("/v1/webhooks", json={"url": receiver.url, "events": ["job.cancelled", "job.succeeded"]})
        assert r.status_code == 201, r.text
        for phase, n, seconds in (("steady", args.jobs, args.seconds), ("burst", args.burst, 0.0)):
            jobs = await submit(client, n)
            await cancel(client, jobs, seconds)
            receiver.wait(set(jobs), 60)
            out[phase] = {"cancel_over_s": seconds, **latencies(stack.db_url, receiver, jobs)}
            print(f"{phase:<10} {out[phase]}", flush=True)
        if args.workers and args.succeeded:
            for _ in range(args.workers):
                stack.start_worker()
            stack.wait_workers_ready(args.workers)
            jobs = await submit(client, args.succeeded)
            receiver.wait(set(jobs), 600)
            out["succeeded"] = {"workers": args.workers, **latencies(stack.db_url, receiver, jobs)}
            print(f"{'succeeded':<10} {out['succeeded']}", flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=200, help="steady phase: jobs cancelled (default 200)")
    parser.add_argument("--seconds", type=float, default=10.0, help="steady phase: over this long (default 10)")
    parser.add_argument("--burst", type=int, default=100, help="burst phase: jobs cancelled at once (default 100)")
    parser.add_argument("--workers", type=int, default=1, help="workers of the succeeded phase (default 1)")
    parser.add_argument("--succeeded", type=int, default=4, help="jobs run to their end (default 4; 0: skip)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    settings = {"MUONFORGE_WEBHOOK_ALLOW": "127.0.0.1", "MUONFORGE_TENANT_JOB_CAP": "100000"}
    receiver = Receiver()
    with Stack("webhooks", REDIS, settings) as stack:
        key = stack.api_key("hooks")
        url = stack.start_api(processes=1)
        result = asyncio.run(run(args, stack, receiver, url, key))
    worst = max(phase["p99_s"] for phase in result.values())
    lost = sum(phase["missing"] for phase in result.values())
    result["targets"] = {
        "p99_s": [worst, TARGET_P99_S, worst <= TARGET_P99_S],
        "missing": [lost, 0, lost == 0],
        "duplicates": [receiver.count - len(receiver.arrivals), 0, receiver.count == len(receiver.arrivals)],
    }
    print(json.dumps(result["targets"]))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
