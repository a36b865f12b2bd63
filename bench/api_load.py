"""Job-submission load on a real API (Postgres + Redis, no workers: this measures acceptance):
an open loop at a fixed rate, then a closed loop of N concurrent clients.

    .venv/bin/python bench/api_load.py [--rate 200] [--seconds 30] [--clients 50] [--api-processes 1] [--quick]

Starts `muonforge api` on a fresh database that it drops at the end; the load tenant's job cap
and request rate are raised so that they do not refuse it (both are still checked). The load
generator (aiohttp on uvloop, in this process) shares the machine's cores with the API,
Postgres and Redis. The open loop sends each request at its scheduled time whatever the
responses, and counts its latency from that time (no coordinated omission). Every phase reports
the CPU each part of the system used and the CPU the hypervisor stole from this machine
meanwhile: a phase with much stolen time ran on a crowded host, and its latencies say more about
the host than about the service.

After the load it checks that every accepted job is in the database and that its task reached
the broker exactly once.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import statistics
import time
from pathlib import Path

import aiohttp
import psycopg
import redis
import uvloop
from stack import CpuMeter, Stack

REDIS = "redis://127.0.0.1:6379/14"
SPEC = {
    "model": {"arch": "gpt", "n_layer": 2, "n_head": 4, "d_model": 64, "seq_len": 64},
    "data": {"builtin": "synthetic"},
    "train": {"steps": 100},
}
BODY = json.dumps(SPEC).encode()
TARGET_P99_MS = 50.0


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Load:
    """An aiohttp session that posts the job spec and records latencies and failures."""

    def __init__(self, url: str, key: str, connections: int) -> None:
        self.url = f"{url}/v1/jobs"
        self.headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        self.connections = connections
        self.latencies: list[float] = []
        self.errors: dict[str, int] = {}
        self.accepted = 0

    async def __aenter__(self) -> Load:
        connector = aiohttp.TCPConnector(limit=self.connections)
        self.session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=30))
        return self

    async def __aexit__(self, *_) -> None:
        await self.session.close()

    async def post(self, since: float) -> None:
        """One submission; its latency counts from ``since``."""
        try:
            async with self.session.post(self.url, data=BODY, headers=self.headers) as response:
                await response.read()
                status = response.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            status = type(exc).__name__
        self.latencies.append(time.perf_counter() - since)
        if status == 201:
            self.accepted += 1
        else:
            self.errors[str(status)] = self.errors.get(str(status), 0) + 1


async def open_loop(url: str, key: str, rate: float, seconds: float) -> tuple[Load, float]:
    async with Load(url, key, connections=1000) as load:
        start = time.perf_counter()
        tasks = []
        for i in range(int(rate * seconds)):
            scheduled = start + i / rate
            delay = scheduled - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(load.post(scheduled)))
        await asyncio.gather(*tasks)
        return load, time.perf_counter() - start


async def closed_loop(url: str, key: str, clients: int, seconds: float) -> tuple[Load, float]:
    async with Load(url, key, connections=clients) as load:
        start = time.perf_counter()
        deadline = start + seconds

        async def client() -> None:
            while time.perf_counter() < deadline:
                await load.post(time.perf_counter())

        await asyncio.gather(*(client() for _ in range(clients)))
        return load, time.perf_counter() - start


def run_phase(label: str, coro_factory, api_pid: int) -> dict:
    meter = CpuMeter(api_pid)
    meter.start()
    load, wall = uvloop.run(coro_factory())
    cpu = meter.stop()
    ms = [x * 1e3 for x in load.latencies]
    return {
        "label": label,
        "requests": len(ms),
        "accepted": load.accepted,
        "errors": load.errors,
        "throughput_per_s": len(ms) / wall,
        "p50_ms": statistics.median(ms),
        "p99_ms": percentile(ms, 0.99),
        "max_ms": max(ms),
        "cpu_cores": cpu,
    }


def check_jobs(stack: Stack, accepted: int) -> dict:
    """Jobs stored and task messages in the broker (one per job, each job once), against the 201s."""
    with psycopg.connect(stack.db_url) as db:
        stored = db.execute("SELECT count(*) FROM jobs").fetchone()[0]
    broker = redis.Redis.from_url(REDIS)
    deadline = time.monotonic() + 10  # tasks are sent in batches shortly after the commit
    while broker.llen("default") < stored and time.monotonic() < deadline:
        time.sleep(0.2)
    job_ids = [task_job_id(m) for m in broker.lrange("default", 0, -1)]
    return {"accepted": accepted, "stored": stored, "messages": len(job_ids), "distinct_tasks": len(set(job_ids))}


def task_job_id(message: bytes) -> str:
    """The job id argument of a Celery task message as kombu's Redis transport stores it."""
    args, _kwargs, _embed = json.loads(base64.b64decode(json.loads(message)["body"]))
    return args[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=200.0, help="open loop submissions per second")
    parser.add_argument("--seconds", type=float, default=30.0, help="length of each phase")
    parser.add_argument("--clients", type=int, default=50, help="closed loop clients")
    parser.add_argument("--api-processes", type=int, default=1, help="`muonforge api --workers`")
    parser.add_argument("--quick", action="store_true", help="5 s per phase")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    seconds = 5.0 if args.quick else args.seconds

    with Stack(
        "api_load",
        REDIS,
        {
            "MUONFORGE_TENANT_JOB_CAP": "10000000",
            # On, as deployed (each request takes a token), and out of the load's reach.
            "MUONFORGE_TENANT_RATE_PER_SECOND": "1000000",
            "MUONFORGE_TENANT_BURST": "1000000",
            "MUONFORGE_TENANT_STREAM_CAP": "100000",
        },
    ) as stack:
        key = stack.api_key("load")
        url = stack.start_api(args.api_processes)
        api_pid = stack.api.pid
        warmup, _ = uvloop.run(closed_loop(url, key, 8, 3.0))  # connections, caches, every API process
        results = [
            run_phase(
                f"open loop {args.rate:.0f}/s x {seconds:.0f} s",
                lambda: open_loop(url, key, args.rate, seconds),
                api_pid,
            ),
            run_phase(
                f"closed loop, {args.clients} clients x {seconds:.0f} s",
                lambda: closed_loop(url, key, args.clients, seconds),
                api_pid,
            ),
        ]
        integrity = check_jobs(stack, warmup.accepted + sum(r["accepted"] for r in results))

    print(f"API: {args.api_processes} process(es); spec {SPEC['model']}")
    print(f"{'phase':<34}{'requests':>9}{'errors':>8}{'req/s':>8}{'p50 ms':>8}{'p99 ms':>8}{'max ms':>8}")
    for r in results:
        errors = sum(r["errors"].values())
        print(
            f"{r['label']:<34}{r['requests']:>9}{errors:>8}{r['throughput_per_s']:>8.1f}"
            f"{r['p50_ms']:>8.1f}{r['p99_ms']:>8.1f}{r['max_ms']:>8.1f}"
        )
    print("\nCPU (cores) per phase; CPU ms per request = cores x 1000 / req/s")
    names = list(results[0]["cpu_cores"])
    print(f"{'phase':<34}" + "".join(f"{n:>16}" for n in names))
    for r in results:
        print(f"{r['label']:<34}" + "".join(f"{r['cpu_cores'][n]:>16.2f}" for n in names))
    for r in results:
        per = {n: 1000 * r["cpu_cores"][n] / r["throughput_per_s"] for n in ("api", "postgres", "load generator")}
        print(f"{r['label']:<34} ms per request: " + ", ".join(f"{n} {v:.2f}" for n, v in per.items()))
    print(
        f"\njobs: {integrity['accepted']} accepted (incl. warm-up), {integrity['stored']} stored, "
        f"{integrity['messages']} task messages for {integrity['distinct_tasks']} distinct jobs"
    )
    target = results[0]
    met = target["p99_ms"] < TARGET_P99_MS and not target["errors"]
    print(
        f"target (open loop p99 < {TARGET_P99_MS:g} ms, zero errors): {'met' if met else 'NOT met'}; "
        f"stolen CPU during it {target['cpu_cores']['stolen']:.2f} cores"
    )
    if args.json:
        args.json.write_text(
            json.dumps(
                {"settings": vars(args) | {"json": str(args.json)}, "phases": results, "jobs": integrity}, indent=2
            )
        )


if __name__ == "__main__":
    main()
