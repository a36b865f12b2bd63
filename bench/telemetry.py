"""Telemetry end to end on this machine's Postgres and Redis: ingest, live latency, training
overhead and history queries, each through the service's own code.

    .venv/bin/python bench/telemetry.py [--part all|ingest|sse|overhead|history] [--quick] [--data FILE]
                                        [--json PATH]

1. ingest: telemetry steps of a 4-layer, 4-head gpt (the names and values of a real step of the
   engine, about 40 values) handed to the worker's sink (worker.sink.JobSink) as fast as one
   thread can: every step goes to the job's Redis Stream and, in batches, into Postgres
   (idempotent per point). Points stored per second of wall time, then the same steps again
   (a redelivered attempt: nothing stored).
2. sse: one API process, CLIENTS clients following one job's events stream while a worker-side
   sink (a separate process, as in a worker) emits RATE telemetry steps a second; the latency of
   each metrics event from the moment the trainer hands the step to the sink (a timestamp in
   the step) to the moment a client has parsed it. Every client must receive every step once.
3. overhead: tokens/s of the convergence benchmark's gpt (bench/train_overhead.py; the builtin
   pysource text, or --data FILE) with telemetry every step through the service's sink (Redis
   and Postgres) against step 0 only.
4. history: a job holding a 1,000,000-step series and 20 other series (every 10th step),
   ingested through the same path; GET /v1/jobs/{id}/metrics downsampling it to at most 1,000
   (and 300) points, a 20,000-step zoom, and all 21 series at once, timed over HTTP.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import train_overhead
import uvloop
from stack import ROOT, CpuMeter, Stack, processes
from train_overhead import measure, summarize

from app.db.session import transaction
from app.messaging.live_bus import live_bus
from app.services import lifecycle
from app.services.metric_history import store_metrics
from app.settings import Settings
from contract.spec import JobSpec
from tests.support.telemetry import stored_job
from worker.engine.telemetry import Report
from worker.sink import JobSink

REDIS = "redis://127.0.0.1:6379/10"
# One tenant makes many jobs, follows them with hundreds of streams, at any rate.
SETTINGS = {
    "MUONFORGE_TENANT_JOB_CAP": "100000",
    "MUONFORGE_TENANT_RATE_PER_SECOND": "0",
    "MUONFORGE_TENANT_STREAM_CAP": "100000",
}
TARGETS = {"ingest_points_per_s": 100_000, "sse_p50_ms": 100, "sse_p99_ms": 500, "history_ms": 200, "overhead": 0.05}


# -- shared ---------------------------------------------------------------------------------------
def settings_of(stack: Stack) -> Settings:
    """The stack's settings, for this process (which writes like a worker)."""
    env = {k.removeprefix("MUONFORGE_").lower(): v for k, v in stack.env.items() if k.startswith("MUONFORGE_")}
    return Settings(**env)


