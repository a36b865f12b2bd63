"""What only a CUDA device shows: Newton–Schulz in fp16, bf16 and fp32, one optimizer step against
torch.optim.Muon and AdamW, the attention's exact max-logit recompute next to fused attention,
short engine runs under bf16 autocast and fp32, and QK-Clip's MAX all-reduce over nccl.

Sections (``--only`` picks some, comma-separated):

* ``ns``: ``optim.orthogonalize`` on a Gaussian 768x3072, its transpose and one Gaussian per
  shape of bench/optim_step.py's GPT-shaped set and of the 151 M set below, in fp32, bf16 and
  fp16, standard and gram forms,
  Keller and Polar Express: singular values (float64 svdvals) against the scalar map's band
  and the bands of docs (Keller [0.68, 1.14], Polar Express [0.855, 1.143]); median time per
  call (CUDA events, after warm-up), and the GPT set orthogonalized per shape as the optimizer
  batches it.
* ``step``: one optimizer step on the GPT-shaped set (d_model 384, 4 layers) and on a wider one
  (d_model 1024, 12 layers), fp32 parameters: ``optim.Muon`` (its CUDA default runs NS in fp16,
  the gram form for the non-square shapes from 1,024 rows; "ours-standard" the standard form only; "ours-ns-bf16"
  and "ours-ns-fp32" NS in bf16 (standard form) and fp32; "ours-sym-blocks" with 16-bit symmetric
  products as three blocks; "ours-normuon" NorMuon's; "ours-per-head" with
  each fused W_qkv split by heads of 64 rows), ``torch.optim.Muon`` (NS in bf16) and
  ``torch.optim.AdamW``; interleaved rounds, medians, ratios, peak-memory growth over 3 steps,
  and each Muon's update against a float64 reference.
* ``batch``: ``optim.Muon``'s step on both sets at each CUDA batch cap (1 to 256 MiB of gradient
  per stacked Newton–Schulz call) against torch.optim.Muon, interleaved; and each cap's peak
  memory growth.
* ``attention``: the engine's CausalSelfAttention (SDPA + ``causal_max_logits``) against the
  per-head max of q k^T / sqrt(d) computed explicitly (fp32 and float64) from the same q and k,
  in fp32 and under bf16 autocast; the output against the explicit softmax path; the forward
  (and forward + backward) with the recompute on and off.
* ``engine``: ``worker.engine.run.run_job`` on the builtin synthetic task, gpt + muonclip,
  bf16 autocast and fp32, and one run whose tau binds: tokens/s, final loss against the task's
  entropy floor, attn_max_logit against tau.
* ``group``: a job run as a torch.distributed group (``worker.engine.launch.run_group``: torchrun,
  nccl, DDP on the GPU, rank 0's telemetry through the launcher's socket) against the same job in
  this process: tokens/s, losses; then one rank killed with SIGKILL mid-run (``RankFailed``) and
  the job resumed from its checkpoint to the end. One GPU holds one rank (nccl refuses two ranks
  on one device), so the group here has one.
* ``host``: where a training step's time goes on a small model (bench/convergence.py's large
  configuration: gpt 4 layers, d_model 256, seq 64, batch 32, the synthetic task), AdamW, Muon
  and MuonClip through the engine's Trainer: the whole step, the optimizer's step synchronised
  before and after and the host's share of it (the time to issue its kernels), and CUDA kernels
  per training step and per optimizer step.
* ``profile`` (only when named): the ops of our Muon's and NorMuon's step on both sets under
  torch.profiler: each op's calls and device time per step, and what NorMuon adds, op by op
  (with ``--json``, each profile's Chrome trace beside it).
* ``dist``: QK-Clip's S_max all-reduce (MAX) with the nccl backend, world sizes 1 and 2 (world 2
  needs two GPUs: nccl refuses two ranks on one device); where nccl cannot run world 2, the same
  two-rank check runs on gloo (CPU tensors), so the MAX over ranks is still exercised.

The ns, step, batch, profile and dist sections need torch (with CUDA) only; attention, engine,
group and host import the engine, which needs pydantic too (the contract's spec models).
Without a CUDA device it exits at once with one line saying so.

    PYTHONPATH=. python3 bench/gpu.py [--quick] [--only ns,...,group,host] [--json PATH]
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from optim_step import LAYER_SHAPES

import optim
import optim.muon
from optim import newton_schulz

SECTIONS = ("ns", "step", "batch", "attention", "engine", "dist", "group", "host")
PROFILED = ("ours", "ours-normuon")  # --only profile: where NorMuon's step time goes, op by op
NS_STEPS, SEED, LR = 5, 0, 0.02
SPEC_BANDS = {"keller": (0.68, 1.14), "polar_express": (0.855, 1.143)}  # T2 / T3 of the optimizer spec
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
STEP_SETS = {"gpt-384x4": (384, 4), "gpt-1024x12": (1024, 12)}  # name -> (d_model, layers)
ATTENTION_SHAPES = [(8, 8, 1024, 64), (8, 8, 4096, 64), (4, 16, 2048, 128)]  # B, H, T, D
QK_SCALE = 8.0  # q and k rows x8: logits x64, per-head maxima near 100 (the default tau)
ENGINE_MODEL = {"arch": "gpt", "n_layer": 4, "n_head": 4, "d_model": 256, "seq_len": 256}
ENGINE_TRAIN = {"batch_size": 32, "eval_every": 100, "seed": 0}
LOW_TAU = 5.0  # a tau the synthetic task's logits pass early, so the clip binds


# ---- timing --------------------------------------------------------------------------------------


def time_ms(fn: Callable[[], object], device: torch.device, warmup: int = 3, iters: int = 30) -> list[float]:
    """ms per call: CUDA events around each call (the queue drained first), host clock elsewhere."""
    for _ in range(warmup):
        fn()
    return [once_ms(fn, device) for _ in range(iters)]


def once_ms(fn: Callable[[], object], device: torch.device) -> float:
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def machine_facts(device: torch.device) -> dict:
    facts = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": str(device),
        "python": platform.python_version(),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        facts["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        facts["nvidia_smi"] = f"unavailable: {exc}"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        facts |= {
            "name": props.name,
            "sm_count": props.multi_processor_count,
            "memory_gib": props.total_memory / 2**30,
            "capability": f"{props.major}.{props.minor}",
        }
    n = 4096 if device.type == "cuda" else 512
    for label, dtype in DTYPES.items():
        a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
        ms = med(time_ms(functools.partial(torch.mm, a, b), device, 3, 10))
        facts[f"gemm_{n}_{label}_tflops"] = 2 * n**3 / ms / 1e9
    return facts


# ---- ns ------------------------------------------------------------------------------------------


def gaussian(shape: tuple[int, ...], seed: int, device: torch.device) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(device)


def ns_section(device: torch.device, iters: int) -> dict:
    """Bands and time per call for every (shape, dtype, coefficients, form)."""
    shapes = [(768, 3072), (3072, 768), *dict.fromkeys(LAYER_SHAPES + layer_shapes(1024))]
    rows = []
    for i, shape in enumerate(shapes):
        G = gaussian(shape, SEED + 100 + i, device)
        sv = torch.linalg.svdvals(G.double())
        low = float(sv.min() / sv.square().sum().sqrt())
        m, n = sorted(shape)
        for label, dtype in DTYPES.items():
            for coefficients in SPEC_BANDS:
                band = optim.singular_value_band(coefficients, NS_STEPS, low=low)
                for method in ("standard", "gram"):
                    run = functools.partial(optim.orthogonalize, G, NS_STEPS, coefficients, method, dtype)
                    s = torch.linalg.svdvals(run().double())
                    lo, hi = SPEC_BANDS[coefficients]
                    rows.append(
                        {
                            "shape": f"{shape[0]}x{shape[1]}",
                            "dtype": label,
                            "coefficients": coefficients,
                            "method": method,
                            "auto": optim.choose_method(m, n, "auto", dtype, device.type),
                            "low": low,
                            "sv_min": float(s.min()),
                            "sv_max": float(s.max()),
                            "band": band,
                            "in_spec_band": lo <= float(s.min()) and float(s.max()) <= hi,
                            "median_ms": med(time_ms(run, device, iters=iters)),
                        }
                    )
    gpt = []  # the GPT-shaped set as the optimizer sees it: one [layers, m, n] stack per shape
    stacks = [gaussian((4, *shape), SEED + 200 + i, device) for i, shape in enumerate(dict.fromkeys(LAYER_SHAPES))]
    for label, dtype in DTYPES.items():
        for coefficients in SPEC_BANDS:
            for method in ("standard", "gram", "auto"):

                def run(c=coefficients, mt=method, dt=dtype):
                    for X in stacks:
                        optim.orthogonalize(X, NS_STEPS, c, mt, dt)

                gpt.append(
                    {
                        "dtype": label,
                        "coefficients": coefficients,
                        "method": method,
                        "median_ms": med(time_ms(run, device, iters=iters)),
                    }
                )
    return {"shapes": rows, "gpt_set": gpt}


# ---- step ----------------------------------------------------------------------------------------


def layer_shapes(d: int) -> list[tuple[int, int]]:
    return [(3 * d, d), (d, d), (4 * d, d), (d, 4 * d)]


def make_params(d: int, layers: int, device: torch.device, dtype=torch.float32) -> list[torch.Tensor]:
    """Seeded fp32 weights with seeded Gaussian gradients (the same set for every contender)."""
    gen = torch.Generator().manual_seed(SEED)
    params = []
    for _ in range(layers):
        for shape in layer_shapes(d):
            p = (torch.randn(shape, generator=gen) * 0.02).to(device, dtype).requires_grad_()
            p.grad = torch.randn(shape, generator=gen).to(device, dtype)
            params.append(p)
    return params


HEAD_DIM = 64


def per_head(ps: list[torch.Tensor]) -> list[dict]:
    """The set's groups with each fused W_qkv [3d, d] split by heads of HEAD_DIM rows."""
    fused = {p: optim.fused_qkv_blocks(p.shape[1] // HEAD_DIM, HEAD_DIM) for p in ps if p.shape[0] == 3 * p.shape[1]}
    return optim.split_by_heads([{"params": ps}], fused)


def symmetric_blocks_16bit(step: Callable[[], object]) -> Callable[[], object]:
    """The step with 16-bit symmetric products computed as three blocks too (a what-if: on CPU they are one GEMM)."""

    def blocked() -> object:
        saved, newton_schulz.SYMMETRIC_BLOCK_MIN_BYTES = newton_schulz.SYMMETRIC_BLOCK_MIN_BYTES, 2
        try:
            return step()
        finally:
            newton_schulz.SYMMETRIC_BLOCK_MIN_BYTES = saved

    blocked.__self__ = step.__self__  # step_memory reads the optimizer's state through it
    return blocked


OPTIMIZERS: dict[str, Callable[[list[torch.Tensor]], Callable[[], object]]] = {
    "ours": lambda ps: optim.Muon(ps, lr=LR).step,
    "ours-normuon": lambda ps: optim.Muon(ps, lr=LR, normuon=True).step,
    "ours-per-head": lambda ps: optim.Muon(per_head(ps), lr=LR).step,
    "ours-ns-fp32": lambda ps: optim.Muon(ps, lr=LR, ns_dtype=torch.float32).step,
    "ours-ns-bf16": lambda ps: optim.Muon(ps, lr=LR, ns_dtype=torch.bfloat16).step,
    "ours-sym-blocks": lambda ps: symmetric_blocks_16bit(optim.Muon(ps, lr=LR).step),
    "ours-standard": lambda ps: optim.Muon(ps, lr=LR, ns_method="standard").step,
    "ours-polar": lambda ps: optim.Muon(ps, lr=LR, ns_coefficients="polar_express").step,
    "torch.optim.Muon": lambda ps: torch.optim.Muon(ps, lr=LR, weight_decay=0.0).step,
    "AdamW": lambda ps: torch.optim.AdamW(ps).step,
    "AdamW-fused": lambda ps: torch.optim.AdamW(ps, fused=True).step,
}
STEP_RATIOS = [
    ("ours", "torch.optim.Muon"),
    ("ours-ns-bf16", "torch.optim.Muon"),
    ("ours-standard", "torch.optim.Muon"),
    ("ours-sym-blocks", "torch.optim.Muon"),
    ("ours-normuon", "ours"),
    ("ours-per-head", "ours"),
    ("ours-ns-fp32", "ours"),
    ("ours-standard", "ours"),
    ("ours-polar", "ours"),
    ("ours", "AdamW"),
    ("torch.optim.Muon", "AdamW"),
]
PARITY = ("ours", "ours-ns-fp32", "ours-ns-bf16", "ours-standard", "torch.optim.Muon")


def step_section(device: torch.device, rounds: int) -> dict:
    out = {}
    for name, (d, layers) in STEP_SETS.items():
        steps = {k: make(make_params(d, layers, device)) for k, make in OPTIMIZERS.items()}
        for step in steps.values():
            step()
        times: dict[str, list[float]] = {k: [] for k in steps}
        names = list(steps)
        for r in range(rounds):  # interleaved, order rotating each round
            k = r % len(names)
            for key in names[k:] + names[:k]:
                times[key].append(once_ms(steps[key], device))
        del steps
        stats = {k: {"median_ms": med(t), "min_ms": min(t)} for k, t in times.items()}
        ratios = {f"{a}/{b}": stats[a]["median_ms"] / stats[b]["median_ms"] for a, b in STEP_RATIOS}
        n_params = sum(a * b for a, b in layer_shapes(d)) * layers
        out[name] = {
            "params": n_params,
            "rounds": rounds,
            "step": stats,
            "ratios": ratios,
            "memory": step_memory(d, layers, device),
            "parity": step_parity(d, layers, device),
        }
    return out


def step_memory(d: int, layers: int, device: torch.device) -> dict:
    """Per optimizer, fresh: peak allocated over 3 steps above what was allocated before them, and the state."""
    out = {}
    for key, make in OPTIMIZERS.items():
        params = make_params(d, layers, device)
        step = make(params)
        opt = getattr(step, "__self__", None) or step.step.__self__
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        for _ in range(3):
            step()
        state = [t for st in opt.state.values() for t in st.values() if torch.is_tensor(t)]
        entry = {"state_mib": sum(t.numel() * t.element_size() for t in state) / 2**20}
        if device.type == "cuda":
            torch.cuda.synchronize()
            entry["peak_growth_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
            entry["transient_mib"] = entry["peak_growth_mib"] - entry["state_mib"]
        out[key] = entry
        del params, step, opt, state
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def step_parity(d: int, layers: int, device: torch.device) -> dict:
    """Relative L2 error of one step's parameter change against optim.Muon in float64 (NS in float64)."""
    ref_params = make_params(d, layers, device, torch.float64)
    before = [p.detach().clone() for p in ref_params]
    optim.Muon(ref_params, lr=LR).step()
    ref = torch.cat([(p.detach() - b).flatten() for p, b in zip(ref_params, before)])
    out = {}
    for key in PARITY:
        params = make_params(d, layers, device)
        before = [p.detach().double() for p in params]
        OPTIMIZERS[key](params)()
        delta = torch.cat([(p.detach().double() - b).flatten() for p, b in zip(params, before)])
        out[key] = float((delta - ref).norm() / ref.norm())
    return out


def profile_section(device: torch.device, steps: int = 3, top: int = 12, trace_dir: Path | None = None) -> dict:
    """The ops of PROFILED's steps on both sets under torch.profiler (after 2 warm steps): per op,
    calls and self time on the device (on the host where there is no device), per step; the top
    ``top`` of each, and what each op adds to the step of the second against the first. With
    ``trace_dir``, each profile's timeline as a Chrome trace (``profile-<set>-<optimizer>.json``)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    out: dict[str, Any] = {}
    for name, (d, layers) in STEP_SETS.items():
        ops: dict[str, dict[str, tuple[int, float]]] = {}
        for key in PROFILED:
            step = OPTIMIZERS[key](make_params(d, layers, device))
            for _ in range(2):
                step()
            with profile(activities=activities) as prof:
                for _ in range(steps):
                    step()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
            if trace_dir is not None:
                prof.export_chrome_trace(str(trace_dir / f"profile-{name}-{key}.json"))
            per_op = {}
            for event in prof.key_averages():
                us = getattr(event, "self_device_time_total", 0) if device.type == "cuda" else event.self_cpu_time_total
                per_op[event.key] = (event.count // steps, us / steps / 1e3)
            ops[key] = per_op
        first, second = (ops[k] for k in PROFILED)
        added = {op: second[op][1] - first.get(op, (0, 0.0))[1] for op in second}
        out[name] = {
            "top": {k: sorted(v.items(), key=lambda kv: -kv[1][1])[:top] for k, v in ops.items()},
            "total_ms": {k: sum(ms for _, ms in v.values()) for k, v in ops.items()},
            "calls": {k: sum(n for n, _ in v.values()) for k, v in ops.items()},
            "added": sorted(added.items(), key=lambda kv: -kv[1])[:top],
        }
        print(f"\nProfile, {name}: ms a step by op ({'device' if device.type == 'cuda' else 'host'} self time)")
        for key in PROFILED:
            print(f"  {key}: {out[name]['total_ms'][key]:.3f} ms, {out[name]['calls'][key]} calls")
            for op, (n, ms) in out[name]["top"][key]:
                print(f"    {ms:9.3f} ms {n:6d}x  {op}")
        print(f"  added by {PROFILED[1]}:")
        for op, ms in out[name]["added"]:
            print(f"    {ms:+9.3f} ms  {op}")
    return out


BATCH_CAPS_MIB = (4, 16, 64, 128, 256, 1024)


def batch_section(device: torch.device, rounds: int) -> dict:
    """optim.Muon's step against its CUDA batch cap (``optim.muon.MAX_BATCH_BYTES_CUDA``), every cap
    and torch.optim.Muon interleaved per set; then each cap's peak memory growth over 3 fresh steps."""
    import optim.muon as muon_module

    default = muon_module.MAX_BATCH_BYTES_CUDA
    out = {"default_mib": default >> 20}
    try:
        for name, (d, layers) in STEP_SETS.items():
            caps = {f"cap {c} MiB": c << 20 for c in BATCH_CAPS_MIB}
            steps = {k: optim.Muon(make_params(d, layers, device), lr=LR).step for k in caps}
            steps["torch.optim.Muon"] = OPTIMIZERS["torch.optim.Muon"](make_params(d, layers, device))

            def call(key: str, caps=caps, steps=steps) -> None:
                if key in caps:
                    muon_module.MAX_BATCH_BYTES_CUDA = caps[key]
                steps[key]()

            for key in steps:
                call(key)
            times: dict[str, list[float]] = {k: [] for k in steps}
            names = list(steps)
            for r in range(rounds):
                for key in names[r % len(names) :] + names[: r % len(names)]:
                    times[key].append(once_ms(functools.partial(call, key), device))
            steps.clear()
            torch.cuda.empty_cache()
            base = med(times["torch.optim.Muon"])
            rows = {k: {"median_ms": med(t), "vs_torch": med(t) / base} for k, t in times.items()}
            for key, cap in caps.items():
                muon_module.MAX_BATCH_BYTES_CUDA = cap
                params = make_params(d, layers, device)
                opt = optim.Muon(params, lr=LR)
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
                for _ in range(3):
                    opt.step()
                torch.cuda.synchronize()
                rows[key]["peak_growth_mib"] = (torch.cuda.max_memory_allocated() - before) / 2**20
                del params, opt
                torch.cuda.empty_cache()
            out[name] = rows
    finally:
        muon_module.MAX_BATCH_BYTES_CUDA = default
    return out


# ---- attention -----------------------------------------------------------------------------------


def attention_module(H: int, D: int, device: torch.device):
    from worker.engine.models import CausalSelfAttention

    torch.manual_seed(SEED)
    mod = CausalSelfAttention(H * D, H).to(device).train()
    with torch.no_grad():
        mod.qkv.weight[: 2 * H * D].mul_(QK_SCALE)
    return mod


def qk(mod, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v [B, H, T, D] exactly as the module's forward makes them (under the caller's autocast)."""
    B, T, C = x.shape
    q, k, v = mod.qkv(x).split(C, dim=2)
    return tuple(t.view(B, T, mod.n_head, mod.head_dim).transpose(1, 2) for t in (q, k, v))


def explicit_max_logits(q: torch.Tensor, k: torch.Tensor, dtype: torch.dtype, product_dtype=None) -> torch.Tensor:
    """[H] max over batch and causal pairs of q.k / sqrt(d), one batch element at a time, all in ``dtype``
    (``product_dtype``: the dtype of the product itself, rounded, before the max)."""
    T, scale = q.shape[2], 1.0 / math.sqrt(q.shape[-1])
    mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    best = torch.full((q.shape[1],), -math.inf, dtype=dtype, device=q.device)
    with torch.autocast(q.device.type, enabled=False):
        for b in range(q.shape[0]):
            qb, kb = (q[b], k[b]) if product_dtype else (q[b].to(dtype), k[b].to(dtype))
            s = (qb @ kb.mT).to(dtype) * scale  # [H, T, T]
            best = torch.maximum(best, s.masked_fill(~mask, -math.inf).amax(dim=(1, 2)))
    return best


def explicit_forward(mod, x: torch.Tensor) -> torch.Tensor:
    """The module's non-fused path: softmax(masked q k^T / sqrt(d)) v, then the projection."""
    B, T, C = x.shape
    q, k, v = qk(mod, x)
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(mod.head_dim))
    att = att.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=x.device).tril(), float("-inf"))
    y = F.softmax(att, dim=-1) @ v
    return mod.proj(y.transpose(1, 2).reshape(B, T, C))


