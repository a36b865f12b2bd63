"""What abuse costs the API, on a throwaway deployment (tests/support/stack.py): one API process
(``--api-processes N``: N), real Postgres and Redis.

1. body: a 1 GB body declared without a key (and one streamed with chunked encoding): the time
   to the refusal and the API's RSS growth, while the sender keeps writing;
2. streams: one tenant makes 5,000 attempts to open event streams (it holds what it may and
   retries the rest as fast as it is answered) while another tenant lists its jobs: that
   tenant's GET /v1/jobs latency, idle and under the attack, in the same run;
3. cap: 100 parallel submissions by one tenant whose job cap is 8: how many are admitted;
4. memory: a spec within the parameter and batch caps built to exhaust a worker's memory
   (attention scores of 128 x 64 x 8192^2 floats per layer): refused at intake, what it cost.

    python bench/abuse.py [--attempts 5000] [--refusal-pace SECONDS] [--pin] [--api-processes 1] [--json out.json]

``--refusal-pace 0`` answers every refusal at once (MUONFORGE_REFUSAL_PACE_SECONDS), to compare
with the default pace on the same code. ``--pin`` keeps the load generator off the API's CPU, as
an attacker on another host would be: the API runs on CPU 0 alone, this process (the victim's
client) and the attacker's on the others, the attacker at nice 10 so that it cannot delay the
victim's client in reading its answers; Postgres and Redis stay where the system puts them.
Without it every process shares every CPU, and on a 2-core machine the figure measures the
machine as much as the API.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx
import psycopg
from stack import Stack

REDIS = os.environ.get("MUONFORGE_BENCH_REDIS", "redis://127.0.0.1:6379/14")
SPEC = {
    "model": {"arch": "gpt", "n_layer": 1, "n_head": 2, "d_model": 16, "seq_len": 16},
    "data": {"builtin": "synthetic"},
    "train": {"steps": 1000},
}
TARGETS = {"body_ms": 100.0, "body_rss_mb": 5.0, "victim_p99_ratio": 2.0, "admitted": 8}


def rss_mb(pid: int) -> float:
    """The resident memory of ``pid`` and its children (the API's processes, with --api-processes)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024 + sum(rss_mb(int(child)) for child in children)
    raise RuntimeError("no VmRSS")


def body_attack(url: str, pid: int, chunked: bool) -> dict:
    """Send a 1 GB body's head, keep writing its bytes from a thread, and time the answer."""
    host, port = url.removeprefix("http://").split(":")
    framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {10**9}"
    head = f"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{framing}\r\n\r\n".encode()
    before = rss_mb(pid)
    sock = socket.create_connection((host, int(port)), timeout=30)
    stop, sent = threading.Event(), [0]

    def write() -> None:
        block = b"x" * 65536
        frame = b"%x\r\n%s\r\n" % (len(block), block) if chunked else block
        try:
            while not stop.is_set() and sent[0] < 10**9:
                sock.sendall(frame)
                sent[0] += len(block)
        except OSError:
            pass

    start = time.perf_counter()
    sock.sendall(head)
    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    answer = sock.recv(4096)
    elapsed = time.perf_counter() - start
    stop.set()
    sock.close()
    writer.join(timeout=5)
    time.sleep(0.5)
    return {
        "framing": "chunked" if chunked else "content-length",
        "status": int(answer.split(b" ", 2)[1]) if answer else None,
        "ms": round(elapsed * 1000, 1),
        "sent_mb_by_then": round(sent[0] / 2**20, 1),
        "rss_growth_mb": round(rss_mb(pid) - before, 2),
    }


async def latencies(client: httpx.AsyncClient, n: int, gap: float, at: list[float] | None = None) -> list[float]:
    """``n`` GET /v1/jobs, ``gap`` s apart: their latencies (and their start times, into ``at``)."""
    out = []
    for _ in range(n):
        start = time.perf_counter()
        r = await client.get("/v1/jobs", params={"limit": 20})
        out.append(time.perf_counter() - start)
        if at is not None:
            at.append(start)
        assert r.status_code == 200, r.text
        await asyncio.sleep(gap)
    return out


def p(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[q - 1] * 1000


async def attack_streams(url: str, attacker: str, job: str, attempts: int, started, out) -> None:
    """The attacker (in a process of its own): ``attempts`` stream attempts, 400 at a time, each
    held open when accepted; ``started`` is set once it runs, the outcome is put on ``out``."""
    limits = httpx.Limits(max_connections=600, max_keepalive_connections=600)
    headers = {"Authorization": f"Bearer {attacker}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60, limits=limits) as a:
        held, codes, remaining = [], {}, attempts

        async def attempt() -> None:
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                response = await a.send(a.build_request("GET", f"/v1/jobs/{job}/events"), stream=True)
                codes[response.status_code] = codes.get(response.status_code, 0) + 1
                if response.status_code == 200:
                    held.append(response)  # kept open to the end
                else:
                    await response.aclose()

        attackers = [asyncio.create_task(attempt()) for _ in range(400)]
        started.set()
        start = time.perf_counter()
        await asyncio.gather(*attackers)
        out.put({"answers": codes, "held_open": len(held), "attack_s": round(time.perf_counter() - start, 2)})
        for response in held:
            await response.aclose()


def run_attacker(*args, niceness: int = 0) -> None:
    os.nice(niceness)
    asyncio.run(attack_streams(*args))


async def stream_attack(url: str, attacker: str, victim: str, attempts: int, niceness: int = 0) -> dict:
    """The victim's GET /v1/jobs latency, idle and while the attacker's process makes its
    attempts. The attacker runs in a process of its own: in this process's event loop its 400
    clients would delay the victim's own reading of its answers, and the figure would measure
    the load generator rather than the API."""
    headers_a, headers_v = {"Authorization": f"Bearer {attacker}"}, {"Authorization": f"Bearer {victim}"}
    async with (
        httpx.AsyncClient(base_url=url, headers=headers_a, timeout=60) as a,
        httpx.AsyncClient(base_url=url, headers=headers_v, timeout=60) as v,
    ):
        job = (await a.post("/v1/jobs", json=SPEC)).json()["id"]  # no worker: queued, its stream stays open
        for _ in range(5):
            await v.post("/v1/jobs", json=SPEC)
        idle = await latencies(v, 200, 0.01)
        ctx = multiprocessing.get_context("spawn")
        started, out = ctx.Event(), ctx.Queue()
        proc = ctx.Process(
            target=run_attacker, args=(url, attacker, job, attempts, started, out), kwargs={"niceness": niceness}
        )
        proc.start()
        await asyncio.to_thread(started.wait, 120)
        attack_start = time.perf_counter()
        await asyncio.sleep(1.0)
        starts: list[float] = []
        busy = await latencies(v, 200, 0.01, starts)
        worst = sorted(range(len(busy)), key=lambda i: busy[i])[-5:]
        outcome = await asyncio.to_thread(out.get, True, 600)
        proc.join(timeout=60)
    return {
        "attempts": attempts,
        **outcome,
        "victim_idle_p50_ms": round(p(idle, 50), 1),
        "victim_idle_p99_ms": round(p(idle, 99), 1),
        "victim_attacked_p50_ms": round(p(busy, 50), 1),
        "victim_attacked_p99_ms": round(p(busy, 99), 1),
        "victim_p99_ratio": round(p(busy, 99) / p(idle, 99), 2),
        "victim_window_s": [round(starts[0] - attack_start, 2), round(starts[-1] + busy[-1] - attack_start, 2)],
        "victim_worst_ms_at_s": [[round(busy[i] * 1000, 1), round(starts[i] - attack_start, 2)] for i in worst],
    }


def memory_attack(url: str, pid: int, key: str, n: int = 20) -> dict:
    """``n`` submissions of a spec within the parameter and batch caps whose attention scores
    alone (128 x 64 x 8192^2 floats per layer) would exhaust any worker: each refused at intake."""
    spec = {
        "model": {"arch": "gpt", "n_layer": 4, "n_head": 64, "d_model": 128, "seq_len": 8192},
        "data": {"builtin": "synthetic"},
        "train": {"steps": 1000, "batch_size": 128},
    }
    before, times, codes = rss_mb(pid), [], {}
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as c:
        for _ in range(n):
            start = time.perf_counter()
            r = c.post("/v1/jobs", json=spec)
            times.append((time.perf_counter() - start) * 1000)
            codes[r.status_code] = codes.get(r.status_code, 0) + 1
        message = r.json()["error"]["message"]
        queued = c.get("/v1/jobs", params={"limit": 100}).json()["data"]
    return {
        "submissions": n,
        "answers": codes,
        "max_ms": round(max(times), 1),
        "jobs_stored": len(queued),
        "rss_growth_mb": round(rss_mb(pid) - before, 2),
        "message": message,
    }


async def cap_attack(url: str, key: str, n: int) -> dict:
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as c:
        answers = await asyncio.gather(*(c.post("/v1/jobs", json=SPEC) for _ in range(n)))
    codes = [r.status_code for r in answers]
    return {"submissions": n, "admitted": codes.count(201), "refused_429": codes.count(429)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--attempts", type=int, default=5000)
    parser.add_argument("--refusal-pace", type=float, help="MUONFORGE_REFUSAL_PACE_SECONDS (default: the service's)")
    parser.add_argument("--pin", action="store_true", help="the API on CPU 0 alone, the load generator on the others")
    parser.add_argument("--api-processes", type=int, default=1, help="`muonforge api --workers`")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    env = {} if args.refusal_pace is None else {"MUONFORGE_REFUSAL_PACE_SECONDS": str(args.refusal_pace)}
    cpus = sorted(os.sched_getaffinity(0))
    if args.pin and len(cpus) < 2:
        parser.error("--pin needs at least 2 CPUs")
    api_cpus = {cpus[0]} if args.pin else None
    if args.pin:
        os.sched_setaffinity(0, cpus[1:])  # this process and the attacker's, spawned from it
    with Stack("abuse", REDIS, env) as stack:
        attacker, victim, capped, greedy = (stack.api_key(t) for t in ("attacker", "victim", "capped", "greedy"))
        with psycopg.connect(stack.db_url, autocommit=True) as db:
            db.execute("UPDATE tenants SET job_cap = 8 WHERE name = 'capped'")
        url = stack.start_api(processes=args.api_processes, cpus=api_cpus)
        pid = stack.api.pid
        result = {
            "body": [body_attack(url, pid, chunked=False), body_attack(url, pid, chunked=True)],
            "streams": asyncio.run(stream_attack(url, attacker, victim, args.attempts, 10 if args.pin else 0)),
            "cap": asyncio.run(cap_attack(url, capped, 100)),
            "memory": memory_attack(url, pid, greedy),
            "cores": os.cpu_count(),
            "api_processes": args.api_processes,
            "refusal_pace_s": args.refusal_pace,
            "pinned": {"api_cpus": sorted(api_cpus), "load_cpus": cpus[1:]} if args.pin else None,
        }
    worst = max(result["body"], key=lambda b: b["ms"])
    memory = result["memory"]
    refused_all = memory["answers"] == {422: memory["submissions"]} and not memory["jobs_stored"]
    result["targets"] = {
        "body_ms": [worst["ms"], TARGETS["body_ms"], worst["ms"] < TARGETS["body_ms"]],
        "body_rss_mb": [
            max(b["rss_growth_mb"] for b in result["body"]),
            TARGETS["body_rss_mb"],
            max(b["rss_growth_mb"] for b in result["body"]) < TARGETS["body_rss_mb"],
        ],
        "victim_p99_ratio": [
            result["streams"]["victim_p99_ratio"],
            TARGETS["victim_p99_ratio"],
            result["streams"]["victim_p99_ratio"] < TARGETS["victim_p99_ratio"],
        ],
        "admitted": [result["cap"]["admitted"], TARGETS["admitted"], result["cap"]["admitted"] == TARGETS["admitted"]],
        "memory_spec_refused": [memory["answers"], {422: memory["submissions"]}, refused_all],
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