def running_job(settings: Settings, key: str, steps: int = 1_000_000) -> tuple[str, int]:
    """A job of the key's tenant, claimed as a worker would: (job id, attempt)."""
    spec = {
        "model": {"arch": "gpt", "n_layer": 4, "n_head": 4, "d_model": 64, "seq_len": 64},
        "data": {"builtin": "synthetic"},
        # The server's cap of 1,000 checkpoints a job (a 1,000,000-step job checkpoints every 1,000).
        "train": {"steps": steps, "checkpoint_every": max(500, -(-steps // 1000))},
    }
    job_id = stored_job(settings, key, spec)
    with transaction(settings) as session:
        claim = lifecycle.claim(session, live_bus(settings), job_id, "bench", timedelta(hours=1))
    return job_id, claim.attempt


def step_report(step: int, values: dict[str, float]) -> Report:
    """A training step's report, as the trainer hands it to the sink."""
    return Report(step, values, completed=step + 1, summary={"loss": values.get("loss", 0.0)})


def gpt_telemetry() -> dict[str, float]:
    """The telemetry of one real step of a 4-layer, 4-head gpt (MuonClip) on the synthetic task."""
    from worker.engine.config import job_config
    from worker.engine.data import synthetic_task
    from worker.engine.trainer import Trainer

    class Keep:
        def __init__(self) -> None:
            self.steps: list[dict[str, float]] = []

        def metrics(self, report):
            self.steps.append(report.values)

        def checkpoint(self, *args):
            pass

        def log(self, *args):
            pass

        def sample(self, *args):
            pass

    spec = JobSpec.model_validate(
        {
            "model": {"arch": "gpt", "n_layer": 4, "n_head": 4, "d_model": 64, "seq_len": 64},
            "data": {"builtin": "synthetic"},
            "optimizer": {"name": "muonclip"},
            "train": {"steps": 2, "batch_size": 8, "eval_every": 100, "checkpoint_every": 100, "device": "cpu"},
        }
    ).model_dump()
    sink = Keep()
    Trainer(job_config(spec), synthetic_task(0), None, sink).run(resume=False)
    return sink.steps[1]


def step_values(template: dict[str, float], step: int) -> dict[str, float]:
    """The template with values that move a little from step to step."""
    f = 1.0 + 1e-4 * (step % 97)
    return {k: v * f for k, v in template.items()}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def stored_points(settings: Settings, job_id: str) -> int:
    from sqlalchemy import func, select

    from app.db.models import MetricSeries

    with transaction(settings) as session:
        return int(session.scalar(select(func.sum(MetricSeries.points)).where(MetricSeries.job_id == job_id)) or 0)


# -- 1. ingest ------------------------------------------------------------------------------------
def ingest_part(steps: int) -> dict[str, Any]:
    template = gpt_telemetry()
    with Stack("telemetry_ingest", REDIS, SETTINGS) as stack:
        settings = settings_of(stack)
        key = stack.api_key("bench")
        job_id, attempt = running_job(settings, key)
        out: dict[str, Any] = {"values_per_step": len(template), "steps": steps}
        for label in ("first", "again"):  # "again": the same steps re-sent (a redelivered attempt)
            sink = JobSink(settings, job_id, attempt, 0, {})
            meter = CpuMeter(None)
            before = stored_points(settings, job_id)
            meter.start()
            t0 = time.perf_counter()
            handover = 0.0
            for step in range(steps):
                values = step_report(step, step_values(template, step))
                h0 = time.perf_counter()
                sink.metrics(values)
                handover += time.perf_counter() - h0
            sink.close()
            wall = time.perf_counter() - t0
            cpu = meter.stop()
            stored = stored_points(settings, job_id) - before
            out[label] = {
                "wall_s": wall,
                "points_stored": stored,
                "points_per_s": stored / wall,
                "offered_points_per_s": steps * len(template) / wall,
                "handover_us_per_step": handover / steps * 1e6,
                "cpu_cores": cpu,
            }
    return out


# -- 2. sse ---------------------------------------------------------------------------------------
def emit_main(argv: list[str]) -> None:
    """The worker side of the sse part (its own process): RATE steps a second for SECONDS, each
    carrying the time it was handed to the sink, then the job ends succeeded."""
    job_id, attempt, rate, seconds = argv[0], int(argv[1]), float(argv[2]), float(argv[3])
    settings = Settings()
    template = json.loads(Path(argv[4]).read_text())
    sink = JobSink(settings, job_id, attempt, 0, {})
    start = time.perf_counter()
    for step in range(int(rate * seconds)):
        delay = start + step / rate - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        sink.metrics(step_report(step, step_values(template, step) | {"bench/sent_at": time.time()}))
    sink.close()
    with transaction(settings) as session:
        steps = int(rate * seconds)
        lifecycle.finish(session, live_bus(settings), job_id, attempt, "succeeded", steps, sink.summary)


async def follow(url: str, key: str, job_id: str, latencies: list[float], connected: asyncio.Event) -> dict:
    """One client: the whole stream, parsed; latency of every metrics event."""
    steps: list[int] = []
    done = False
    timeout = aiohttp.ClientTimeout(total=None, sock_read=60)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.get(f"{url}/v1/jobs/{job_id}/events", headers={"Authorization": f"Bearer {key}"}) as response,
    ):
        event, data = None, []
        async for raw in response.content:
            line = raw.decode().rstrip("\n")
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].strip())
            elif not line and event:
                if event == "metrics":
                    payload = json.loads("".join(data))
                    latencies.append(time.time() - payload["metrics"]["bench/sent_at"])
                    steps.append(payload["step"])
                elif event == "status":
                    connected.set()
                elif event == "done":
                    done = True
                    break
                event, data = None, []
    return {"steps": steps, "done": done}