def attention_section(device: torch.device, iters: int, shapes=ATTENTION_SHAPES) -> list[dict]:
    rows = []
    for B, H, T, D in shapes:
        mod = attention_module(H, D, device)
        x = gaussian((B, T, H * D), SEED + 1, device)
        for label in DTYPES:
            row = {"shape": f"B={B} H={H} T={T} D={D}", "precision": label}
            rows.append(row | attention_row(mod, x, label == "bf16", device, iters))
        del mod, x
    return rows


def attention_row(mod, x: torch.Tensor, bf16: bool, device: torch.device, iters: int) -> dict:
    """Accuracy of the recorded maxima and the output, and the cost of the recompute, for one precision."""
    from worker.engine.models import causal_max_logits

    ctx = functools.partial(torch.autocast, device.type, dtype=torch.bfloat16, enabled=bf16)
    with torch.no_grad(), ctx():
        mod.reset_qk_max_logits()
        y = mod(x)
        recorded = mod.qk_max_logits()
        q, k, _ = qk(mod, x)
        ref64 = explicit_max_logits(q, k, torch.float64)
        ref32 = explicit_max_logits(q, k, torch.float32)
        rounded = explicit_max_logits(q, k, torch.float64, product_dtype=q.dtype)  # product in q's dtype
        y_explicit = explicit_forward(mod, x)
    mod.reset_qk_max_logits()
    row: dict[str, Any] = {
        "qk_dtype": str(q.dtype).removeprefix("torch."),
        "max_logit": float(ref64.max()),
        "recorded_vs_fp64": float((recorded.double() - ref64).abs().max()),
        "recorded_vs_fp32": float((recorded - ref32).abs().max()),
        "product_in_qk_dtype_vs_fp64": float((rounded - ref64).abs().max()),
        "recorded_below_fp64_by": float((ref64 - recorded.double()).max()),
        "output_max_abs_diff": float((y.float() - y_explicit.float()).abs().max()),
        "output_max_abs": float(y_explicit.float().abs().max()),
    }
    del y, y_explicit
    with torch.no_grad(), ctx():
        row["recompute_ms"] = med(time_ms(functools.partial(causal_max_logits, q, k), device, iters=iters))
        row["recompute_product_in_qk_dtype_ms"] = med(
            time_ms(functools.partial(max_logits_product_in_qk_dtype, q, k), device, iters=iters)
        )
        row["recompute_fp32_upcast_ms"] = med(
            time_ms(functools.partial(max_logits_fp32_upcast, q, k), device, iters=iters)
        )
        row["fp32_upcast_vs_fp64"] = float((max_logits_fp32_upcast(q, k).double() - ref64).abs().max())
    del q, k

    def fwd():
        with torch.no_grad(), ctx():
            mod(x)
        mod.reset_qk_max_logits()

    def fwd_bwd():
        with ctx():
            out = mod(x)
        out.float().square().mean().backward()
        mod.reset_qk_max_logits()
        mod.zero_grad(set_to_none=True)

    for record in (False, True):
        mod.record_max_logits = record
        tag = "on" if record else "off"
        row[f"forward_ms_{tag}"] = med(time_ms(fwd, device, iters=iters))
        row[f"forward_backward_ms_{tag}"] = med(time_ms(fwd_bwd, device, iters=iters))
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            fwd()
            row[f"forward_peak_growth_mib_{tag}"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    mod.record_max_logits = True
    row["recompute_forward_overhead"] = row["forward_ms_on"] / row["forward_ms_off"] - 1
    row["recompute_step_overhead"] = row["forward_backward_ms_on"] / row["forward_backward_ms_off"] - 1
    return row


@torch.no_grad()
def max_logits_product_in_qk_dtype(q: torch.Tensor, k: torch.Tensor, block: int = 256) -> torch.Tensor:
    """causal_max_logits with the product left in q's dtype (no fp32 upcast): the cost of the cheaper variant."""
    T, scale = q.shape[2], 1.0 / math.sqrt(q.shape[-1])
    best = torch.full((q.shape[1],), float("-inf"), device=q.device)
    for start in range(0, T, block):
        stop = min(start + block, T)
        s = (q[:, :, start:stop] @ k[:, :, :stop].transpose(-2, -1)).float() * scale
        rows = torch.arange(start, stop, device=q.device).view(-1, 1)
        s = s.masked_fill(torch.arange(stop, device=q.device).view(1, -1) > rows, float("-inf"))
        best = torch.maximum(best, s.amax(dim=(0, 2, 3)))
    return best


@torch.no_grad()
def max_logits_fp32_upcast(q: torch.Tensor, k: torch.Tensor, block: int = 256) -> torch.Tensor:
    """The engine's earlier recompute, side by side with today's: q and k upcast to fp32, every
    block's full [b, stop] logits scaled and masked before the max."""
    T, scale = q.shape[2], 1.0 / math.sqrt(q.shape[-1])
    best = torch.full((q.shape[1],), float("-inf"), device=q.device)
    q, k = q.float(), k.float()
    with torch.autocast(q.device.type, enabled=False):
        for start in range(0, T, block):
            stop = min(start + block, T)
            s = (q[:, :, start:stop] @ k[:, :, :stop].transpose(-2, -1)) * scale
            rows = torch.arange(start, stop, device=q.device).view(-1, 1)
            s = s.masked_fill(torch.arange(stop, device=q.device).view(1, -1) > rows, float("-inf"))
            best = torch.maximum(best, s.amax(dim=(0, 2, 3)))
    return best


# ---- engine --------------------------------------------------------------------------------------


def engine_spec(device: str, precision: str, steps: int, tau: float | None) -> dict:
    """The shape of a validated JobSpec's model_dump(), as the engine reads it."""
    return {
        "name": f"bench-gpu-{precision}",
        "model": dict(ENGINE_MODEL),
        "data": {"builtin": "synthetic"},
        "optimizer": {"name": "muonclip", "qk_clip_tau": tau},
        "train": {**ENGINE_TRAIN, "steps": steps, "checkpoint_every": steps, "device": device, "precision": precision},
        "telemetry": {"every": 1, "sample_tokens": 0},
    }


def engine_section(device: torch.device, steps: int) -> dict:
    from worker.engine.data import synthetic_task
    from worker.engine.request import RunRequest
    from worker.engine.run import run_job

    floor = synthetic_task(ENGINE_TRAIN["seed"], tokens=4096).entropy_floor
    runs = []
    for precision, tau in (("auto", None), ("fp32", None), ("auto", LOW_TAU)):
        spec = engine_spec(device.type, precision, steps, tau)
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            result = run_job(RunRequest(spec, Path(tmp)))
            wall = time.perf_counter() - t0
            lines = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
        train = [line["metrics"] for line in lines if "loss" in line["metrics"]]
        eff_tau = 100.0 if tau is None else tau  # MuonClip's default
        logits = [m["attn_max_logit"] for m in train if "attn_max_logit" in m]
        clipped = [m.get("qk_clip/heads_clipped", 0.0) for m in train]
        tokens_per_step = ENGINE_TRAIN["batch_size"] * ENGINE_MODEL["seq_len"]
        step_ms = sorted(m["step_time_ms"] for m in train)
        runs.append(
            {
                "precision": precision,
                "autocast": "bf16" if precision == "auto" and device.type == "cuda" else None,
                "tau": eff_tau,
                "steps": result.steps,
                "status": result.status,
                "wall_s": wall,
                "tokens_per_s": result.tokens_per_s,
                "median_step_ms": med(step_ms),
                "median_tokens_per_s": tokens_per_step / med(step_ms) * 1e3,
                "final_loss": result.loss,
                "final_val_loss": result.val_loss,
                "entropy_floor": floor,
                "attn_max_logit_reported": len(logits) == len(train),
                "attn_max_logit_last": logits[-1] if logits else None,
                "attn_max_logit_max": max(logits) if logits else None,
                "steps_above_tau": sum(v > eff_tau for v in logits),
                "first_step_above_tau": next((i for i, v in enumerate(logits) if v > eff_tau), None),
                "max_logit_last_50_max": max(logits[-50:]) if logits else None,
                "steps_with_clip": sum(c > 0 for c in clipped),
                "heads_clipped_total": sum(clipped),
            }
        )
    return {"model": ENGINE_MODEL, "train": ENGINE_TRAIN, "runs": runs}


# ---- dist ----------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


DIST_SHAPE = (2, 64, 4, 16)  # B, T, H, D
# Between the ranks: rank 0's inputs give per-head maxima near 80-113 (one head over 100), rank 1's
# (1.5x larger inputs) near 200-250. Alone, rank 0 clips one head; with the MAX all-reduce, all four.
DIST_TAU = 100.0


def dist_inputs(rank: int, device: torch.device) -> torch.Tensor:
    B, T, H, D = DIST_SHAPE
    return gaussian((B, T, H * D), SEED + 10 + rank, device) * (1.0 + 0.5 * rank)  # ranks see different maxima


def dist_worker(rank: int, world: int, port: int, backend: str, out_dir: str) -> None:
    """One rank: nccl rejects CPU tensors; QK-Clip with no forward; a MuonClip step (lr 0: the clip alone)."""
    res: dict[str, Any] = {"rank": rank}
    try:
        device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
        )
        try:
            dist.all_reduce(torch.zeros(3), op=dist.ReduceOp.MAX)  # what S_max on the CPU would meet
            res["cpu_tensor_all_reduce"] = "ok"
        except Exception as exc:
            res["cpu_tensor_all_reduce"] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
        _, _, H, D = DIST_SHAPE
        fresh = attention_module(H, D, device)
        clipped, _ = optim.qk_clip([fresh], 1.0)  # no forward yet: every maximum is -inf
        res["no_forward_clip"] = f"ok, {int(clipped)} heads clipped"
        mod = attention_module(H, D, device)
        opt = optim.MuonClip(list(mod.parameters()), mod, qk_clip_tau=DIST_TAU, lr=0.0)
        mod(dist_inputs(rank, device)).square().mean().backward()
        res["local_maxima"] = mod.qk_max_logits().tolist()
        opt.step()
        res["heads_clipped"] = opt.last_step_stats()["qk_clip/heads_clipped"]
        res["qkv"] = mod.qkv.weight.detach().cpu()
        dist.destroy_process_group()
    except Exception:
        res["error"] = traceback.format_exc(limit=3).strip().splitlines()[-1]
    torch.save(res, Path(out_dir) / f"rank{rank}.pt")


