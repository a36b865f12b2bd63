"""Telemetry overhead of the training engine: tokens/s with telemetry every step against
telemetry effectively off, in one process, interleaved rounds.

The model is the convergence benchmark's GPT (char-level builtin pysource text, 2 layers, d_model
128, 4 heads, seq_len 64, batch 32), trained by the engine's Trainer with Muon and the local
JSONL sink writing to a temporary file. "on" is ``telemetry.every = 1``; "off" is
``telemetry.every = steps + 1``, so only step 0 reports (the step-0 report and the two
validation passes, at step 0 and at the end, are the same in both modes). Every round trains a
fresh model of the same seed once per mode, the order alternating between rounds; one short
warm-up run per mode comes first. Target: telemetry every step costs <= 5% of step time.

Every run also measures the CPU that other processes took meanwhile (/proc/stat minus this
process's own CPU time); a round in which that exceeds 0.05 cores is repeated. Run it on a
quiet machine (``--wait-quiet`` waits for a low load average first).

Two figures per mode: end-to-end tokens/s (steps x tokens over the wall time of
``Trainer.run``, which includes building telemetry, converting it to floats and writing the
JSONL lines) and the engine's own ``tokens_per_s`` (the time inside the training step only).

    .venv/bin/python bench/train_overhead.py [--rounds 5] [--steps 100] [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from contract.spec import JobSpec
from worker.engine.config import job_config
from worker.engine.data import TokenData, load_data
from worker.engine.telemetry import JsonlSink
from worker.engine.trainer import Trainer

DATA: dict[str, Any] = {"builtin": "pysource", "tokenizer": "char"}  # --data FILE: {"path": FILE, ...}
MODEL = {"arch": "gpt", "n_layer": 2, "n_head": 4, "d_model": 128, "seq_len": 64}  # as in bench/convergence.py
BATCH_SIZE = 32
ROUNDS, STEPS, WARMUP_STEPS = 5, 100, 10
EVAL_BATCHES = 1  # the two validation passes are identical in both modes; keep them short
TARGET = 0.05
QUIET_LOAD = 0.5
FOREIGN_MAX = 0.05  # a run during which other processes used more than this many cores is disturbed
MAX_RETRIES = 5  # times a disturbed round is repeated before it is kept anyway (and flagged)
MODES = ("on", "off")


def make_spec(optimizer: str, steps: int, every: int) -> dict[str, Any]:
    """A validated JobSpec dict for ``steps`` steps with telemetry every ``every`` steps, no checkpoints."""
    return JobSpec.model_validate(
        {
            "name": f"bench-train-overhead-{optimizer}",
            "model": MODEL,
            "data": DATA,
            "optimizer": {"name": optimizer},
            "train": {
                "steps": steps,
                "batch_size": BATCH_SIZE,
                "eval_every": steps + 1,
                "checkpoint_every": steps + 1,
                "seed": 0,
                "device": "cpu",
            },
            "telemetry": {"every": every, "sample_tokens": 0},
        }
    ).model_dump()


class JsonlRecorder:
    """The local sink of `muonforge train`: its JSONL files in a directory; ``finish`` closes them
    and counts the lines of metrics.jsonl."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / "metrics.jsonl"

    def open(self, mode: str) -> JsonlSink:
        self.sink = JsonlSink(self.path.parent)
        return self.sink

    def finish(self) -> int:
        self.sink.close()
        return self.path.read_text().count("\n")


def own_cpu() -> float:
    own = os.times()
    return own.user + own.system