async def sse_clients(url: str, key: str, job_id: str, clients: int, start_emitter) -> tuple[list, list[float]]:
    latencies: list[float] = []
    flags = [asyncio.Event() for _ in range(clients)]
    tasks = [asyncio.create_task(follow(url, key, job_id, latencies, flag)) for flag in flags]
    await asyncio.wait_for(asyncio.gather(*(f.wait() for f in flags)), timeout=120)  # every client is in
    await asyncio.get_running_loop().run_in_executor(None, start_emitter)
    return await asyncio.gather(*tasks), latencies


def sse_part(clients: int, rate: float, seconds: float) -> dict[str, Any]:
    template = gpt_telemetry()
    with Stack("telemetry_sse", REDIS, SETTINGS) as stack:
        settings = settings_of(stack)
        key = stack.api_key("bench")
        job_id, attempt = running_job(settings, key, steps=int(rate * seconds))
        url = stack.start_api()
        template_file = stack.tmp / "template.json"
        template_file.write_text(json.dumps(template))
        emitter: list[subprocess.Popen] = []

        def start_emitter() -> None:
            cmd = [
                sys.executable,
                __file__,
                "--emit",
                job_id,
                str(attempt),
                str(rate),
                str(seconds),
                str(template_file),
            ]
            emitter.append(subprocess.Popen(cmd, env=stack.env, cwd=ROOT))

        meter = CpuMeter(stack.api.pid)
        meter.start()
        results, latencies = uvloop.run(sse_clients(url, key, job_id, clients, start_emitter))
        cpu = meter.stop()
        emitter[0].wait(timeout=60)
    expected = list(range(int(rate * seconds)))
    complete = sum(r["done"] and r["steps"] == expected for r in results)
    ms = [x * 1e3 for x in latencies]
    return {
        "clients": clients,
        "rate": rate,
        "seconds": seconds,
        "steps": len(expected),
        "clients_complete": complete,
        "deliveries": len(ms),
        "p50_ms": statistics.median(ms),
        "p99_ms": percentile(ms, 0.99),
        "max_ms": max(ms),
        "cpu_cores": cpu,
        "emitter_exit": emitter[0].returncode,
    }


# -- 3. overhead ----------------------------------------------------------------------------------
class ServiceRecorder:
    """train_overhead's recorder for the service's sink: every run trains into a fresh claimed job."""

    def __init__(self, settings: Settings, key: str) -> None:
        self.settings, self.key = settings, key

    def open(self, mode: str) -> JobSink:
        self.job_id, attempt = running_job(self.settings, self.key)
        self.sink = JobSink(self.settings, self.job_id, attempt, 0, {})
        return self.sink

    def finish(self) -> int:
        self.sink.close()
        from sqlalchemy import func, select

        from app.db.models import MetricSeries

        with transaction(self.settings) as session:  # telemetry steps stored: points of "lr", one a step
            query = select(func.max(MetricSeries.points)).where(MetricSeries.job_id == self.job_id)
            return int(session.scalar(query) or 0)


def service_cpu() -> float:
    """This process plus Postgres and Redis: the CPU a run through the service's sink uses."""
    own = os.times()
    services = sum(
        cpu for comm, _, cpu in processes().values() if comm == "postgres" or comm.startswith("redis-server")
    )
    return services + own.user + own.system


def overhead_part(rounds: int, steps: int) -> dict[str, Any]:
    import torch
    from train_overhead import make_spec

    from worker.engine.config import job_config
    from worker.engine.data import load_data

    with Stack("telemetry_overhead", REDIS, SETTINGS) as stack, tempfile.TemporaryDirectory() as tmp:
        settings = settings_of(stack)
        recorder = ServiceRecorder(settings, stack.api_key("bench"))
        data = load_data(job_config(make_spec("muon", 1, 1)).data, 0, Path(tmp))
        runs = measure("muon", rounds, steps, data, recorder, accounted_cpu=service_cpu)
    out = summarize(runs)
    out["threads"] = torch.get_num_threads()
    return out