def dist_run(world: int, backend: str, timeout: float = 120.0) -> dict:
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        procs = [ctx.Process(target=dist_worker, args=(r, world, port, backend, tmp)) for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()))
        hung = [p.pid for p in procs if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        ranks = [
            torch.load(Path(tmp) / f"rank{r}.pt") if (Path(tmp) / f"rank{r}.pt").exists() else {} for r in range(world)
        ]
    out: dict[str, Any] = {
        "world_size": world,
        "backend": backend,
        "hung": hung,
        "exitcodes": [p.exitcode for p in procs],
    }
    out["ranks"] = [{k: v for k, v in r.items() if k != "qkv"} for r in ranks]
    if any("error" in r or "qkv" not in r for r in ranks) or hung:
        out["ok"] = False
        return out
    # Expected: every rank clips by the global (MAX over ranks) maxima; checked against one process.
    device = ranks[0]["qkv"].device
    global_max = torch.tensor([r["local_maxima"] for r in ranks]).amax(dim=0)
    _, _, H, D = DIST_SHAPE
    ref = attention_module(H, D, device)
    ref.reset_qk_max_logits()
    ref._remember(global_max.to(device))
    clipped, _ = optim.qk_clip([ref], DIST_TAU)
    want = ref.qkv.weight.detach().cpu()
    out["global_maxima"] = global_max.tolist()
    out["heads_clipped_expected"] = int(clipped)
    out["ranks_equal_each_other"] = all(torch.equal(r["qkv"], ranks[0]["qkv"]) for r in ranks)
    out["ranks_equal_global_clip"] = all(torch.equal(r["qkv"], want) for r in ranks)
    out["max_abs_diff_vs_global_clip"] = max(float((r["qkv"] - want).abs().max()) for r in ranks)
    out["ok"] = out["ranks_equal_each_other"] and out["ranks_equal_global_clip"]
    return out


def dist_section(backend: str = "nccl") -> list[dict]:
    """World sizes 1 and 2; nccl runs one rank per GPU (it refuses two ranks on one device), so
    where world 2 cannot run on nccl it runs on gloo instead (the same check, CPU tensors)."""
    gpus = torch.cuda.device_count()
    out = []
    for world in (1, 2):
        if backend != "nccl" or world <= gpus:
            out.append(dist_run(world, backend))
            continue
        out.append(
            {"world_size": world, "backend": backend, "skipped": f"nccl needs {world} GPUs, this machine has {gpus}"}
        )
        out.append(dist_run(world, "gloo"))
    return out


# ---- group ---------------------------------------------------------------------------------------


def rank_pids() -> list[int]:
    """The pids of the engine's rank processes running here (torchrun's own command line names the
    module too; it is left out)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            args = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"worker.engine.rank" in args and b"torch.distributed.run" not in args:
            pids.append(int(proc.name))
    return pids


class GroupSink:
    """Rank 0's telemetry as the launcher hands it over; kills a rank (SIGKILL) at ``kill_at``."""

    def __init__(self, kill_at: int | None = None) -> None:
        self.steps: list[int] = []
        self.checkpoints: list[int] = []
        self.kill_at, self.killed = kill_at, []

    def metrics(self, report) -> None:
        if "loss" in report.values:
            self.steps.append(report.step)
        if self.kill_at is not None and report.step >= self.kill_at and not self.killed:
            self.killed = rank_pids()
            for pid in self.killed:
                os.kill(pid, 9)

    def checkpoint(self, step: int, path: Path, nbytes: int, metrics: dict) -> None:
        self.checkpoints.append(step)

    def log(self, level: str, message: str) -> None:
        pass

    def sample(self, step: int, prompt: str, text: str) -> None:
        pass


def group_run(spec: dict, out: Path, group: bool, sink: GroupSink | None = None, resume: bool = True) -> dict:
    """One run of ``spec``: as a torch.distributed group (``group``) or in this process."""
    from worker.engine.launch import RankFailed, run_group
    from worker.engine.run import run_process

    t0 = time.perf_counter()
    try:
        run = run_group if group else run_process
        result = run(spec, out, sink=sink, resume=resume)
    except RankFailed as exc:
        return {"raised": f"RankFailed: {str(exc).splitlines()[0]}", "wall_s": time.perf_counter() - t0}
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [line for line in lines if "loss" in line["metrics"]]
    step_ms = sorted(line["metrics"]["step_time_ms"] for line in train)
    tokens_per_step = ENGINE_TRAIN["batch_size"] * ENGINE_MODEL["seq_len"]
    return {
        "status": result.status,
        "steps": result.steps,
        "wall_s": time.perf_counter() - t0,
        "tokens_per_s": result.tokens_per_s,
        "median_step_ms": med(step_ms),
        "median_tokens_per_s": tokens_per_step / med(step_ms) * 1e3,
        "final_loss": result.loss,
        "final_val_loss": result.val_loss,
        "losses": {line["step"]: line["metrics"]["loss"] for line in train},
        "metric_lines": len(train),
    }


def group_section(device: torch.device, steps: int) -> dict:
    """The same job in this process and as a group of one rank under torchrun (nccl, DDP); then a
    group whose rank is killed mid-run, resumed from its checkpoint."""
    spec = engine_spec(device.type, "auto", steps, None)
    spec["train"]["checkpoint_every"] = max(1, steps // 4)
    spec["resources"] = {"nproc": 1, "nnodes": 1}
    out: dict[str, Any] = {"model": ENGINE_MODEL, "train": {**ENGINE_TRAIN, "steps": steps}}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        out["process"] = group_run(spec, root / "process", group=False)
        sink = GroupSink()
        out["group"] = group_run(spec, root / "group", True, sink)
        out["group"].update(
            telemetry_steps=len(sink.steps),
            telemetry_steps_unique=len(set(sink.steps)),
            checkpoints_reported=sink.checkpoints,
            ranks_log_tail=(root / "group" / "ranks.log").read_text()[-1500:],
        )
        killer = GroupSink(kill_at=steps // 2)
        out["killed"] = group_run(spec, root / "killed", True, killer)
        out["killed"].update(
            pids_killed=killer.killed,
            last_step_reported=max(killer.steps, default=None),
            checkpoints_reported=killer.checkpoints,
        )
        resumed = GroupSink()
        out["resumed"] = group_run(spec, root / "killed", True, resumed, resume=True)
        out["resumed"]["first_step_reported"] = min(resumed.steps, default=None)
    p, g, r = out["process"], out["group"], out["resumed"]
    for run in (g, r):
        if "losses" in run and "losses" in p:
            common = [s for s in run["losses"] if s in p["losses"]]
            run["max_abs_loss_diff_vs_process"] = max(abs(run["losses"][s] - p["losses"][s]) for s in common)
    if "median_step_ms" in g and "median_step_ms" in p:
        out["group_step_time_vs_process"] = g["median_step_ms"] / p["median_step_ms"]
    for run in (p, g, r):
        run.pop("losses", None)
    return out


# ---- host ----------------------------------------------------------------------------------------

HOST_MODEL = {"arch": "gpt", "n_layer": 4, "n_head": 4, "d_model": 256, "seq_len": 64}
HOST_OPTIMIZERS = {
    "adamw": {"name": "adamw", "lr": 1e-3},
    "muon": {"name": "muon", "lr": 0.01, "adamw_lr": 1e-3},
    "muonclip": {"name": "muonclip", "lr": 0.01, "adamw_lr": 1e-3},
}


def cuda_kernels(fn: Callable[[], object], repeats: int) -> float:
    """CUDA kernels launched per call of ``fn`` (profiled over ``repeats`` calls)."""
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA) / repeats


def host_section(device: torch.device, steps: int) -> dict:
    from worker.engine.config import job_config
    from worker.engine.data import synthetic_task
    from worker.engine.trainer import Trainer

    out: dict[str, Any] = {"model": HOST_MODEL, "batch_size": 32, "steps_timed": steps}
    data = synthetic_task(0, tokens=1 << 16)
    for name, optimizer in HOST_OPTIMIZERS.items():
        spec = {
            "name": f"bench-host-{name}",
            "model": HOST_MODEL,
            "data": {"builtin": "synthetic"},
            "optimizer": optimizer,
            "train": {
                "steps": 10**6,
                "batch_size": 32,
                "eval_every": 10**6,
                "checkpoint_every": 10**6,
                "device": device.type,
                "precision": "auto",
            },
            "telemetry": {"every": 10**6, "sample_tokens": 0},
        }
        out[name] = host_row(Trainer(job_config(spec), data, None, None), steps)
    out["muon_train_step_vs_adamw"] = out["muon"]["train_step_ms"] / out["adamw"]["train_step_ms"]
    return out


def host_row(trainer, steps: int) -> dict:
    """One optimizer's figures: the training step, its optimizer step (synchronised, and the time
    to issue it), and CUDA kernels per training step and per optimizer step."""
    opt, synced, issued = trainer.optimizer, [], []
    step = opt.step

    def train_step() -> None:
        trainer.train_step(False)
        trainer.step += 1

    def timed(*args, **kwargs):
        torch.cuda.synchronize()
        t = time.perf_counter()
        result = step(*args, **kwargs)
        issued.append((time.perf_counter() - t) * 1e3)
        torch.cuda.synchronize()
        synced.append((time.perf_counter() - t) * 1e3)
        return result

    for _ in range(20):
        train_step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        train_step()
    torch.cuda.synchronize()
    row = {"train_step_ms": (time.perf_counter() - t0) / steps * 1e3}
    opt.step = timed
    for _ in range(steps):
        train_step()
    del opt.step  # the class's step again
    row.update(optimizer_step_ms=med(synced), optimizer_step_host_ms=med(issued))
    row["kernels_per_train_step"] = cuda_kernels(train_step, 5)
    for p in trainer.model.parameters():  # the optimizer's step alone, on gradients that stay
        p.grad = torch.randn_like(p) * 1e-3
    row["kernels_per_optimizer_step"] = cuda_kernels(opt.step, 5)
    return row


# ---- report --------------------------------------------------------------------------------------


def num(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def report(results: dict) -> None:
    """Print the figures; a formatting failure is printed, never lost (the JSON holds them all)."""
    try:
        print_report(results)
    except Exception:
        print(f"\nreport could not be printed in full:\n{traceback.format_exc()}")


def print_report(results: dict) -> None:
    f = results["machine"]
    print(
        f"torch {f['torch']} (CUDA {f['cuda']}), {f.get('name', f['device'])}, "
        f"{f.get('sm_count', '?')} SMs, float32 matmul precision '{f['float32_matmul_precision']}', "
        f"Python {f.get('python')}"
    )
    if "nvidia_smi" in f:
        print(f"  nvidia-smi: {f['nvidia_smi']}")
    print("  " + ", ".join(f"{k} {v:.1f}" for k, v in f.items() if k.startswith("gemm_")))
    if "ns" in results:
        print("\nNewton–Schulz: singular values (float64 svdvals) and median ms per call")
        print(
            f"{'shape':<10}{'dtype':<6}{'coeffs':<15}{'form':<9}{'sv min':>8}{'sv max':>8}"
            f"  {'scalar-map band':<18}{'spec':>5}{'ms':>9}"
        )
        for r in results["ns"]["shapes"]:
            lo, hi = r["band"]
            form = r["method"] + ("*" if r["method"] == r["auto"] else "")
            print(
                f"{r['shape']:<10}{r['dtype']:<6}{r['coefficients']:<15}{form:<9}{r['sv_min']:>8.4f}"
                f"{r['sv_max']:>8.4f}  [{lo:.4f}, {hi:.4f}]  {'in' if r['in_spec_band'] else 'OUT':>5}"
                f"{r['median_ms']:>9.3f}"
            )
        print("  (* = the form 'auto' picks)\nGPT-shaped set, one [4, m, n] stack per shape, median ms:")
        for r in results["ns"]["gpt_set"]:
            print(f"  {r['dtype']:<6}{r['coefficients']:<15}{r['method']:<9}{r['median_ms']:>9.3f}")
    for name, s in results.get("step", {}).items():
        print(f"\nOptimizer step, {name} ({s['params']:,} params, fp32), {s['rounds']} interleaved rounds")
        print(f"{'contender':<20}{'median ms':>10}{'min ms':>9}{'peak +MiB':>11}{'state MiB':>11}{'vs fp64':>10}")
        for k, v in s["step"].items():
            m = s["memory"][k]
            parity = f"{s['parity'][k]:.2e}" if k in s["parity"] else "-"
            print(
                f"{k:<20}{v['median_ms']:>10.3f}{v['min_ms']:>9.3f}{m.get('peak_growth_mib', float('nan')):>11.1f}"
                f"{m['state_mib']:>11.1f}{parity:>10}"
            )
        for k, v in s["ratios"].items():
            print(f"  {k:<32}{v:>7.3f}")
    if "batch" in results:
        b = results["batch"]
        print(
            f"\nMuon's CUDA batch cap (default {b['default_mib']} MiB): median step ms, / torch.optim.Muon, peak +MiB"
        )
        for name, rows in b.items():
            if name == "default_mib":
                continue
            for k, v in rows.items():
                peak = num(v.get("peak_growth_mib"), ".1f")
                print(f"  {name:<12}{k:<18}{v['median_ms']:>9.3f}{v['vs_torch']:>8.3f}{peak:>9}")
    if "attention" in results:
        print("\nAttention: recorded per-head max logits against the explicit ones; outputs; cost of the recompute")
        for r in results["attention"]:
            print(
                f"{r['shape']} {r['precision']} (q,k {r['qk_dtype']}), max logit {r['max_logit']:.3f}: "
                f"|rec - fp64| {r['recorded_vs_fp64']:.2e}, |rec - fp32| {r['recorded_vs_fp32']:.2e}, "
                f"product in {r['qk_dtype']}: {r['product_in_qk_dtype_vs_fp64']:.2e}; "
                f"output |diff| {r['output_max_abs_diff']:.2e} (of {r['output_max_abs']:.2e})"
            )
            print(
                f"    recompute {r['recompute_ms']:.3f} ms (earlier upcast: {r['recompute_fp32_upcast_ms']:.3f}, "
                f"|upcast - fp64| {r['fp32_upcast_vs_fp64']:.2e}; {r['qk_dtype']} product: "
                f"{r['recompute_product_in_qk_dtype_ms']:.3f}); forward off/on {r['forward_ms_off']:.3f}/"
                f"{r['forward_ms_on']:.3f} ms (+{100 * r['recompute_forward_overhead']:.0f}%); fwd+bwd off/on "
                f"{r['forward_backward_ms_off']:.3f}/{r['forward_backward_ms_on']:.3f} ms "
                f"(+{100 * r['recompute_step_overhead']:.0f}%); peak +MiB off/on "
                f"{r.get('forward_peak_growth_mib_off', float('nan')):.0f}/"
                f"{r.get('forward_peak_growth_mib_on', float('nan')):.0f}"
            )
    if "engine" in results:
        e = results["engine"]
        print(f"\nEngine runs: {e['model']}, batch {e['train']['batch_size']}, synthetic task")
        for r in e["runs"]:
            print(
                f"  precision {r['precision']} (autocast {r['autocast']}), tau {r['tau']}: {r['status']} "
                f"{r['steps']} steps in {r['wall_s']:.1f} s, {num(r['tokens_per_s'], ',.0f')} tokens/s "
                f"(median step {r['median_step_ms']:.2f} ms = {r['median_tokens_per_s']:,.0f} tokens/s); loss "
                f"{num(r['final_loss'], '.4f')}, val {num(r['final_val_loss'], '.4f')}, floor "
                f"{num(r['entropy_floor'], '.4f')}; attn_max_logit last {num(r['attn_max_logit_last'], '.2f')}, "
                f"max {num(r['attn_max_logit_max'], '.2f')}, max of last 50 "
                f"{num(r['max_logit_last_50_max'], '.2f')}, steps above tau {r['steps_above_tau']} "
                f"(first {r['first_step_above_tau']}), steps with a clip {r['steps_with_clip']}"
            )
    if "host" in results:
        h = results["host"]
        print(f"\nWhere a training step's time goes ({h['model']}, batch {h['batch_size']}), medians:")
        for name in HOST_OPTIMIZERS:
            r = h[name]
            print(
                f"  {name:<9} step {r['train_step_ms']:.2f} ms; optimizer step {r['optimizer_step_ms']:.2f} ms, "
                f"of which issuing it {r['optimizer_step_host_ms']:.2f} ms; kernels per step "
                f"{r['kernels_per_train_step']:.0f}, per optimizer step "
                f"{r['kernels_per_optimizer_step']:.0f}"
            )
        print(f"  Muon's training step / AdamW's: {h['muon_train_step_vs_adamw']:.2f}")
    if "group" in results:
        print("\nA job as a torch.distributed group of one rank (torchrun, nccl, DDP) against in-process:")
        for name, run in results["group"].items():
            if isinstance(run, dict) and name not in ("model", "train"):
                print(f"  {name}: " + ", ".join(f"{k} {v}" for k, v in run.items() if k != "ranks_log_tail"))
            elif name not in ("model", "train"):
                print(f"  {name}: {run}")
    for r in results.get("dist", []):
        if "skipped" in r:
            print(f"\ndist {r['backend']} world {r['world_size']}: skipped: {r['skipped']}")
            continue
        print(f"\ndist {r['backend']} world {r['world_size']}: ok={r['ok']} hung={r['hung']} exit={r['exitcodes']}")
        for k in (
            "global_maxima",
            "heads_clipped_expected",
            "ranks_equal_each_other",
            "ranks_equal_global_clip",
            "max_abs_diff_vs_global_clip",
        ):
            if k in r:
                print(f"  {k}: {r[k]}")
        for rank in r["ranks"]:
            print(f"  rank {rank.get('rank')}: {rank}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}, or profile")
    parser.add_argument("--quick", action="store_true", help="few iterations and steps: a smoke run")
    parser.add_argument("--json", metavar="PATH", help="also write every figure as JSON to PATH")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/gpu.py measures CUDA code paths and needs a CUDA device; torch.cuda.is_available() is False")
    only = [s for s in args.only.split(",") if s]
    if unknown := set(only) - {*SECTIONS, "profile"}:
        sys.exit(f"unknown sections {sorted(unknown)}; choose from {SECTIONS} or profile")
    device = torch.device("cuda", 0)
    iters, rounds, steps = (5, 3, 30) if args.quick else (50, 20, 300)
    results: dict[str, Any] = {"machine": machine_facts(device), "quick": args.quick}
    sections = {
        "ns": lambda: ns_section(device, iters),
        "step": lambda: step_section(device, rounds),
        "batch": lambda: batch_section(device, rounds),
        "attention": lambda: attention_section(device, max(5, iters // 2)),
        "engine": lambda: engine_section(device, steps),
        "dist": dist_section,
        "group": lambda: group_section(device, steps),
        "host": lambda: host_section(device, max(20, steps // 3)),
        "profile": lambda: profile_section(device, trace_dir=Path(args.json).parent if args.json else None),
    }
    for name in only:
        t0 = time.perf_counter()
        try:
            results[name] = sections[name]()
        except Exception:
            results[f"{name}_error"] = traceback.format_exc()
            print(f"section {name} failed:\n{results[f'{name}_error']}", flush=True)
        print(f"[{name}: {time.perf_counter() - t0:.1f} s]", flush=True)
        if args.json:  # written after every section: a later failure keeps the earlier figures
            Path(args.json).write_text(json.dumps(results, indent=2, default=str))
    report(results)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
