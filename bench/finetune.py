"""Fine-tuning, AdamW vs Muon, from AdamW- and Muon-pretrained weights: a 2x2 of final val loss.

Moonlight (arXiv 2502.16982) reports that Muon fine-tuning of AdamW-pretrained weights gains less than Muon
fine-tuning of Muon-pretrained ones. Here: a transformers llama (``arch: hf``; 2 layers, hidden
96, 4 heads, SwiGLU 256, head untied, seq_len 128) pretrains on the builtin pysource text with
AdamW (lr 3e-3, betas 0.9/0.95) and with Muon (lr 0.02, its AdamW part 3e-3) at the same budget:
batch 16, WSD schedule with 5% warmup, grad clip 1.0, no weight decay, CPU fp32, ``char``
tokenizer (the fixed 128-character ASCII alphabet, which pysource-instruct shares, so the
pretrained embedding fits the fine-tune). Each pretrained model's final checkpoint then starts
(``RunRequest.init_from``: weights only, a fresh optimizer, the run counting from step 0) a
fine-tune on the builtin pysource-instruct pairs (a stdlib function's def and docstring, then its
body, from files pysource does not hold; loss on the completions only) with AdamW and with Muon,
on the same schedule shape. Every run goes through the engine's ``run_job``, as a worker runs it.

Fine-tune lrs: each cell (pretrain x fine-tune optimizer) tries every factor of ``--scales``
(default 0.1, 1/3 and 1) times its optimizer's pretraining lrs (Muon's lr and its AdamW part
alike) on the first seed; the lowest final validation loss wins, and the winner runs on every
seed (the first seed's run reused). Seed-major: each seed pretrains both models, then fine-tunes
every cell. One torch thread by default (``--threads``): the 2-core hosts are shared, and two
threads on a loaded one ran a step many times slower than one.

Reported: the pretrains' final pysource validation loss; per cell, the fine-tune's validation loss
(pysource-instruct, completions only, 8 batches of 16 x 128 tokens) at step 0 (the pretrained
weights before any fine-tuning step) and at the end, mean ± std (sample std) over the seeds, and
the gain (step 0 minus final); per pretrain, the Muon fine-tune's advantage (the AdamW
fine-tune's final loss minus the Muon fine-tune's), paired by seed. Validation batches depend on
the seed, so the cells of one seed are measured on the same batches. The runs are deterministic
(CPU fp32): a rerun gives the same losses. The printout and ``--out``/finetune.json hold every run.

    .venv/bin/python bench/finetune.py [--seeds 0 1 2] [--pretrain-steps 300] [--finetune-steps 150]
        [--scales 0.1 0.3333 1] [--threads 1] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from contract import metrics
from contract.spec import JobSpec
from worker.engine.checkpoints import latest_checkpoint
from worker.engine.config import job_config
from worker.engine.facts import PYSOURCE_CHAR_VOCAB
from worker.engine.models import build_model
from worker.engine.request import RunRequest
from worker.engine.run import checkpoint_dir, run_job
from worker.engine.telemetry import Report

WIDTH, LAYERS, HEADS, CONTEXT, BATCH = 96, 2, 4, 128, 16
MODEL: dict[str, Any] = {
    "arch": "hf",
    "seq_len": CONTEXT,
    "hf": {
        "config": {
            "model_type": "llama",
            "hidden_size": WIDTH,
            "intermediate_size": 8 * WIDTH // 3 // 8 * 8,  # SwiGLU's 8/3 x width
            "num_hidden_layers": LAYERS,
            "num_attention_heads": HEADS,
        }
    },
}
OPTIMIZERS = ("adamw", "muon")
PRETRAIN_OPTIMIZER: dict[str, dict[str, Any]] = {  # examples/pysource-adamw.yaml, examples/pysource-muon.yaml
    "adamw": {"name": "adamw", "lr": 3e-3, "weight_decay": 0.0, "adamw_betas": [0.9, 0.95]},
    "muon": {"name": "muon", "lr": 0.02, "adamw_lr": 3e-3},
}
PRETRAIN_DATA = {"builtin": "pysource", "tokenizer": "char"}
FINETUNE_DATA = {"builtin": "pysource-instruct", "tokenizer": "char"}
SEEDS = (0, 1, 2)
PRETRAIN_STEPS, FINETUNE_STEPS = 300, 150
SCALES = (0.1, 1 / 3, 1.0)  # fine-tune lrs tried, as factors of the optimizer's pretraining lrs
WARMUP_FRACTION = 0.05
EVALUATIONS = 6  # evaluations per run after step 0


@dataclass
class Run:
    """One training run: its validation curve and wall time."""

    phase: str  # "pretrain" | "finetune"
    seed: int
    pretrain: str
    finetune: str | None
    scale: float | None
    optimizer: dict[str, Any]
    val_loss: list[tuple[int, float]] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def first(self) -> float:
        """The validation loss at step 0."""
        return self.val_loss[0][1]

    @property
    def final(self) -> float:
        """The validation loss at the last step."""
        return self.val_loss[-1][1]


class ValLossSink:
    """A telemetry sink that keeps the validation loss of every evaluation as (step, value)."""

    def __init__(self) -> None:
        self.val_loss: list[tuple[int, float]] = []

    def metrics(self, report: Report) -> None:
        if metrics.VAL_LOSS in report.values:
            self.val_loss.append((report.step, report.values[metrics.VAL_LOSS]))

    def checkpoint(self, step: int, path: Path, nbytes: int, latest: dict[str, float]) -> None:
        pass

    def log(self, level: str, message: str) -> None:
        pass

    def sample(self, step: int, prompt: str, text: str) -> None:
        pass


def scaled_optimizer(name: str, scale: float) -> dict[str, Any]:
    """The optimizer section of ``name`` at ``scale`` times its pretraining lrs."""
    section = dict(PRETRAIN_OPTIMIZER[name])
    for key in ("lr", "adamw_lr"):
        if key in section:
            section[key] = section[key] * scale
    return section


def train_section(steps: int, seed: int, batch_size: int = BATCH) -> dict[str, Any]:
    """The train section shared by every run: WSD with 5% warmup, evaluations spread over the run."""
    return {
        "steps": steps,
        "batch_size": batch_size,
        "eval_every": max(1, steps // EVALUATIONS),
        "checkpoint_every": steps,
        "keep_checkpoints": 1,
        "lr_schedule": "wsd",
        "warmup_steps": max(1, round(WARMUP_FRACTION * steps)) if steps > 1 else 0,
        "seed": seed,
        "device": "cpu",
        "precision": "fp32",
    }


def job_spec(
    model: dict[str, Any],
    data: dict[str, Any],
    optimizer: dict[str, Any],
    steps: int,
    seed: int,
    batch_size: int = BATCH,
) -> dict[str, Any]:
    """A validated job spec (as a dict) of one run, telemetry only at evaluations, no samples."""
    spec = {
        "model": model,
        "data": data,
        "optimizer": optimizer,
        "train": train_section(steps, seed, batch_size),
        "telemetry": {"every": max(1, steps // EVALUATIONS), "sample_tokens": 0},
    }
    return JobSpec.model_validate(spec).model_dump(mode="json")


def train(spec: dict[str, Any], out_dir: Path, init_from: Path | None = None) -> tuple[list[tuple[int, float]], float]:
    """Run ``spec`` through the engine in ``out_dir`` (warm-started from ``init_from``): its
    validation curve and wall seconds."""
    sink = ValLossSink()
    start = time.perf_counter()
    run_job(RunRequest(spec, out_dir, sink=sink, resume=False, init_from=init_from))
    return sink.val_loss, time.perf_counter() - start


def final_checkpoint(out_dir: Path) -> Path:
    """The checkpoint a pretrain in ``out_dir`` wrote at its end."""
    path = latest_checkpoint(checkpoint_dir(out_dir))
    if path is None:
        raise RuntimeError(f"no checkpoint under {out_dir}")
    return path


@dataclass
class Study:
    """What the study runs: the model, the steps, the seeds, the fine-tune lr factors tried."""

    seeds: Sequence[int] = SEEDS
    pretrain_steps: int = PRETRAIN_STEPS
    finetune_steps: int = FINETUNE_STEPS
    scales: Sequence[float] = SCALES
    model: dict[str, Any] = field(default_factory=lambda: MODEL)
    batch_size: int = BATCH

    def spec(self, data: dict[str, Any], optimizer: dict[str, Any], steps: int, seed: int) -> dict[str, Any]:
        """The job spec of one of the study's runs."""
        return job_spec(self.model, data, optimizer, steps, seed, self.batch_size)

    def pretrain(self, optimizer: str, seed: int, work: Path) -> tuple[Run, Path]:
        """Pretrain with ``optimizer`` on pysource: the run and its final checkpoint."""
        section = PRETRAIN_OPTIMIZER[optimizer]
        spec = self.spec(PRETRAIN_DATA, section, self.pretrain_steps, seed)
        out = work / f"pretrain-{optimizer}-s{seed}"
        curve, wall = train(spec, out)
        return Run("pretrain", seed, optimizer, None, None, section, curve, wall), final_checkpoint(out)

    def finetune(self, start: Path, pretrain: str, optimizer: str, scale: float, seed: int, work: Path) -> Run:
        """Fine-tune the weights of ``start`` on pysource-instruct with ``optimizer`` at ``scale``."""
        section = scaled_optimizer(optimizer, scale)
        spec = self.spec(FINETUNE_DATA, section, self.finetune_steps, seed)
        out = work / f"finetune-{pretrain}-{optimizer}-x{scale:.4g}-s{seed}"
        curve, wall = train(spec, out, init_from=start)
        return Run("finetune", seed, pretrain, optimizer, scale, section, curve, wall)