def timed_run(
    optimizer: str, mode: str, steps: int, data: TokenData, recorder, accounted_cpu: Callable[[], float] = own_cpu
) -> dict[str, float]:
    """Train once in ``mode`` ("on": telemetry every step, "off": only step 0) into the sink that
    ``recorder.open(mode)`` gives; ``recorder.finish()`` (closing the sink, inside the timing)
    returns how many telemetry steps it recorded. Returns end-to-end and engine tokens/s, the wall
    time, the steps recorded and the CPU that processes other than ``accounted_cpu``'s took."""
    spec = make_spec(optimizer, steps, 1 if mode == "on" else steps + 1)
    job = job_config(spec)
    job = replace(job, eval_batches=EVAL_BATCHES)
    sink = recorder.open(mode)
    trainer = Trainer(job, data, None, sink)
    busy0, own0, t0 = machine_busy(), accounted_cpu(), time.perf_counter()
    try:
        result = trainer.run(resume=False)
    finally:
        lines = recorder.finish()
    wall = time.perf_counter() - t0
    busy1, own1 = machine_busy(), accounted_cpu()
    tokens = steps * BATCH_SIZE * MODEL["seq_len"]
    foreign = None if busy0 is None or busy1 is None else ((busy1 - busy0) - (own1 - own0)) / wall
    return {
        "tokens_per_s": tokens / wall,
        "engine_tokens_per_s": result.tokens_per_s,
        "wall_s": wall,
        "lines": lines,
        "foreign_cores": foreign,
    }


