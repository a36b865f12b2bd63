"""What ASHA saves on a learning-rate sweep, on a throwaway deployment (tests/support/stack.py): one API
process, W workers, real Postgres and Redis.

Two sweeps of the same 16 trials, submitted through the API with the Python client, one after
the other (the one with ASHA first): a small GPT on the builtin real corpus (pysource, char
tokenizer), the grid optimizer.lr x optimizer.name over {muon, muonclip, adamw}. The grid takes
every combination of its value lists (the first path slowest) and cannot pair an lr list with
each optimizer, so one lr list spans both ranges, 1e-3 .. 3.2e-2 doubling, listed out of order so
that large and small rates alternate in trial order (asynchronous ASHA always lets the first
results at a rung continue): 6 lr x 3 optimizers = 18 combinations, ``max_trials`` 16 keeps the
first 16 (the last lr, 0.002, runs with muon only). With ASHA, rungs at 1/9 and 1/3 of the steps,
reduction factor 3, in its default promote form (``--stop-once``: the stop form); without, every
trial runs to the end. ``max_concurrent`` = the workers.

Reported: steps run by each sweep (sum over trials of the steps they completed), the ratio
ASHA / full (target <= 0.45), each sweep's best trial and val_loss, their relative gap (target
<= 1%), each sweep's wall time, and at which rung ASHA held back or promoted which trial.

    python bench/sweep.py [--workers 2] [--steps 360] [--stop-once] [--json out.json]
    python bench/sweep.py --quick      # 6 trials of 63 steps: every path, a few minutes
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from stack import Stack

from muonforge import Client

REDIS = os.environ.get("MUONFORGE_BENCH_REDIS", "redis://127.0.0.1:6379/14")
LRS = [0.004, 0.032, 0.008, 0.001, 0.016, 0.002]
OPTIMIZERS = ["muon", "muonclip", "adamw"]
TARGETS = {"step_ratio": 0.45, "best_gap": 0.01}
FINISHED = ("completed", "cancelled")


def sweep_spec(
    name: str, steps: int, lrs: list[float], trials: int, workers: int, asha: bool, stop_once: bool = False
) -> dict:
    rungs = [steps // 9, steps // 3]
    every = rungs[0]  # evaluations at the rungs' multiples: steps // 9 divides steps // 3 when 9 divides steps
    spec = {
        "name": name,
        "base": {
            "model": {"arch": "gpt", "n_layer": 2, "n_head": 4, "d_model": 128, "seq_len": 64},
            "data": {"builtin": "pysource", "tokenizer": "char"},
            "train": {
                "steps": steps,
                "batch_size": 32,
                "eval_every": every,
                "checkpoint_every": steps,
                "lr_schedule": "cosine",
                "warmup_steps": max(1, steps // 20),
            },
            "telemetry": {"every": 10, "sample_tokens": 0},
        },
        "space": {"optimizer.lr": {"values": lrs}, "optimizer.name": {"values": OPTIMIZERS}},
        "method": "grid",
        "max_trials": trials,
        "max_concurrent": workers,
        "metric": "val_loss",
        "mode": "min",
    }
    if asha:
        spec["asha"] = {"rungs": rungs, "reduction_factor": 3, "stop_once": stop_once}
    return spec


def run_sweep(client: Client, spec: dict, timeout: float) -> dict:
    """Submit, wait until the sweep ends; the sweep as the API gives it, with its wall time."""
    start = time.monotonic()
    sweep = client.create_sweep(spec)
    while sweep["status"] not in FINISHED:
        if time.monotonic() - start > timeout:
            client.cancel_sweep(sweep["id"])
            raise RuntimeError(f"sweep {spec['name']} did not finish in {timeout:.0f} s")
        time.sleep(1.0)
        sweep = client.get_sweep(sweep["id"])
    sweep["wall_s"] = time.monotonic() - start
    return sweep


def summarize(sweep: dict) -> dict:
    trials = [
        {
            "number": t["number"],
            "optimizer": t["params"]["optimizer.name"],
            "lr": t["params"]["optimizer.lr"],
            "status": t["status"],
            "steps": t["step"] or 0,
            "val_loss": t["metric"],
            "stopped_at": next((r["rung"] for r in t.get("rungs") or [] if not r["continued"]), None),
            "promoted_at": [r["rung"] for r in t.get("rungs") or [] if r.get("promoted")],
            "rungs": t.get("rungs") or [],
        }
        for t in sorted(sweep["trials"], key=lambda t: t["number"])
    ]
    best = sweep.get("best") or {}
    return {
        "id": sweep["id"],
        "status": sweep["status"],
        "counts": sweep.get("counts"),
        "wall_s": round(sweep["wall_s"], 1),
        "steps": sum(t["steps"] for t in trials),
        "best": {"number": best.get("number"), "params": best.get("params"), "val_loss": best.get("metric")},
        "trials": trials,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=360, help="per trial; a multiple of 9 keeps the rungs exact")
    parser.add_argument("--trials", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=4 * 3600, help="per sweep, seconds")
    parser.add_argument("--quick", action="store_true", help="6 trials of 63 steps")
    parser.add_argument("--stop-once", action="store_true", help="ASHA's stop form instead of the promote form")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.quick:
        args.steps, args.trials = 63, 6
    lrs = LRS if args.trials > 6 else LRS[:2]
    if args.trials > len(lrs) * len(OPTIMIZERS):
        parser.error(f"--trials: at most {len(lrs) * len(OPTIMIZERS)}")

    settings = {"MUONFORGE_TENANT_JOB_CAP": str(max(100, 4 * args.workers)), "MUONFORGE_TENANT_RATE_PER_SECOND": "0"}
    with Stack("sweep", REDIS, settings) as stack:
        key = stack.api_key("sweep")
        url = stack.start_api(processes=1)
        for _ in range(args.workers):
            stack.start_worker()
        stack.wait_workers_ready(args.workers)
        client = Client(url, api_key=key)
        results = {}
        for label, asha in (("asha", True), ("full", False)):
            spec = sweep_spec(f"lr-{label}", args.steps, lrs, args.trials, args.workers, asha, args.stop_once)
            results[label] = summarize(run_sweep(client, spec, args.timeout))
            print(f"sweep {label}: {results[label]['status']} in {results[label]['wall_s']:.0f} s", flush=True)

    asha, full = results["asha"], results["full"]
    form = "stop" if args.stop_once else "promote"
    print(
        f"\n{args.trials} trials x {args.steps} steps, {args.workers} workers; ASHA ({form} form) rungs "
        f"{[args.steps // 9, args.steps // 3]}, reduction factor 3"
    )
    print(
        f"{'#':>3} {'optimizer':<9}{'lr':>8}  {'ASHA status':<14}{'steps':>6}{'val_loss':>10}"
        f"{'stopped at':>11}{'promoted at':>12}  {'full status':<12}{'steps':>6}{'val_loss':>10}"
    )
    fmt = lambda v: f"{v:.4f}" if isinstance(v, int | float) else "-"  # noqa: E731
    for a, f in zip(asha["trials"], full["trials"], strict=True):
        promoted = ",".join(map(str, a["promoted_at"])) or "-"
        print(
            f"{a['number']:>3} {a['optimizer']:<9}{a['lr']:>8g}  {a['status']:<14}{a['steps']:>6}"
            f"{fmt(a['val_loss']):>10}{a['stopped_at'] or '-':>11}{promoted:>12}  {f['status']:<12}{f['steps']:>6}"
            f"{fmt(f['val_loss']):>10}"
        )

    ratio = asha["steps"] / full["steps"] if full["steps"] else float("nan")
    a_best, f_best = asha["best"]["val_loss"], full["best"]["val_loss"]
    gap = (a_best - f_best) / f_best if a_best is not None and f_best else float("nan")
    print(f"\n{'sweep':<6}{'steps':>8}{'wall s':>8}{'s/step/worker':>15}  best")
    for label, r in results.items():
        per_step = r["wall_s"] * args.workers / r["steps"] if r["steps"] else float("nan")
        b = r["best"]
        print(
            f"{label:<6}{r['steps']:>8}{r['wall_s']:>8.0f}{per_step:>15.3f}  #{b['number']} {b['params']} "
            f"val_loss {fmt(b['val_loss'])}"
        )
    targets = {
        "step_ratio": [round(ratio, 4), TARGETS["step_ratio"], ratio <= TARGETS["step_ratio"]],
        "best_gap": [round(gap, 4), TARGETS["best_gap"], gap <= TARGETS["best_gap"]],
    }
    print("\ntargets [measured, target, met]:")
    for name, row in targets.items():
        print(f"  {name}: {row}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {"settings": vars(args) | {"json": str(args.json)}, "sweeps": results, "targets": targets}, indent=2
            )
        )


if __name__ == "__main__":
    main()