# -- 4. history -----------------------------------------------------------------------------------
def history_part(steps: int, repeats: int) -> dict[str, Any]:
    with Stack("telemetry_history", REDIS, SETTINGS) as stack:
        settings = settings_of(stack)
        key = stack.api_key("bench")
        job_id, _ = running_job(settings, key)
        others = [f"other/{i:02d}" for i in range(20)]
        spike = steps * 7 // 9  # one step of "loss" 50 above the rest: it must survive downsampling
        t0 = time.perf_counter()
        batch = 2000
        for first in range(0, steps, batch):  # the store path of the sink: one transaction a batch
            rows = [
                (
                    s,
                    {"loss": 2.0 + (s % 1000) / 1000 + (50.0 if s == spike else 0.0)}
                    | ({name: s / 1e6 for name in others} if s % 10 == 0 else {}),
                )
                for s in range(first, min(first + batch, steps))
            ]
            with transaction(settings) as session:
                store_metrics(session, job_id, rows)
        ingest_s = time.perf_counter() - t0
        points = stored_points(settings, job_id)
        url = stack.start_api()
        queries = {
            "loss, max_points=1000": {"names": "loss", "max_points": 1000},
            "loss, max_points=300": {"names": "loss", "max_points": 300},
            "loss, 20,000-step zoom": {
                "names": "loss",
                "max_points": 1000,
                "from_step": steps // 2,
                "to_step": steps // 2 + 19_999,
            },
            "all 21 series, max_points=1000": {"max_points": 1000},
        }
        out: dict[str, Any] = {"steps": steps, "points": points, "ingest_s": ingest_s, "queries": {}}
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as http:
            for label, params in queries.items():
                http.get(f"/v1/jobs/{job_id}/metrics", params=params).raise_for_status()  # warm
                times, sizes = [], []
                for _ in range(repeats):
                    t = time.perf_counter()
                    r = http.get(f"/v1/jobs/{job_id}/metrics", params=params)
                    times.append((time.perf_counter() - t) * 1e3)
                    r.raise_for_status()
                    sizes = [len(s["points"]) for s in r.json()["series"]]
                    lo, hi = params.get("from_step", 0), params.get("to_step", steps)
                    spike_kept = (
                        any(p[0] == spike for s in r.json()["series"] if s["name"] == "loss" for p in s["points"])
                        if lo <= spike <= hi
                        else None
                    )
                out["queries"][label] = {
                    "p50_ms": statistics.median(times),
                    "p99_ms": percentile(times, 0.99),
                    "max_ms": max(times),
                    "points_per_series": max(sizes),
                    "series": len(sizes),
                    "spike_kept": spike_kept,
                }
    return out