def machine_busy() -> float | None:
    """CPU seconds the whole machine has been busy (stolen time included), from /proc/stat; None
    where it is unavailable. Over a run, this minus the CPU of the processes the run itself uses
    is what other processes took: the load that distorts a timing on a small shared machine."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    except (OSError, ValueError):
        return None
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def disturbed(run: dict[str, float]) -> bool:
    """Whether other processes took more than FOREIGN_MAX cores during the run."""
    return run["foreign_cores"] is not None and run["foreign_cores"] > FOREIGN_MAX


def measure(
    optimizer: str,
    rounds: int,
    steps: int,
    data: TokenData,
    recorder,
    max_retries: int = MAX_RETRIES,
    accounted_cpu: Callable[[], float] = own_cpu,
) -> dict[str, list[dict]]:
    """One warm-up run per mode, then ``rounds`` rounds of one run per mode, order alternating.
    A round in which either run was disturbed by other processes is repeated (up to
    ``max_retries`` times, after a pause); a round kept while disturbed is flagged."""
    for mode in MODES:
        timed_run(optimizer, mode, WARMUP_STEPS, data, recorder, accounted_cpu)
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for r in range(rounds):
        for attempt in range(max_retries + 1):
            pair = {}
            for mode in MODES if r % 2 == 0 else MODES[::-1]:
                pair[mode] = run = timed_run(optimizer, mode, steps, data, recorder, accounted_cpu)
                print(
                    f"  round {r} {mode:<3}  {run['tokens_per_s']:9.0f} tok/s end-to-end  "
                    f"{run['engine_tokens_per_s']:9.0f} tok/s engine  {run['lines']:4d} lines  "
                    f"other processes {fmt_cores(run['foreign_cores'])} cores",
                    flush=True,
                )
            bad = any(disturbed(run) for run in pair.values())
            if not bad or attempt == max_retries:
                break
            print(f"  round {r} disturbed by other processes: repeating it after 30 s", flush=True)
            time.sleep(30)
        for mode, run in pair.items():
            runs[mode].append({**run, "disturbed": bad, "attempts": attempt + 1})
    return runs


def fmt_cores(cores: float | None) -> str:
    """Cores used by other processes, or "?" where unknown."""
    return "?" if cores is None else f"{cores:.2f}"


def summarize(runs: dict[str, list[dict]]) -> dict[str, Any]:
    """Medians per mode, overhead = (step time on / step time off) - 1 from the medians, and the
    median of the per-round paired overheads (robust to slow drift of the machine's speed)."""
    out: dict[str, Any] = {}
    for key in ("tokens_per_s", "engine_tokens_per_s"):
        on = [r[key] for r in runs["on"]]
        off = [r[key] for r in runs["off"]]
        paired = [b / a - 1.0 for a, b in zip(on, off)]
        out[key] = {
            "on_median": statistics.median(on),
            "off_median": statistics.median(off),
            "overhead_of_medians": statistics.median(off) / statistics.median(on) - 1.0,
            "overhead_paired_median": statistics.median(paired),
            "overhead_paired": paired,
            "on": on,
            "off": off,
        }
    out["lines"] = {mode: runs[mode][0]["lines"] for mode in MODES}
    out["disturbed_rounds"] = sum(r["disturbed"] for r in runs["on"])
    out["repeated_rounds"] = sum(r["attempts"] > 1 for r in runs["on"])
    return out


def wait_quiet(max_wait_s: float, threshold: float = QUIET_LOAD) -> float:
    """Wait (up to ``max_wait_s``) until the 1-minute load average is below ``threshold``; returns it."""
    deadline = time.monotonic() + max_wait_s
    load = os.getloadavg()[0]
    while load >= threshold and time.monotonic() < deadline:
        time.sleep(min(30.0, max(1.0, deadline - time.monotonic())))
        load = os.getloadavg()[0]
    return load


def report(s: dict[str, Any], optimizer: str, rounds: int, steps: int, loads: tuple[float, float]) -> None:
    """Print the table and the verdict."""
    print(
        f"\n{optimizer}, {rounds} rounds x {steps} steps per mode; load average before {loads[0]:.2f}, "
        f"after {loads[1]:.2f}; JSONL lines per run: on {s['lines']['on']}, off {s['lines']['off']}"
    )
    print(f"{'tokens/s (median)':<26}{'on':>10}{'off':>10}{'overhead':>10}{'paired':>9}")
    for key, label in (("tokens_per_s", "end-to-end"), ("engine_tokens_per_s", "engine (step only)")):
        r = s[key]
        print(
            f"{label:<26}{r['on_median']:>10.0f}{r['off_median']:>10.0f}"
            f"{100 * r['overhead_of_medians']:>9.2f}%{100 * r['overhead_paired_median']:>8.2f}%"
        )
    e2e = s["tokens_per_s"]["overhead_of_medians"]
    verdict = "met" if e2e <= TARGET else "NOT met"
    print(
        f"telemetry every step costs {100 * e2e:.2f}% of step time end-to-end (target <= {100 * TARGET:g}%: {verdict})"
    )
    print(
        f"rounds repeated because other processes used the CPU: {s['repeated_rounds']}; "
        f"kept while still disturbed: {s['disturbed_rounds']}"
    )
    if s["disturbed_rounds"]:
        print("warning: some rounds ran on a busy machine; the figures are not reliable")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=ROUNDS, help=f"interleaved rounds (default {ROUNDS})")
    parser.add_argument("--steps", type=int, default=STEPS, help=f"steps per run (default {STEPS})")
    parser.add_argument("--optimizer", choices=("muon", "muonclip", "adamw"), default="muon")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    parser.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help=f"first wait up to SECONDS for a 1-minute load average below {QUIET_LOAD}",
    )
    parser.add_argument(
        "--max-retries",
        type=int,
        default=MAX_RETRIES,
        help=f"repeats of a round disturbed by other processes (default {MAX_RETRIES})",
    )
    parser.add_argument("--quick", action="store_true", help="2 rounds x 20 steps: a smoke run")
    parser.add_argument("--data", metavar="FILE", type=Path, help="a UTF-8 corpus instead of the builtin pysource text")
    parser.add_argument("--json", metavar="PATH", help="also write every figure as JSON to PATH")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.rounds, args.steps = 2, 20
    if args.data:
        DATA.update(path=str(args.data.resolve()), builtin=None)

    load_before = wait_quiet(args.wait_quiet) if args.wait_quiet else os.getloadavg()[0]
    if load_before >= QUIET_LOAD:
        print(
            f"warning: 1-minute load average {load_before:.2f} >= {QUIET_LOAD}: the machine is busy, "
            "figures will be noisy"
        )
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.optimizer}, model {MODEL}, "
        f"batch {BATCH_SIZE}"
    )
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        data = load_data(job_config(make_spec(args.optimizer, 1, 1)).data, 0, Path(tmp))
        runs = measure(args.optimizer, args.rounds, args.steps, data, JsonlRecorder(Path(tmp)), args.max_retries)
    loads = (load_before, os.getloadavg()[0])
    summary = summarize(runs)
    report(summary, args.optimizer, args.rounds, args.steps, loads)
    runtime = time.perf_counter() - start
    print(f"took {runtime:.0f} s")
    if args.json:
        out = {
            "settings": vars(args),
            "threads": torch.get_num_threads(),
            "load_average": loads,
            "runtime_s": runtime,
            "summary": summary,
            "runs": runs,
        }
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
