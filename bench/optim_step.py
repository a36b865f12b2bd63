"""One optimizer step on a GPT-shaped parameter set, CPU fp32 parameters: our Muon (its default,
automatic Newton–Schulz dtype, and fp32) and NorMuon against the bare Newton–Schulz products,
torch.optim.Muon and AdamW; plus singular-value bands and peak memory.

Parameters: d_model 384, 4 layers, per layer the weights 1152x384, 384x384, 1536x384 and
384x1536 (16 matrices). Every contender owns its copy of the seeded parameters and gradients,
is warmed up once, then timed once per round in an interleaved order that rotates each round.
Memory is measured in a fresh process per contender, after the automatic dtype's one-time probe.

    .venv/bin/python bench/optim_step.py [--rounds 7] [--memory-runs 3] [--threads N] [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch

import optim

D_MODEL, N_LAYERS, NS_STEPS, LR, SEED = 384, 4, 5, 0.02, 0
LAYER_SHAPES = [(3 * D_MODEL, D_MODEL), (D_MODEL, D_MODEL), (4 * D_MODEL, D_MODEL), (D_MODEL, 4 * D_MODEL)]
KELLER_ABC = (3.4445, -4.7750, 2.0315)

OPTIMIZERS: dict[str, Callable[[list[torch.Tensor]], torch.optim.Optimizer]] = {
    "ours": lambda ps: optim.Muon(ps, lr=LR),  # the default: automatic NS dtype
    "ours-fp32": lambda ps: optim.Muon(ps, lr=LR, ns_dtype=torch.float32),
    "polar": lambda ps: optim.Muon(ps, lr=LR, ns_coefficients="polar_express"),
    "normuon": lambda ps: optim.Muon(ps, lr=LR, normuon=True),  # NorMuon, the same automatic dtype
    "torch.optim.Muon": lambda ps: torch.optim.Muon(ps, lr=LR, weight_decay=0.0),
    "AdamW": lambda ps: torch.optim.AdamW(ps),
}
RATIOS = {  # (numerator, denominator) -> target (or None)
    ("ours", "torch.optim.Muon"): 0.6,
    ("ours-fp32", "torch.optim.Muon"): None,
    ("polar", "torch.optim.Muon"): None,
    ("normuon", "ours"): 1.1,
    ("ours", "bare"): 0.7,
    ("ours-fp32", "bare"): None,
    ("torch.optim.Muon", "bare"): None,
    ("AdamW", "bare"): None,
}
NS_SETTINGS = {  # label -> (coefficients, method, dtype) for optim.orthogonalize; None: automatic
    "keller auto": ("keller", "auto", None),
    "keller fp32": ("keller", "auto", torch.float32),
    "polar_express auto": ("polar_express", "auto", None),
    # What "auto" declines in bf16 (optim.choose_method): the gram form, shown to leave the bands.
    "keller gram bf16": ("keller", "gram", torch.bfloat16),
    "polar_express gram bf16": ("polar_express", "gram", torch.bfloat16),
}
SPEC_BANDS = {"keller": (0.68, 1.14), "polar_express": (0.855, 1.143)}  # OPTIMIZER.md T2 / T3


def make_params(seed: int = SEED) -> list[torch.Tensor]:
    """The 16 fp32 weight matrices, seeded, each with a seeded Gaussian .grad."""
    gen = torch.Generator().manual_seed(seed)
    params = []
    for _ in range(N_LAYERS):
        for shape in LAYER_SHAPES:
            p = (torch.randn(shape, generator=gen) * 0.02).requires_grad_()
            p.grad = torch.randn(shape, generator=gen)
            params.append(p)
    return params


def bare_newton_schulz(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Five Keller NS steps per matrix as plain fp32 matmuls: A = X X^T, A A, B X per step."""
    a, b, c = KELLER_ABC
    out = []
    for G in grads:
        X = G.mT if G.shape[0] > G.shape[1] else G
        X = X / X.norm()
        for _ in range(NS_STEPS):
            A = torch.matmul(X, X.mT)
            B = b * A + c * torch.matmul(A, A)
            X = a * X + torch.matmul(B, X)
        out.append(X)
    return out