# -- report ---------------------------------------------------------------------------------------
def report(out: dict[str, Any]) -> None:
    if "ingest" in out:
        r = out["ingest"]
        print(f"\ningest: {r['steps']:,} steps x {r['values_per_step']} values through worker.sink.JobSink")
        for label in ("first", "again"):
            x = r[label]
            cpu = ", ".join(f"{k} {v:.2f}" for k, v in x["cpu_cores"].items() if k != "api")
            print(
                f"  {label:<6} {x['points_stored']:>10,} points stored in {x['wall_s']:6.2f} s = "
                f"{x['points_per_s']:>10,.0f} points/s (offered {x['offered_points_per_s']:,.0f}/s); "
                f"hand-over {x['handover_us_per_step']:.1f} us/step; cores: {cpu}"
            )
        ok = r["first"]["points_per_s"] >= TARGETS["ingest_points_per_s"] and r["again"]["points_stored"] == 0
        print(f"  target >= {TARGETS['ingest_points_per_s']:,} points/s, idempotent: {'met' if ok else 'NOT met'}")
    if "sse" in out:
        r = out["sse"]
        print(f"\nsse: {r['clients']} clients, {r['rate']:g} steps/s for {r['seconds']:g} s ({r['steps']} steps)")
        print(
            f"  clients that got every step once, then done: {r['clients_complete']}/{r['clients']}; "
            f"deliveries {r['deliveries']:,}"
        )
        print(f"  hand-over -> client: p50 {r['p50_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms, max {r['max_ms']:.1f} ms")
        print("  cores: " + ", ".join(f"{k} {v:.2f}" for k, v in r["cpu_cores"].items()))
        ok = (
            r["p50_ms"] <= TARGETS["sse_p50_ms"]
            and r["p99_ms"] <= TARGETS["sse_p99_ms"]
            and r["clients_complete"] == r["clients"]
        )
        print(f"  target p50 <= 100 ms, p99 <= 500 ms, every client everything: {'met' if ok else 'NOT met'}")
    if "overhead" in out:
        r = out["overhead"]
        e2e, eng = r["tokens_per_s"], r["engine_tokens_per_s"]
        print(
            f"\noverhead (gpt of the convergence benchmark, muon, {r['threads']} threads, telemetry through "
            f"Redis and Postgres): steps stored per run on {r['lines']['on']}, off {r['lines']['off']}"
        )
        for label, x in (("end-to-end", e2e), ("engine (step only)", eng)):
            print(
                f"  {label:<20} on {x['on_median']:8.0f} tok/s  off {x['off_median']:8.0f} tok/s  "
                f"overhead {100 * x['overhead_of_medians']:5.2f}% (paired {100 * x['overhead_paired_median']:5.2f}%)"
            )
        print(f"  rounds repeated (disturbed): {r['repeated_rounds']}, kept disturbed: {r['disturbed_rounds']}")
        ok = e2e["overhead_of_medians"] <= TARGETS["overhead"]
        print(f"  target <= 5%: {'met' if ok else 'NOT met'}")
    if "history" in out:
        r = out["history"]
        print(
            f"\nhistory: {r['points']:,} points ({r['steps']:,}-step loss + 20 series every 10th step), "
            f"ingested in {r['ingest_s']:.1f} s ({r['points'] / r['ingest_s']:,.0f} points/s)"
        )
        for label, q in r["queries"].items():
            print(
                f"  {label:<32} p50 {q['p50_ms']:7.1f} ms  p99 {q['p99_ms']:7.1f} ms  max {q['max_ms']:7.1f} ms  "
                f"{q['series']} series x <= {q['points_per_series']} points  spike kept: "
                f"{'(not in range)' if q['spike_kept'] is None else q['spike_kept']}"
            )
        q = r["queries"]["loss, max_points=1000"]
        ok = q["p99_ms"] <= TARGETS["history_ms"] and q["points_per_series"] <= 1000
        print(f"  target (1,000,000 points to <= 1,000 in <= 200 ms): {'met' if ok else 'NOT met'}")


def main() -> None:
    if sys.argv[1:2] == ["--emit"]:
        emit_main(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("all", "ingest", "sse", "overhead", "history"), default="all")
    parser.add_argument("--ingest-steps", type=int, default=50_000)
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--rate", type=float, default=20.0, help="telemetry steps a second in the sse part")
    parser.add_argument("--seconds", type=float, default=30.0, help="length of the sse part")
    parser.add_argument("--rounds", type=int, default=5, help="overhead: interleaved rounds")
    parser.add_argument("--steps", type=int, default=100, help="overhead: training steps per run")
    parser.add_argument("--history-steps", type=int, default=1_000_000)
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    parser.add_argument(
        "--data", metavar="FILE", type=Path, help="overhead: a UTF-8 corpus instead of the builtin pysource text"
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.data:
        train_overhead.DATA.update(path=str(args.data.resolve()), builtin=None)
    if args.quick:
        args.ingest_steps, args.clients, args.seconds, args.rounds, args.steps = 5_000, 20, 5.0, 1, 20
        args.history_steps = 100_000
    parts = ("ingest", "sse", "overhead", "history") if args.part == "all" else (args.part,)
    out: dict[str, Any] = {"settings": {k: str(v) for k, v in vars(args).items()}}
    for part in parts:
        t0 = time.perf_counter()
        if part == "ingest":
            out["ingest"] = ingest_part(args.ingest_steps)
        elif part == "sse":
            out["sse"] = sse_part(args.clients, args.rate, args.seconds)
        elif part == "overhead":
            out["overhead"] = overhead_part(args.rounds, args.steps)
        else:
            out["history"] = history_part(args.history_steps, repeats=5 if args.quick else 20)
        print(f"[{part} took {time.perf_counter() - t0:.0f} s]", flush=True)
    report(out)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2, default=str))


if __name__ == "__main__":
    main()
