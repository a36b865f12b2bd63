"""One step of data-parallel Muon (``optim.Muon(distributed=True)``) on 1, 2 and 4 gloo processes
on this machine's CPU, with bench/optim_step.py's GPT-shaped set (d_model 384, 4 layers, 16
matrices, fp32 parameters, the same seeded gradients on every rank as DDP would leave them).

Each world size runs in fresh processes with torch threads per process = usable cores / world
size (at least 1), so the processes together use the cores one process would; where there are
fewer cores than processes they share them. Every rank takes one warm-up step, then ``--rounds``
steps, each after a barrier; a step's time is the slowest rank's. Printed per world size: the
median and minimum step time, the median of the slowest rank's Newton–Schulz time, the ratio of
the median step to one process's, and the largest parameter difference from one process after
the same steps.

    PYTHONPATH=. .venv/bin/python bench/distributed.py [--rounds 10] [--worlds 1,2,4] [--shard-momentum]
        [--ns-dtype auto|fp32|bf16] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from optim_step import LR, make_params

import optim
from worker.engine.optimizer import NS_DTYPES


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank: int, world: int, port: int, args: dict, out_dir: str) -> None:
    """One rank: warm-up step, timed steps (after a barrier each); rank 0 saves the figures."""
    torch.set_num_threads(args["threads"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))  # fmt: skip
    try:
        params = make_params()
        ns_dtype = NS_DTYPES[args["ns_dtype"]]
        opt = optim.Muon(params, lr=LR, ns_dtype=ns_dtype, distributed=True, shard_momentum=args["shard_momentum"])
        opt.step()
        step_s, ns_ms = [], []
        for _ in range(args["rounds"]):
            dist.barrier()
            t0 = time.perf_counter()
            opt.step()
            step_s.append(time.perf_counter() - t0)
            ns_ms.append(opt.last_step_stats()["ns_time_ms"])
        slowest = torch.tensor([[s * 1e3 for s in step_s], ns_ms], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # per round: the slowest rank's step and NS time
        if rank == 0:
            dtype = ns_dtype or optim.newton_schulz.default_dtype(params[0])
            torch.save({"step_ms": slowest[0].tolist(), "ns_ms": slowest[1].tolist(), "ns_dtype": str(dtype),
                        "params": [p.detach() for p in params]}, Path(out_dir) / "rank0.pt")  # fmt: skip
    finally:
        dist.destroy_process_group()


def run_world(world: int, args: dict, timeout: float = 900.0) -> dict:
    """Start `world` processes and return rank 0's figures."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        procs = [ctx.Process(target=rank_main, args=(r, world, port, args, tmp)) for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"world size {world}: exit codes {[p.exitcode for p in procs]}")
        return torch.load(Path(tmp) / "rank0.pt")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10, help="timed steps per world size (default 10)")
    parser.add_argument("--worlds", default="1,2,4", help="world sizes, comma-separated; 1 first (default 1,2,4)")
    parser.add_argument("--shard-momentum", action="store_true", help="keep each momentum buffer on its owner only")
    parser.add_argument("--ns-dtype", choices=NS_DTYPES, default="auto", help="Newton–Schulz dtype (default auto)")
    parser.add_argument("--json", metavar="PATH", help="also write every figure as JSON to PATH")
    args = parser.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")]
    if worlds[0] != 1:
        raise SystemExit("--worlds must start with 1: the other world sizes are compared with it")
    cores = usable_cores()
    load_before = os.getloadavg()

    results = {}
    for world in worlds:
        settings = {"rounds": args.rounds, "shard_momentum": args.shard_momentum, "ns_dtype": args.ns_dtype,
                    "threads": max(1, cores // world)}  # fmt: skip
        results[world] = {**run_world(world, settings), "threads": settings["threads"]}

    base = results[1]
    print(f"torch {torch.__version__}, {platform.machine()} CPU, {cores} usable cores; "
          f"gloo; torch threads per process = cores / world size (at least 1)")  # fmt: skip
    print(f"load average (1 min) before / after: {load_before[0]:.2f} / {os.getloadavg()[0]:.2f}")
    print(
        f"GPT-shaped set of bench/optim_step.py, fp32 parameters, shard_momentum={args.shard_momentum}, "
        f"NS dtype {base['ns_dtype'].split('.')[-1]} ({args.ns_dtype}); {args.rounds} timed steps after 1 warm-up"
    )
    print(f"{'processes':>9}{'threads':>9}{'median ms':>11}{'min ms':>9}{'NS ms':>8}{'vs 1 process':>14}"
          f"{'max |param diff| vs 1':>24}")  # fmt: skip
    summary = {}
    for world, r in results.items():
        median, fastest = statistics.median(r["step_ms"]), min(r["step_ms"])
        ratio = median / statistics.median(base["step_ms"])
        diff = max(float((a - b).abs().max()) for a, b in zip(r["params"], base["params"]))
        summary[world] = {"threads": r["threads"], "step_ms": r["step_ms"], "ns_ms": r["ns_ms"], "median_ms": median,
                          "min_ms": fastest, "ratio_to_1": ratio, "max_param_diff": diff}  # fmt: skip
        print(f"{world:>9}{r['threads']:>9}{median:>11.1f}{fastest:>9.1f}{statistics.median(r['ns_ms']):>8.1f}"
              f"{ratio:>14.2f}{diff:>24.2e}")  # fmt: skip
    print(
        "NS ms: the slowest rank's orthogonalization time per step (median); the rest of a step is momentum,"
        " the update and, above 1 process, the all-gather of the owners' parameters."
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cores": cores, "load_before_after": [load_before[0], os.getloadavg()[0]],
                       "ns_dtype": base["ns_dtype"], "shard_momentum": args.shard_momentum, "rounds": args.rounds,
                       "worlds": summary}, f, indent=2)  # fmt: skip


if __name__ == "__main__":
    main()
