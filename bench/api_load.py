"""Job-submission load on a real API process (Postgres + Redis, no workers: this measures
acceptance): an open loop at a fixed rate, then a closed loop of N concurrent clients.

    .venv/bin/python bench/api_load.py [--rate 200] [--seconds 30] [--clients 50] [--quick]

Starts its own API (uvicorn, one process) on a fresh database that it drops at the end; the
load tenant's job cap is raised so that admission control does not interfere.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import httpx
import psycopg

ROOT = Path(__file__).resolve().parents[1]
PG_ADMIN = os.environ.get("MUONFORGE_BENCH_PG", "postgresql://postgres@127.0.0.1:5432/postgres")
REDIS = os.environ.get("MUONFORGE_BENCH_REDIS", "redis://127.0.0.1:6379/14")
SPEC = {
    "model": {"arch": "gpt", "n_layer": 2, "n_head": 4, "d_model": 64, "seq_len": 64},
    "data": {"builtin": "synthetic"},
    "train": {"steps": 100},
}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def open_loop(url: str, headers: dict, rate: float, seconds: float) -> dict:
    """Send at a fixed rate regardless of responses (no coordinated omission): each request's
    latency counts from its scheduled start."""
    latencies, errors = [], 0
    limits = httpx.Limits(max_connections=500, max_keepalive_connections=500)
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=30) as client:

        async def one(scheduled: float) -> None:
            nonlocal errors
            try:
                r = await client.post("/v1/jobs", json=SPEC)
                if r.status_code != 201:
                    errors += 1
            except httpx.HTTPError:
                errors += 1
            latencies.append(time.perf_counter() - scheduled)

        start = time.perf_counter()
        tasks = []
        n = int(rate * seconds)
        for i in range(n):
            scheduled = start + i / rate
            delay = scheduled - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(scheduled)))
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
    return summarize(latencies, errors, wall, f"open loop {rate:.0f}/s x {seconds:.0f} s")


async def closed_loop(url: str, headers: dict, clients: int, seconds: float) -> dict:
    """N clients, each sending its next request when the previous one answers."""
    latencies, errors = [], 0
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=30) as client:
        deadline = time.perf_counter() + seconds

        async def loop() -> None:
            nonlocal errors
            while time.perf_counter() < deadline:
                t0 = time.perf_counter()
                try:
                    r = await client.post("/v1/jobs", json=SPEC)
                    errors += r.status_code != 201
                except httpx.HTTPError:
                    errors += 1
                latencies.append(time.perf_counter() - t0)

        start = time.perf_counter()
        await asyncio.gather(*(loop() for _ in range(clients)))
        wall = time.perf_counter() - start
    return summarize(latencies, errors, wall, f"closed loop, {clients} clients x {seconds:.0f} s")


def summarize(latencies: list[float], errors: int, wall: float, label: str) -> dict:
    ms = [x * 1e3 for x in latencies]
    return {
        "label": label,
        "requests": len(ms),
        "errors": errors,
        "throughput_per_s": len(ms) / wall,
        "p50_ms": statistics.median(ms),
        "p99_ms": percentile(ms, 0.99),
        "max_ms": max(ms),
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=200.0)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--quick", action="store_true", help="5 s per phase")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    seconds = 5.0 if args.quick else args.seconds

    name = f"muonforge_bench_{secrets.token_hex(3)}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    db_url = PG_ADMIN.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://") + f"/{name}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MUONFORGE_")}
    env.update(MUONFORGE_DATABASE_URL=db_url, MUONFORGE_REDIS_URL=REDIS, MUONFORGE_TENANT_JOB_CAP="10000000")
    port = free_port()
    api = None
    try:
        subprocess.run([sys.executable, "-m", "muonforge.cli", "migrate"], env=env, check=True, cwd=ROOT)
        out = subprocess.run(
            [sys.executable, "-m", "muonforge.cli", "keys", "create", "--tenant", "load"],
            env=env, check=True, cwd=ROOT, capture_output=True, text=True,
        )  # fmt: skip
        headers = {"Authorization": f"Bearer {out.stdout.strip().splitlines()[-1]}"}
        api = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "app.main:create_app", "--factory", "--port", str(port),
             "--log-level", "warning", "--no-access-log"],
            env=env, cwd=ROOT,
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        for _ in range(200):
            try:
                urllib.request.urlopen(f"{url}/readyz", timeout=1)
                break
            except OSError:
                time.sleep(0.1)
        asyncio.run(closed_loop(url, headers, 4, 2.0))  # warm-up
        results = [
            asyncio.run(open_loop(url, headers, args.rate, seconds)),
            asyncio.run(closed_loop(url, headers, args.clients, seconds)),
        ]
    finally:
        if api is not None:
            api.terminate()
            api.wait(timeout=20)
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    print(f"{'phase':<36}{'requests':>9}{'errors':>8}{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}")
    for r in results:
        print(
            f"{r['label']:<36}{r['requests']:>9}{r['errors']:>8}{r['throughput_per_s']:>9.1f}"
            f"{r['p50_ms']:>9.1f}{r['p99_ms']:>9.1f}{r['max_ms']:>9.1f}"
        )
    target = results[0]
    verdict = "met" if target["p99_ms"] < 50 and target["errors"] == 0 else "NOT met"
    print(f"target (open loop p99 < 50 ms, zero errors): {verdict}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