def run_study(study: Study, work: Path, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every run of ``study`` under ``work``, seed-major; the results as plain data."""
    runs: list[Run] = []
    chosen: dict[tuple[str, str], float] = {}
    start, load_before = time.perf_counter(), os.getloadavg()
    for index, seed in enumerate(study.seeds):
        starts = {}
        for optimizer in OPTIMIZERS:
            run, starts[optimizer] = study.pretrain(optimizer, seed, work)
            runs.append(run)
            log(describe(run))
        for pretrain in OPTIMIZERS:
            for optimizer in OPTIMIZERS:
                scales = study.scales if index == 0 else (chosen[pretrain, optimizer],)
                tried = [study.finetune(starts[pretrain], pretrain, optimizer, s, seed, work) for s in scales]
                for run in tried:
                    log(describe(run))
                runs.extend(tried)
                if index == 0:
                    chosen[pretrain, optimizer] = min(tried, key=lambda r: r.final).scale  # type: ignore[assignment]
    return {
        "setup": setup(study),
        "host": host() | {"load_average_before": load_before},
        "chosen_scales": {f"{p}->{f}": s for (p, f), s in chosen.items()},
        "runs": [asdict(r) | {"first": r.first, "final": r.final} for r in runs],
        "pretrain": pretrain_table(runs),
        "table": cell_table(runs, chosen),
        "muon_advantage": muon_advantage(runs, chosen),
        "wall_s": time.perf_counter() - start,
    }


def setup(study: Study) -> dict[str, Any]:
    """The study's settings as plain data, with the tokens each phase trains on."""
    return {
        "model": study.model,
        "parameters": parameter_count(study),
        "batch_size": study.batch_size,
        "pretrain_steps": study.pretrain_steps,
        "finetune_steps": study.finetune_steps,
        "pretrain_tokens": study.pretrain_steps * study.batch_size * study.model["seq_len"],
        "finetune_tokens": study.finetune_steps * study.batch_size * study.model["seq_len"],
        "seeds": list(study.seeds),
        "scales": list(study.scales),
        "pretrain_optimizer": PRETRAIN_OPTIMIZER,
        "schedule": {"lr_schedule": "wsd", "warmup_fraction": WARMUP_FRACTION, "grad_clip": 1.0},
        "data": {"pretrain": PRETRAIN_DATA, "finetune": FINETUNE_DATA},
    }


def parameter_count(study: Study) -> int:
    """The parameters of the study's model at the char vocabulary (128)."""
    config = job_config(study.spec(PRETRAIN_DATA, PRETRAIN_OPTIMIZER["adamw"], study.pretrain_steps, 0)).model
    model = build_model(replace(config, vocab_size=PYSOURCE_CHAR_VOCAB))
    return sum(p.numel() for p in model.parameters())


def host() -> dict[str, Any]:
    """The machine the figures come from: CPU model and family (as lscpu gives them), cores,
    threads, load, versions."""
    cpu: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "cpu family", "model") and key.strip() not in cpu:
                cpu[key.strip()] = value.strip()
    except OSError:
        pass
    return {
        "cpu": cpu.get("model name", platform.processor() or platform.machine()),
        "family": cpu.get("cpu family"),
        "model": cpu.get("model"),
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "load_average": os.getloadavg(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def mean_std(values: Sequence[float]) -> dict[str, float]:
    """Mean and sample std (0 for a single value)."""
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "n": len(values),
    }


def pretrain_table(runs: Sequence[Run]) -> dict[str, dict[str, float]]:
    """Per pretrain optimizer: the final pysource validation loss over the seeds."""
    return {o: mean_std([r.final for r in runs if r.phase == "pretrain" and r.pretrain == o]) for o in OPTIMIZERS}


def cell_table(runs: Sequence[Run], chosen: dict[tuple[str, str], float]) -> dict[str, dict[str, Any]]:
    """Per cell (pretrain -> fine-tune): the chosen scale's step-0 and final validation losses and
    the gain, over the seeds."""
    table = {}
    for (pretrain, optimizer), scale in chosen.items():
        key = ("finetune", pretrain, optimizer, scale)
        cell = [r for r in runs if (r.phase, r.pretrain, r.finetune, r.scale) == key]
        table[f"{pretrain}->{optimizer}"] = {
            "scale": scale,
            "lr": scaled_optimizer(optimizer, scale)["lr"],
            "step0": mean_std([r.first for r in cell]),
            "final": mean_std([r.final for r in cell]),
            "gain": mean_std([r.first - r.final for r in cell]),
        }
    return table


def muon_advantage(runs: Sequence[Run], chosen: dict[tuple[str, str], float]) -> dict[str, dict[str, float]]:
    """Per pretrain optimizer: the AdamW fine-tune's final val loss minus the Muon fine-tune's,
    paired by seed (both start from the same weights and read the same validation batches)."""
    final = {
        (r.pretrain, r.finetune, r.seed): r.final
        for r in runs
        if r.phase == "finetune" and r.scale == chosen[r.pretrain, r.finetune]  # type: ignore[index]
    }
    seeds = sorted({seed for _, _, seed in final})
    return {p: mean_std([final[p, "adamw", s] - final[p, "muon", s] for s in seeds]) for p in OPTIMIZERS}


def describe(run: Run) -> str:
    """One line of a run: phase, optimizers, seed, lr, val loss at step 0 and at the end, seconds."""
    name = run.pretrain if run.phase == "pretrain" else f"{run.pretrain} -> {run.finetune}"
    return (
        f"{run.phase:<8} {name:<14} seed {run.seed}  lr {run.optimizer['lr']:<8.4g} "
        f"val {run.first:.4f} -> {run.final:.4f}  ({run.wall_s:.1f} s)"
    )


def pm(stats: dict[str, float]) -> str:
    """``mean ± std`` to 4 decimals."""
    return f"{stats['mean']:.4f} ± {stats['std']:.4f}"


def format_table(results: dict[str, Any]) -> str:
    """The 2x2 table (final fine-tune val loss), the gains and the pretrains' losses, as text."""
    table, n = results["table"], len(results["setup"]["seeds"])
    lines = [f"final val loss on pysource-instruct (completions), mean ± std over {n} seeds", ""]
    corner = "pretrain \\ fine-tune"
    lines.append(f"{corner:<22}" + "".join(f"{f:>22}" for f in OPTIMIZERS))
    for p in OPTIMIZERS:
        lines.append(f"{p:<22}" + "".join(f"{pm(table[f'{p}->{f}']['final']):>22}" for f in OPTIMIZERS))
    lines += ["", f"{'cell':<16}{'lr':>10}{'step 0':>22}{'final':>22}{'gain':>22}"]
    for name, cell in table.items():
        lines.append(
            f"{name:<16}{cell['lr']:>10.4g}{pm(cell['step0']):>22}{pm(cell['final']):>22}{pm(cell['gain']):>22}"
        )
    lines += ["", "Muon fine-tune's advantage (AdamW fine-tune's final minus Muon's, paired by seed):"]
    lines += [f"  from {p:<6} {pm(s)}" for p, s in results["muon_advantage"].items()]
    lines += ["", "pretrain final val loss on pysource:"]
    lines += [f"  {o:<6} {pm(s)}" for o, s in results["pretrain"].items()]
    return "\n".join(lines)


def seed_rows(results: dict[str, Any]) -> str:
    """Per seed: each pretrain's final pysource val loss and each cell's chosen run, as text."""
    chosen = results["chosen_scales"]
    lines = [f"{'seed':<6}{'run':<18}{'lr':>10}{'step 0':>10}{'final':>10}{'seconds':>9}"]
    for r in results["runs"]:
        cell = f"{r['pretrain']}->{r['finetune']}"
        if r["phase"] == "finetune" and r["scale"] != chosen[cell]:
            continue
        name = f"pretrain {r['pretrain']}" if r["phase"] == "pretrain" else cell
        lr = r["optimizer"]["lr"]
        lines.append(f"{r['seed']:<6}{name:<18}{lr:>10.4g}{r['first']:>10.4f}{r['final']:>10.4f}{r['wall_s']:>9.1f}")
    return "\n".join(lines)


def setup_line(setup: dict[str, Any]) -> str:
    """The model and budget in one line."""
    config = setup["model"]["hf"]["config"]
    return (
        f"llama, {config['num_hidden_layers']} layers x hidden {config['hidden_size']}, "
        f"{setup['parameters']:,} parameters; batch {setup['batch_size']} x {setup['model']['seq_len']}; "
        f"pretrain {setup['pretrain_steps']} steps ({setup['pretrain_tokens']:,} tokens), "
        f"fine-tune {setup['finetune_steps']} steps ({setup['finetune_tokens']:,} tokens); "
        f"seeds {setup['seeds']}, fine-tune lr factors {', '.join(f'{x:.3g}' for x in setup['scales'])}"
    )


def host_line(info: dict[str, Any]) -> str:
    """The host in one line."""
    load = ", ".join(f"{x:.1f}" for x in info["load_average"])
    return (
        f"{info['cpu']} (family {info['family']} model {info['model']}), {info['cores']} cores, "
        f"{info['threads']} threads, load {load}; torch {info['torch']}, Python {info['python']}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    parser.add_argument("--pretrain-steps", type=int, default=PRETRAIN_STEPS)
    parser.add_argument("--finetune-steps", type=int, default=FINETUNE_STEPS)
    parser.add_argument("--scales", type=float, nargs="+", default=list(SCALES), help="fine-tune lr factors tried")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--out", type=Path, default=Path("bench/out/finetune"), help="the results' JSON goes here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    study = Study(args.seeds, args.pretrain_steps, args.finetune_steps, args.scales)
    with tempfile.TemporaryDirectory() as tmp:
        results = run_study(study, Path(tmp))
    print()
    print(host_line(results["host"]))
    print(setup_line(results["setup"]))
    print(f"wall time {results['wall_s']:.0f} s")
    print(format_table(results))
    print()
    print(seed_rows(results))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "finetune.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwritten: {path}")


if __name__ == "__main__":
    main()