def machine_facts() -> dict:
    """torch version, threads, CPU model and fp32/bf16 GFLOP/s of one 384x1536 @ 1536x384 GEMM."""
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    facts = {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": cpu}
    facts["auto_dtype"] = str(optim.auto_dtype(torch.device("cpu"))).split(".")[-1]
    facts["probe_speedups"] = [optim.precision.narrow_speedup(torch.device("cpu")) for _ in range(3)]
    flops = 2 * D_MODEL * 4 * D_MODEL * D_MODEL
    for dtype in (torch.float32, torch.bfloat16):
        x, y = torch.randn(D_MODEL, 4 * D_MODEL, dtype=dtype), torch.randn(4 * D_MODEL, D_MODEL, dtype=dtype)
        torch.matmul(x, y)
        times = []
        for _ in range(20):
            t0 = time.perf_counter()
            torch.matmul(x, y)
            times.append(time.perf_counter() - t0)
        facts[f"gflops_{str(dtype).split('.')[-1]}"] = flops / statistics.median(times) / 1e9
    return facts


def build_contenders() -> dict[str, Callable[[], object]]:
    """name -> a zero-argument step; each contender holds its own parameters and gradients."""
    grads = [p.grad for p in make_params()]
    contenders: dict[str, Callable[[], object]] = {"bare": lambda: bare_newton_schulz(grads)}
    for name, factory in OPTIMIZERS.items():
        contenders[name] = factory(make_params()).step
    return contenders


def time_contenders(contenders: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    """One warm-up step each, then `rounds` rounds timing every contender once (ms), order rotated."""
    for step in contenders.values():
        step()
    names = list(contenders)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            t0 = time.perf_counter()
            contenders[name]()
            times[name].append((time.perf_counter() - t0) * 1e3)
    return times


def accuracy() -> list[dict]:
    """Singular values of optim.orthogonalize on one Gaussian per distinct shape, per NS setting,
    next to the scalar-map band over [sigma_min / ||G||_F, 1] of that very input."""
    rows = []
    for i, shape in enumerate(dict.fromkeys(LAYER_SHAPES)):
        G = torch.randn(shape, generator=torch.Generator().manual_seed(SEED + 100 + i))
        low = float(torch.linalg.svdvals(G.double()).min() / G.double().norm())
        m, n = sorted(shape)
        for label, (coefficients, method, dtype) in NS_SETTINGS.items():
            dtype = dtype or optim.precision.default_dtype(G)
            s = torch.linalg.svdvals(optim.orthogonalize(G, NS_STEPS, coefficients, method, dtype).double())
            band = optim.singular_value_band(coefficients, NS_STEPS, low=low)
            form = f"{optim.choose_method(m, n, method, dtype)} {str(dtype).split('.')[-1]}"
            lo, hi = SPEC_BANDS[coefficients]
            in_spec = bool(lo <= s.min() and s.max() <= hi) if m != n else None  # square: see the docs
            rows.append(
                {
                    "shape": f"{shape[0]}x{shape[1]}",
                    "setting": label,
                    "form": form,
                    "low": low,
                    "sv_min": float(s.min()),
                    "sv_max": float(s.max()),
                    "band": band,
                    "in_spec_band": in_spec,
                }
            )
    return rows


def peak_rss_kib() -> tuple[int, int]:
    """(ru_maxrss, VmHWM) in KiB. A spawned child's ru_maxrss starts at its parent's peak (Linux
    carries it across exec), so the benchmark reports VmHWM, this process's own high-water mark."""
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        with open("/proc/self/status") as f:
            hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        hwm = maxrss
    return maxrss, hwm


def step_tensor_peak(step: Callable[[], object]) -> int:
    """Bytes of the tensors one call of ``step`` allocates that are live at once, at their peak,
    from the allocator events of torch's profiler (library buffers and malloc's retention, which
    the RSS figures include, are not tensors and are not counted)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = prof.profiler.kineto_results.events()
    live = peak = 0
    for _, nbytes in sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]"):
        live += nbytes
        peak = max(peak, live)
    return peak


def memory_child(name: str) -> None:
    """Run in a fresh process: peak-RSS growth over 3 steps, the persistent state, and the tensor
    memory of a fourth step (its peak allocations plus the scratch the optimizer keeps between
    steps); prints JSON. The automatic Newton-Schulz dtype's probe runs first in every
    contender's process alike: it runs once per process (the choice is cached), so it is not a
    step's memory, and its own peak-RSS growth is reported apart."""
    params = make_params()
    probe_before = peak_rss_kib()
    optim.precision.auto_dtype(torch.device("cpu"))
    probe_after = peak_rss_kib()
    if name == "bare":
        opt, step = None, lambda: bare_newton_schulz([p.grad for p in params])
    else:
        opt = OPTIMIZERS[name](params)
        step = opt.step
    before = peak_rss_kib()
    for _ in range(3):
        step()
    after = peak_rss_kib()
    states = [opt.state[p] for p in params] if opt else [{} for _ in params]
    tensors = [t for st in states for t in st.values() if torch.is_tensor(t)]
    scratch = sum(v.nbytes for v in vars(opt).values() if isinstance(v, optim.Scratch)) if opt else 0
    print(
        json.dumps(
            {
                "rss_increase_mib": (after[1] - before[1]) / 1024,
                "probe_rss_increase_mib": (probe_after[1] - probe_before[1]) / 1024,
                "ru_maxrss_increase_mib": (after[0] - before[0]) / 1024,
                "step_tensor_peak_mib": step_tensor_peak(step) / 2**20,
                "scratch_mib": scratch / 2**20,
                "state_bytes": sum(t.numel() * t.element_size() for t in tensors),
                "state_tensors_per_param": sorted({sum(torch.is_tensor(t) for t in st.values()) for st in states}),
                "state_keys": sorted({k for st in states for k in st}),
            }
        )
    )


def memory(threads: int, runs: int) -> dict[str, dict]:
    """memory_child for "bare" and every optimizer, each in its own subprocess, `runs` times
    (interleaved); the figures of the run with the median peak, plus every run's peak and the
    transient part (peak growth minus persistent state)."""
    names = ["bare", *OPTIMIZERS]
    results: dict[str, list[dict]] = {name: [] for name in names}
    for _ in range(runs):
        for name in names:
            cmd = [sys.executable, __file__, "--memory-child", name, "--threads", str(threads)]
            res = subprocess.run(cmd, capture_output=True, text=True, check=True)
            results[name].append(json.loads(res.stdout.strip().splitlines()[-1]))
    out = {}
    for name, runs_of_name in results.items():
        ordered = sorted(runs_of_name, key=lambda r: r["rss_increase_mib"])
        out[name] = dict(ordered[len(ordered) // 2])
        out[name]["rss_increase_all_mib"] = [r["rss_increase_mib"] for r in runs_of_name]
        out[name]["transient_mib"] = out[name]["rss_increase_mib"] - out[name]["state_bytes"] / 2**20
        out[name]["tensor_transient_mib"] = out[name]["step_tensor_peak_mib"] + out[name]["scratch_mib"]
    return out


def summarize(times: dict[str, list[float]]) -> tuple[dict, dict]:
    """Per contender median/min ms; per ratio the quotient of medians and of mins."""
    stats = {n: {"median_ms": statistics.median(t), "min_ms": min(t), "all_ms": t} for n, t in times.items()}
    ratios = {
        f"{a}/{b}": {
            "median": stats[a]["median_ms"] / stats[b]["median_ms"],
            "min": stats[a]["min_ms"] / stats[b]["min_ms"],
            "target": target,
        }
        for (a, b), target in RATIOS.items()
    }
    return stats, ratios


def report(facts: dict, rounds: int, stats: dict, ratios: dict, acc: list[dict], mem: dict) -> None:
    """Print the machine line and the four tables."""
    print(f"torch {facts['torch']}, {facts['threads']} threads, CPU: {facts['cpu']}")
    print(
        f"384x1536 @ 1536x384 GEMM: fp32 {facts['gflops_float32']:.1f} GFLOP/s, "
        f"bf16 {facts['gflops_bfloat16']:.1f} GFLOP/s"
    )
    speedups = ", ".join(f"{x:.2f}" for x in facts["probe_speedups"])
    print(f"automatic NS dtype: {facts['auto_dtype']} (bf16 probe speedups, 3 re-runs: {speedups})\n")
    print(f"Step time, CPU fp32 parameters, {rounds} interleaved rounds")
    print(f"{'contender':<20}{'median ms':>11}{'min ms':>10}")
    for name, s in stats.items():
        print(f"{name:<20}{s['median_ms']:>11.1f}{s['min_ms']:>10.1f}")
    print(f"\n{'ratio':<28}{'median':>8}{'min':>8}")
    for name, r in ratios.items():
        target = (
            ""
            if r["target"] is None
            else f"   (target <= {r['target']}: {'met' if r['median'] <= r['target'] else 'NOT met'})"
        )
        print(f"{name:<28}{r['median']:>8.3f}{r['min']:>8.3f}{target}")
    print("\nSingular values of optim.orthogonalize (Gaussian input, float64 svdvals)")
    print(
        f"{'shape':<10}{'setting':<25}{'form':<18}{'sv min':>8}{'sv max':>8}  band over [low, 1]  low"
        "       in T2/T3 band"
    )
    for r in acc:
        lo, hi = r["band"]
        verdict = {True: "yes", False: "NO", None: "n/a (square)"}[r["in_spec_band"]]
        print(
            f"{r['shape']:<10}{r['setting']:<25}{r['form']:<18}{r['sv_min']:>8.4f}{r['sv_max']:>8.4f}"
            f"  [{lo:.4f}, {hi:.4f}]    {r['low']:.2e}  {verdict}"
        )
    runs = len(next(iter(mem.values()))["rss_increase_all_mib"])
    probe = [m["probe_rss_increase_mib"] for m in mem.values()]
    print(
        f"\nMemory, fresh process per optimizer, 3 steps, median of {runs} runs (peak RSS: VmHWM); the dtype"
        f" probe ran first in each (once per process: +{min(probe):.1f}-{max(probe):.1f} MiB, not counted)"
    )
    print(
        f"{'optimizer':<20}{'peak RSS +MiB':>14}{'transient MiB':>14}{'state MiB':>11}  every run +MiB"
        "        tensors/param  keys"
    )
    for name, m in mem.items():
        every = ", ".join(f"{x:.1f}" for x in m["rss_increase_all_mib"])
        print(
            f"{name:<20}{m['rss_increase_mib']:>14.1f}{m['transient_mib']:>14.1f}"
            f"{m['state_bytes'] / 2**20:>11.2f}  {every:<20}"
            f"  {m['state_tensors_per_param']!s:<13}  {', '.join(m['state_keys']) or '-'}"
        )
    print("\nTensor memory of a warm step (4th): peak of its allocations + scratch kept between steps")
    print(f"{'optimizer':<20}{'step peak MiB':>14}{'scratch MiB':>12}{'total MiB':>11}")
    for name, m in mem.items():
        print(
            f"{name:<20}{m['step_tensor_peak_mib']:>14.2f}{m['scratch_mib']:>12.2f}{m['tensor_transient_mib']:>11.2f}"
        )
    for key, label in (("transient_mib", "RSS"), ("tensor_transient_mib", "tensors")):
        ours, theirs = mem["ours"][key], mem["torch.optim.Muon"][key]
        verdict = "met" if ours <= theirs else "NOT met"
        print(
            f"transient peak ({label}), ours vs torch.optim.Muon: {ours:.2f} vs {theirs:.2f} MiB "
            f"(target ours <= theirs: {verdict})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds (default 7)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    parser.add_argument("--memory-runs", type=int, default=3, help="fresh processes per optimizer (default 3)")
    parser.add_argument("--quick", action="store_true", help="2 rounds, 1 memory run: a smoke run")
    parser.add_argument("--json", metavar="PATH", help="also write every figure as JSON to PATH")
    parser.add_argument("--memory-child", metavar="NAME", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_child:
        memory_child(args.memory_child)
        return
    rounds = min(2, args.rounds) if args.quick else args.rounds

    facts = machine_facts()
    stats, ratios = summarize(time_contenders(build_contenders(), rounds))
    acc = accuracy()
    mem = memory(torch.get_num_threads(), 1 if args.quick else args.memory_runs)
    report(facts, rounds, stats, ratios, acc, mem)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "machine": facts,
                    "rounds": rounds,
                    "step": stats,
                    "ratios": ratios,
                    "singular_values": acc,
                    "memory": mem,
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
