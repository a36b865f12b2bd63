"""Convergence on the builtin pysource text (char level; any corpus with --data FILE): Muon
against tuned AdamW, and MuonClip's QK-Clip holding attention logits that plain Muon lets grow.

Part 1 (convergence): a 2-layer GPT (d_model 128, 4 heads, seq_len 64, batch 32) trained with
AdamW at lr 1e-3, 3e-3 and 1e-2, Muon (Keller coefficients), Muon with Polar Express
coefficients and MuonClip (tau 100), the same steps and seeds for every contender. The tuned
AdamW is the lr with the lowest final validation loss averaged over the seeds. Per seed, the
steps ratio is the (linearly interpolated) first step at which a Muon variant's validation loss
is at or below tuned AdamW's final one, divided by the run's steps (target: <= 0.7).

Part 2 (logit growth): a fixed configuration in which plain Muon's max attention logit
(``attn_max_logit``, measured in each training forward before that step's QK-Clip) climbs past
3 x tau while MuonClip holds it near tau (target: <= 1.05 x tau at every step after its first
clip, with a final validation loss within 1% of plain Muon's or better).

Part 2 uses the same model and data with Muon lr 0.05 and tau 30 for 400 steps. It also
re-measures the final weights' per-head max logits on unseen batches, at the training batch
and at a 32x larger one, and replays a perfect clip on them: the batch-to-batch spread that a
clip on one batch cannot remove from the next one's measurement.

    .venv/bin/python bench/convergence.py [--seeds 0 1 2] [--steps 400] [--threads N] [--quick] [--json PATH]
    .venv/bin/python bench/convergence.py --part convergence --only-adamw --adamw-lrs 0.002   # a grid side check
    .venv/bin/python bench/convergence.py --replot PATH    # redraw the plots from a --json output
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from app.schemas import JobSpec
from worker.engine.config import job_config_from_dict
from worker.engine.data import TokenData, load_data
from worker.engine.telemetry import Report
from worker.engine.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
DATA: dict[str, Any] = {"builtin": "pysource", "tokenizer": "char"}  # --data FILE: {"path": FILE, ...}
IMG_DIR = REPO / "docs" / "img"

# -- part 1: convergence -------------------------------------------------------------------------
MODEL = {"arch": "gpt", "n_layer": 2, "n_head": 4, "d_model": 128, "seq_len": 64}
BATCH_SIZE = 32
STEPS = 400
EVAL_EVERY = 25
EVAL_BATCHES = 16  # 16 x 32 x 64 = 32,768 validation tokens per evaluation (engine default: 8)
SEEDS = (0, 1, 2)
ADAMW_LRS = (1e-3, 3e-3, 1e-2)
MUON_LR, MUON_ADAMW_LR = 0.02, 3e-3  # the engine's defaults
CONVERGENCE_TAU = 100.0  # Kimi K2's tau
TARGET_RATIO = 0.7
PRIMARY = "muon"  # the contender the steps-ratio target is about

# -- part 2: logit growth ------------------------------------------------------------------------
LOGIT_MODEL = {"arch": "gpt", "n_layer": 2, "n_head": 4, "d_model": 128, "seq_len": 64}
LOGIT_STEPS = 400
LOGIT_MUON_LR = 0.05
LOGIT_TAU = 30.0
SPREAD_BATCHES = 16  # fresh training batches on which the final weights' max logit is re-measured
SPREAD_OFFSET = 1_000_000  # batch indices far beyond any run's steps
SPREAD_LARGE_BATCH = 1024  # 32x the training batch: 65,536 tokens
GROWTH_FACTOR = 3.0  # plain Muon's max logit must pass GROWTH_FACTOR x tau
OVERSHOOT = 1.05  # MuonClip's max logit after its first clip must stay <= OVERSHOOT x tau
LOSS_TOLERANCE = 0.01  # MuonClip's final val loss within 1% of plain Muon's (or better)

QUICK = {"steps": 60, "eval_every": 20, "seeds": (0,), "eval_batches": 4}


def adamw_name(lr: float) -> str:
    """Contender name of AdamW at ``lr``."""
    return f"adamw lr={lr:g}"


def convergence_contenders(
    muon_lr: float, adamw_lr: float, adamw_lrs: list[float], only_adamw: bool = False
) -> dict[str, dict[str, Any]]:
    """Contender name -> the JobSpec ``optimizer`` section of part 1."""
    muon = {"name": "muon", "lr": muon_lr, "adamw_lr": adamw_lr}
    contenders = {adamw_name(lr): {"name": "adamw", "lr": lr} for lr in adamw_lrs}
    if only_adamw:
        return contenders
    contenders["muon"] = muon
    contenders["muon polar_express"] = {**muon, "ns_coefficients": "polar_express"}
    contenders[f"muonclip tau={CONVERGENCE_TAU:g}"] = {**muon, "name": "muonclip", "qk_clip_tau": CONVERGENCE_TAU}
    return contenders


def logit_contenders() -> dict[str, dict[str, Any]]:
    """Contender name -> the JobSpec ``optimizer`` section of part 2 (same lr, with and without QK-Clip)."""
    muon = {"name": "muon", "lr": LOGIT_MUON_LR, "adamw_lr": MUON_ADAMW_LR}
    return {"muon": muon, "muonclip": {**muon, "name": "muonclip", "qk_clip_tau": LOGIT_TAU}}


class RecordingSink:
    """A telemetry sink that keeps every reported value as a (step, value) series per name."""

    def __init__(self) -> None:
        self.series: dict[str, list[tuple[int, float]]] = defaultdict(list)

    def metrics(self, report: Report) -> None:
        for name, value in report.values.items():
            self.series[name].append((report.step, value))

    def checkpoint(self, step: int, path: Path, nbytes: int, metrics: dict[str, float]) -> None:
        pass

    def log(self, level: str, message: str) -> None:
        pass

    def sample(self, step: int, prompt: str, text: str) -> None:
        pass


@dataclass
class RunRecord:
    """What one training run reports: validation curve, max-logit curve, clip counts, timing."""

    contender: str
    seed: int
    optimizer: dict[str, Any]
    val_loss: list[tuple[int, float]]
    attn_max_logit: list[tuple[int, float]]
    heads_clipped: list[tuple[int, float]] = field(default_factory=list)
    tokens_per_s: float | None = None
    wall_s: float = 0.0
    spread: dict[str, Any] | None = None

    @property
    def final_val(self) -> float:
        return self.val_loss[-1][1]

    @property
    def peak_logit(self) -> float:
        return max(v for _, v in self.attn_max_logit)


def make_spec(model: dict, optimizer: dict, steps: int, seed: int, eval_every: int) -> dict[str, Any]:
    """A validated JobSpec dict: char-level DATA, CPU, telemetry every step, no checkpoints."""
    return JobSpec.model_validate({
        "name": f"bench-convergence-{optimizer['name']}",
        "model": model,
        "data": DATA,
        "optimizer": optimizer,
        "train": {"steps": steps, "batch_size": BATCH_SIZE, "eval_every": eval_every,
                  "checkpoint_every": steps + 1, "seed": seed, "device": "cpu"},
        "telemetry": {"every": 1, "sample_tokens": 0},  # samples would cost time the comparison does not want
    }).model_dump()  # fmt: skip


def train(
    contender: str, spec: dict[str, Any], data: TokenData, eval_batches: int, spread_tau: float | None = None
) -> RunRecord:
    """Train one spec through the engine's Trainer and collect its telemetry (and, given
    ``spread_tau``, the batch-to-batch spread of the final weights' max logits).

    ``eval_batches`` is an engine-side setting (TrainConfig.eval_batches) the JobSpec does not
    expose, so it is set on the built config."""
    job = job_config_from_dict(spec)
    job = replace(job, train=replace(job.train, eval_batches=eval_batches))
    sink, seq_len = RecordingSink(), job.model.seq_len
    trainer = Trainer(job, data, None, sink)
    result = trainer.run(resume=False)
    if result.status != "succeeded":
        raise RuntimeError(f"{contender} seed {job.train.seed}: run ended {result.status}")
    return RunRecord(
        contender=contender,
        seed=job.train.seed,
        optimizer=spec["optimizer"],
        val_loss=sink.series["val_loss"],
        attn_max_logit=sink.series["attn_max_logit"],
        heads_clipped=sink.series.get("qk_clip/heads_clipped", []),
        tokens_per_s=result.tokens_per_s,
        wall_s=result.wall_s,
        spread=None if spread_tau is None else batch_spread(trainer.model, data, job.train.seed, seq_len, spread_tau),
    )


@torch.no_grad()
def batch_spread(model: torch.nn.Module, data: TokenData, seed: int, seq_len: int, tau: float) -> dict[str, Any]:
    """Per-head max attention logits of fixed weights on SPREAD_BATCHES training batches the run
    never saw, at the benchmark's batch size and at SPREAD_LARGE_BATCH: how much the
    ``attn_max_logit`` of one step varies with the batch alone.

    ``ideal_clip`` replays a perfect QK-Clip on these fixed weights: after batch i every head
    above tau is scaled to exactly tau *on batch i*, with no update in between; the figure is
    what batch i + 1 then reads (max over heads, / tau). It is the overshoot that no clip based
    on the batch just seen can prevent."""
    out = {}
    for label, batch_size in (("train_batch", BATCH_SIZE), ("large_batch", SPREAD_LARGE_BATCH)):
        per_head = [head_maxima(model, data.batch("train", SPREAD_OFFSET + i, batch_size, seq_len, seed)[0])
                    for i in range(SPREAD_BATCHES)]  # fmt: skip
        maxima = [max(h) for h in per_head]
        median = statistics.median(maxima)
        ideal = [
            max(min(1.0, tau / s_prev) * s_next for s_prev, s_next in zip(prev, nxt)) / tau
            for prev, nxt in itertools.pairwise(per_head)
        ]
        out[label] = {
            "batch_size": batch_size,
            "per_head_maxima": per_head,
            "maxima": maxima,
            "rel_std": statistics.pstdev(maxima) / statistics.fmean(maxima),
            "max_over_median": max(maxima) / median,
            "ideal_clip": ideal,
            "ideal_clip_max": max(ideal),
            "ideal_clip_over_overshoot": sum(v > OVERSHOOT for v in ideal) / len(ideal),
        }
    return out


def head_maxima(model: torch.nn.Module, x: torch.Tensor) -> list[float]:
    """Max q.k / sqrt(d) of every head (layer-major) in one training-mode forward on ``x``."""
    layers = model.attention_layers()
    for layer in layers:
        layer.reset_qk_max_logits()
        layer.record_max_logits = True
    model(x)
    maxima = torch.cat([layer.qk_max_logits() for layer in layers]).tolist()
    for layer in layers:
        layer.reset_qk_max_logits()
    return maxima


def steps_to_reach(curve: list[tuple[int, float]], target: float) -> float | None:
    """First step at which ``curve`` (eval points, ascending steps) is <= ``target``, linearly
    interpolated between the eval point before and the first one at or below; None if never."""
    for i, (step, value) in enumerate(curve):
        if value <= target:
            if i == 0:
                return float(step)
            prev_step, prev_value = curve[i - 1]
            return prev_step + (prev_value - target) / (prev_value - value) * (step - prev_step)
    return None


def run_all(
    contenders: dict[str, dict], model: dict, steps: int, seeds: list[int], eval_every: int,
    eval_batches: int, data: TokenData, label: str, spread_tau: float | None = None,
) -> dict[str, list[RunRecord]]:  # fmt: skip
    """Every contender on every seed (seed-major, so a seed's runs are close in time); prints progress."""
    runs: dict[str, list[RunRecord]] = {name: [] for name in contenders}
    for seed in seeds:
        for name, optimizer in contenders.items():
            spec = make_spec(model, optimizer, steps, seed, eval_every)
            record = train(name, spec, data, eval_batches, spread_tau)
            runs[name].append(record)
            print(f"  [{label}] seed {seed} {name:<22} final val {record.final_val:.4f}  "
                  f"peak logit {record.peak_logit:7.2f}  {record.wall_s:5.1f} s", flush=True)  # fmt: skip
    return runs


def mean_curve(records: list[RunRecord], key: str = "val_loss") -> list[tuple[int, float]]:
    """Point-wise mean over seeds of a series (every seed reports the same steps)."""
    curves = [getattr(r, key) for r in records]
    return [(pts[0][0], statistics.fmean(v for _, v in pts)) for pts in zip(*curves)]


def analyse_convergence(runs: dict[str, list[RunRecord]], steps: int) -> dict[str, Any]:
    """Tuned AdamW (lowest mean final val loss over seeds) and each Muon variant's steps ratio per seed."""
    seeds = [r.seed for r in next(iter(runs.values()))]
    final = {name: [r.final_val for r in recs] for name, recs in runs.items()}
    adamw = [name for name, recs in runs.items() if recs[0].optimizer["name"] == "adamw"]
    best = min(adamw, key=lambda name: statistics.fmean(final[name]))
    per_seed_best = [min(adamw, key=lambda name, i=i: final[name][i]) for i in range(len(seeds))]
    ratios: dict[str, dict[str, Any]] = {}
    for name, recs in runs.items():
        if name in adamw:
            continue
        for basis, targets in (
            ("tuned", [final[best][i] for i in range(len(seeds))]),
            ("per_seed_best", [final[per_seed_best[i]][i] for i in range(len(seeds))]),
        ):
            reach = [steps_to_reach(r.val_loss, t) for r, t in zip(recs, targets)]
            per_seed = [None if s is None else s / steps for s in reach]
            ratios.setdefault(name, {})[basis] = {
                "target_val_loss": targets,
                "steps_to_reach": reach,
                "ratio": per_seed,
                "mean_ratio": None if None in per_seed else statistics.fmean(per_seed),
            }
    return {
        "seeds": seeds,
        "final_val_loss": final,
        "final_val_loss_mean": {n: statistics.fmean(v) for n, v in final.items()},
        "final_val_loss_std": {n: statistics.pstdev(v) for n, v in final.items()},
        "peak_attn_max_logit": {n: [r.peak_logit for r in recs] for n, recs in runs.items()},
        "heads_clipped_total": {n: [sum(v for _, v in r.heads_clipped) for r in recs] for n, recs in runs.items()},
        "adamw_best": best,
        "adamw_best_per_seed": per_seed_best,
        "ratios": ratios,
        "wall_s": {n: [r.wall_s for r in recs] for n, recs in runs.items()},
        "tokens_per_s": {n: [r.tokens_per_s for r in recs] for n, recs in runs.items()},
    }


def first_clip_step(record: RunRecord, tau: float) -> int | None:
    """The step whose forward triggered MuonClip's first clip (a head's max logit above tau)."""
    for step, n in record.heads_clipped:
        if n > 0:
            return step
    return next((step for step, v in record.attn_max_logit if v > tau), None)


def analyse_logits(runs: dict[str, list[RunRecord]], tau: float) -> dict[str, Any]:
    """Per seed: plain Muon's peak max logit, MuonClip's peak after its first clip, final val losses."""
    rows = []
    for muon, clip in zip(runs["muon"], runs["muonclip"]):
        first = first_clip_step(clip, tau)
        after = [v for s, v in clip.attn_max_logit if first is not None and s > first]
        peak_after = max(after) if after else None
        ratios = sorted(v / tau for v in after)
        rel = (clip.final_val - muon.final_val) / muon.final_val
        rows.append({
            "seed": muon.seed,
            "muon_peak_logit": muon.peak_logit,
            "muon_peak_over_tau": muon.peak_logit / tau,
            "muon_steps_over_3tau": sum(v > GROWTH_FACTOR * tau for _, v in muon.attn_max_logit),
            "muonclip_first_clip_step": first,
            "muonclip_peak_after_first_clip": peak_after,
            "muonclip_peak_over_tau": None if peak_after is None else peak_after / tau,
            "muonclip_steps_after_first_clip": len(after),
            "muonclip_steps_over_overshoot": sum(v > OVERSHOOT * tau for v in after),
            "muonclip_median_over_tau": statistics.median(ratios) if ratios else None,
            "muonclip_p95_over_tau": ratios[min(len(ratios) - 1, int(0.95 * len(ratios)))] if ratios else None,
            "muonclip_spread": clip.spread,
            "muon_spread": muon.spread,
            "muonclip_heads_clipped_total": sum(v for _, v in clip.heads_clipped),
            "muon_final_val": muon.final_val,
            "muonclip_final_val": clip.final_val,
            "val_rel_diff": rel,
            "growth_ok": muon.peak_logit > GROWTH_FACTOR * tau,
            "hold_ok": peak_after is not None and peak_after <= OVERSHOOT * tau,
            "loss_ok": rel <= LOSS_TOLERANCE,
        })  # fmt: skip
    return {"tau": tau, "per_seed": rows, "all_ok": all(r["growth_ok"] and r["hold_ok"] and r["loss_ok"] for r in rows)}


def plot_convergence(runs: dict[str, list[RunRecord]], analysis: dict[str, Any], path: Path) -> None:
    """Mean validation-loss curves over seeds, every contender, with tuned AdamW's final loss marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, recs in runs.items():
        steps, values = zip(*mean_curve(recs))
        style = "--" if name.startswith("adamw") else ":" if name.startswith("muonclip") else "-"
        width = 2.2 if name in (PRIMARY, analysis["adamw_best"]) else 1.5
        ax.plot(steps, values, style, lw=width, marker="." if name.startswith("muonclip") else None, label=name)
    target = analysis["final_val_loss_mean"][analysis["adamw_best"]]
    ax.axhline(target, color="grey", lw=0.8, ls=":", label=f"tuned AdamW final ({target:.3f})")
    mean_ratio = analysis["ratios"].get(PRIMARY, {}).get("tuned", {}).get("mean_ratio")
    title = f"{len(analysis['seeds'])} seeds (mean); muon steps ratio " + (
        f"{mean_ratio:.2f}" if mean_ratio is not None else "n/a (not reached)"
    )
    ax.set(xlabel="step", ylabel="validation loss (nats/char)", title=f"char GPT: {title}")
    lo = min(min(v for _, v in mean_curve(recs)) for recs in runs.values())
    ax.set_ylim(lo - 0.05, min(3.2, max(v for recs in runs.values() for _, v in mean_curve(recs))))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_logits(runs: dict[str, list[RunRecord]], tau: float, path: Path) -> None:
    """Left: attn_max_logit per step of plain Muon and MuonClip, every seed (log scale), with tau
    and 3 x tau. Right: MuonClip's attn_max_logit / tau, with 1 and the 1.05 target line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, zoom) = plt.subplots(1, 2, figsize=(12, 4.8))
    styles = ["-", "--", ":", "-."]
    for color, name in (("tab:red", "muon"), ("tab:blue", "muonclip")):
        for i, rec in enumerate(runs[name]):
            steps, values = zip(*rec.attn_max_logit)
            style = styles[i % len(styles)]
            ax.plot(steps, values, style, color=color, lw=1.2, label=f"{name} seed {rec.seed}")
            if name == "muonclip":
                zoom.plot(steps, [v / tau for v in values], style, lw=1.0, label=f"seed {rec.seed}")
    ax.axhline(tau, color="black", lw=0.8, label=f"tau = {tau:g}")
    ax.axhline(GROWTH_FACTOR * tau, color="grey", lw=0.8, ls="--", label=f"{GROWTH_FACTOR:g} x tau")
    ax.set_yscale("log")
    ax.set(xlabel="step", ylabel="attn_max_logit (before the step's clip)",
           title=f"Muon lr {LOGIT_MUON_LR:g}: plain vs MuonClip tau {tau:g}")  # fmt: skip
    zoom.axhline(1.0, color="black", lw=0.8, label="tau")
    zoom.axhline(OVERSHOOT, color="black", lw=0.8, ls=":", label=f"{OVERSHOOT:g} x tau (target)")
    zoom.set_ylim(0.7, 1.4)
    zoom.set(xlabel="step", ylabel="MuonClip attn_max_logit / tau", title="MuonClip, every seed")
    for a in (ax, zoom):
        a.grid(alpha=0.3)
        a.legend(fontsize=8, ncol=2 if a is ax else 1)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def fmt(x: float | None, spec: str = ".3f") -> str:
    """A number, or "-" for None."""
    return "-" if x is None else format(x, spec)


def report_convergence(a: dict[str, Any], steps: int, muon_lr: float, adamw_lr: float) -> None:
    """Print part 1's tables."""
    seeds = a["seeds"]
    print(f"\nConvergence: {steps} steps, seeds {seeds}; muon lr {muon_lr:g}, adamw_lr {adamw_lr:g}")
    head = "".join(f"{'seed ' + str(s):>10}" for s in seeds)
    print(f"{'contender':<24}{head}{'mean':>10}{'std':>8}{'peak logit':>12}{'ms/step':>9}")
    for name, vals in a["final_val_loss"].items():
        ms = statistics.fmean(1e3 * BATCH_SIZE * MODEL["seq_len"] / t for t in a["tokens_per_s"][name])
        mean, std, peak = a["final_val_loss_mean"][name], a["final_val_loss_std"][name], a["peak_attn_max_logit"][name]
        print(f"{name:<24}{''.join(f'{v:>10.4f}' for v in vals)}{mean:>10.4f}{std:>8.4f}{max(peak):>12.2f}{ms:>9.1f}")
    print(f"tuned AdamW (lowest mean final val loss): {a['adamw_best']}; per-seed best: {a['adamw_best_per_seed']}")
    for basis in ("tuned", "per_seed_best"):
        print(f"\nSteps to reach AdamW's final val loss / {steps} ({basis}; target <= {TARGET_RATIO})")
        print(f"{'contender':<24}{head}{'mean':>10}")
        for name, by in a["ratios"].items():
            r = by[basis]
            print(f"{name:<24}{''.join(f'{fmt(x):>10}' for x in r['ratio'])}{fmt(r['mean_ratio']):>10}")


def report_logits(a: dict[str, Any], steps: int) -> None:
    """Print part 2's tables."""
    tau, rows = a["tau"], a["per_seed"]
    print(f"\nLogit growth: {LOGIT_MODEL}, {steps} steps, muon lr {LOGIT_MUON_LR:g}, tau {tau:g}")
    print(f"{'seed':>4}{'muon peak':>11}{'/tau':>7}{'muon val':>10}{'clip val':>10}{'clip-muon':>11}")
    for r in rows:
        print(f"{r['seed']:>4}{r['muon_peak_logit']:>11.2f}{r['muon_peak_over_tau']:>7.2f}{r['muon_final_val']:>10.4f}"
              f"{r['muonclip_final_val']:>10.4f}{100 * r['val_rel_diff']:>+10.2f}%")  # fmt: skip
    print("MuonClip's attn_max_logit / tau after its first clip")
    print(f"{'seed':>4}{'1st clip':>9}{'median':>8}{'p95':>7}{'max':>7}{'>1.05':>9}  growth/hold/loss ok")
    for r in rows:
        ok = "/".join("y" if r[k] else "n" for k in ("growth_ok", "hold_ok", "loss_ok"))
        over = f"{r['muonclip_steps_over_overshoot']}/{r['muonclip_steps_after_first_clip']}"
        print(f"{r['seed']:>4}{fmt(r['muonclip_first_clip_step'], 'd'):>9}{fmt(r['muonclip_median_over_tau']):>8}"
              f"{fmt(r['muonclip_p95_over_tau']):>7}{fmt(r['muonclip_peak_over_tau']):>7}{over:>9}  {ok}")  # fmt: skip
    print(f"MuonClip's final weights on {SPREAD_BATCHES} unseen batches: spread = max / median of the max logit;")
    print("ideal clip = what batch i+1 reads after a perfect clip to tau on batch i (no update): max, share > 1.05")
    print(f"{'seed':>4}{'batch':>7}{'rel std':>9}{'spread':>8}{'ideal max':>11}{'ideal>1.05':>12}")
    for r in rows:
        for s in (r["muonclip_spread"] or {}).values():
            print(f"{r['seed']:>4}{s['batch_size']:>7}{s['rel_std']:>9.3f}{s['max_over_median']:>8.3f}"
                  f"{s['ideal_clip_max']:>11.3f}{s['ideal_clip_over_overshoot']:>12.2f}")  # fmt: skip
    print(f"all targets met: {a['all_ok']} (growth > {GROWTH_FACTOR:g} tau, hold <= {OVERSHOOT:g} tau at every step "
          f"after the first clip, val within {100 * LOSS_TOLERANCE:g}% or better)")  # fmt: skip


def records_json(runs: dict[str, list[RunRecord]]) -> dict[str, list[dict]]:
    """Curves of every run, for --json."""
    return {
        name: [{"seed": r.seed, "optimizer": r.optimizer, "val_loss": r.val_loss, "attn_max_logit": r.attn_max_logit,
                "heads_clipped": r.heads_clipped, "tokens_per_s": r.tokens_per_s, "wall_s": r.wall_s,
                "spread": r.spread} for r in recs]
        for name, recs in runs.items()
    }  # fmt: skip


def runs_from_json(data: dict[str, list[dict]]) -> dict[str, list[RunRecord]]:
    """RunRecords back from :func:`records_json`'s output."""

    def points(values: list) -> list[tuple[int, float]]:
        return [(int(step), float(v)) for step, v in values]

    return {
        name: [RunRecord(contender=name, seed=r["seed"], optimizer=r["optimizer"], val_loss=points(r["val_loss"]),
                         attn_max_logit=points(r["attn_max_logit"]), heads_clipped=points(r["heads_clipped"]),
                         tokens_per_s=r["tokens_per_s"], wall_s=r["wall_s"], spread=r.get("spread")) for r in recs]
        for name, recs in data.items()
    }  # fmt: skip


def replot(path: Path, img_dir: Path) -> None:
    """Redraw the plots from a ``--json`` output without training."""
    out = json.loads(path.read_text())
    if "convergence" in out:
        part = out["convergence"]
        plot_convergence(runs_from_json(part["runs"]), part["analysis"], img_dir / "convergence.png")
    if "logit_growth" in out:
        part = out["logit_growth"]
        plot_logits(runs_from_json(part["runs"]), part["analysis"]["tau"], img_dir / "logit_growth.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS), help="seeds (default 0 1 2)")
    parser.add_argument("--steps", type=int, default=STEPS, help=f"steps of part 1 (default {STEPS})")
    parser.add_argument("--logit-steps", type=int, default=LOGIT_STEPS, help=f"steps of part 2 ({LOGIT_STEPS})")
    parser.add_argument("--eval-every", type=int, default=EVAL_EVERY, help=f"default {EVAL_EVERY}")
    parser.add_argument("--eval-batches", type=int, default=EVAL_BATCHES, help=f"default {EVAL_BATCHES}")
    parser.add_argument("--muon-lr", type=float, default=MUON_LR, help=f"part 1 Muon lr (default {MUON_LR})")
    parser.add_argument("--muon-adamw-lr", type=float, default=MUON_ADAMW_LR,
                        help=f"part 1 lr of Muon's AdamW groups (default {MUON_ADAMW_LR})")  # fmt: skip
    parser.add_argument("--adamw-lrs", type=float, nargs="+", default=list(ADAMW_LRS),
                        help="AdamW lr grid of part 1 (default 1e-3 3e-3 1e-2)")  # fmt: skip
    parser.add_argument("--only-adamw", action="store_true", help="part 1 with the AdamW grid only (a side check)")
    parser.add_argument("--part", choices=("all", "convergence", "logits"), default="all")
    parser.add_argument("--quick", action="store_true", help="60 steps, seed 0, no plots: a smoke run")
    parser.add_argument("--img-dir", type=Path, default=None, help="where the PNGs go (default docs/img; "
                        "a --quick run writes none unless given)")  # fmt: skip
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    parser.add_argument("--data", metavar="FILE", type=Path, help="a UTF-8 corpus instead of the builtin pysource text")
    parser.add_argument("--json", metavar="PATH", help="also write every figure and curve as JSON to PATH")
    parser.add_argument("--replot", metavar="PATH", type=Path, help="only redraw the plots from a --json output")
    args = parser.parse_args()
    if args.replot:
        replot(args.replot, args.img_dir if args.img_dir is not None else IMG_DIR)
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.data:
        DATA.update(path=str(args.data.resolve()), builtin=None)
    if args.quick:
        args.steps = args.logit_steps = QUICK["steps"]
        args.eval_every, args.eval_batches = QUICK["eval_every"], QUICK["eval_batches"]
        args.seeds = list(QUICK["seeds"])
    img_dir = args.img_dir if args.img_dir is not None else (None if args.quick else IMG_DIR)

    with tempfile.TemporaryDirectory() as cache:  # the tokenized corpus, memory-mapped while training
        out = run(args, img_dir, Path(cache))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


def run(args: argparse.Namespace, img_dir: Path | None, cache: Path) -> dict[str, Any]:
    """Both parts as chosen by ``args``; prints the tables, writes the plots, returns every figure."""
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; data {DATA}")
    out: dict[str, Any] = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
    out["settings"]["threads"] = torch.get_num_threads()
    start = time.perf_counter()
    data = load_data(job_config_from_dict(make_spec(MODEL, {"name": "adamw"}, 1, 0, 1)).data, 0, cache)
    print(f"vocab {data.vocab_size}, train {len(data.train):,} chars, val {len(data.val):,} chars")

    if args.part in ("all", "convergence"):
        t0 = time.perf_counter()
        contenders = convergence_contenders(args.muon_lr, args.muon_adamw_lr, args.adamw_lrs, args.only_adamw)
        runs = run_all(contenders, MODEL, args.steps, args.seeds, args.eval_every, args.eval_batches, data, "conv")
        analysis = analyse_convergence(runs, args.steps)
        analysis["runtime_s"] = time.perf_counter() - t0
        report_convergence(analysis, args.steps, args.muon_lr, args.muon_adamw_lr)
        print(f"part 1 took {analysis['runtime_s'] / 60:.1f} min")
        if img_dir is not None:
            plot_convergence(runs, analysis, img_dir / "convergence.png")
        out["convergence"] = {"analysis": analysis, "runs": records_json(runs)}

    if args.part in ("all", "logits"):
        t0 = time.perf_counter()
        runs = run_all(logit_contenders(), LOGIT_MODEL, args.logit_steps, args.seeds, args.eval_every,
                       args.eval_batches, data, "logits", spread_tau=LOGIT_TAU)  # fmt: skip
        analysis = analyse_logits(runs, LOGIT_TAU)
        analysis["runtime_s"] = time.perf_counter() - t0
        report_logits(analysis, args.logit_steps)
        print(f"part 2 took {analysis['runtime_s'] / 60:.1f} min")
        if img_dir is not None:
            plot_logits(runs, LOGIT_TAU, img_dir / "logit_growth.png")
        out["logit_growth"] = {"analysis": analysis, "runs": records_json(runs)}

    out["runtime_s"] = time.perf_counter() - start
    print(f"\ntotal {out['runtime_s'] / 60:.1f} min")
    return out


if __name__ == "__main__":
    main()
