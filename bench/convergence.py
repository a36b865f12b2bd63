"""Convergence on the builtin pysource text (char level; any corpus with --data FILE): Muon and
MuonClip against tuned AdamW, every contender scheduled and tuned; MuonClip's QK-Clip holding
attention logits that plain Muon lets grow; and the Muon family (NorMuon, per-head, cautious
weight decay) against Muon on the same protocol.

Part 1 (convergence), one protocol for every contender. Model per ``--config``: small = GPT 2
layers, d_model 128, 4 heads, seq_len 64, batch 32, 400 steps; large = 4 layers, d_model 256, 4
heads, seq_len 64, batch 32, 1,500 steps (at the same tokens per batch Newton-Schulz is a larger
share of its flops: it grows as d^3, a forward and backward as d^2 x tokens). Every
run has a linear warmup over the first 5% of steps and a decaying schedule, the engine's own
(``train.lr_schedule``): ``wsd`` (flat, then linear to 0 over the last 20% of steps) and
``cosine`` (from the end of warmup to 0 at the last step); grad clip 1.0, no weight decay,
CPU fp32. Contenders and lr grids: AdamW (on every parameter) {1e-3, 2e-3, 3e-3, 6e-3, 1e-2};
Muon (Keller coefficients) and MuonClip (tau 100) {0.01, 0.02, 0.04, 0.08}, their AdamW part
(embeddings, head, norms) at AdamW's tuned lr.

  Stage 1 tunes on the first seed: every (lr, schedule) of each contender, AdamW first (the
  others need its tuned lr); the winner is the lowest final validation loss. Stage 2 runs every
  contender's winner on every seed (the first one again, so that all figures come from the same
  interleaved runs), seed-major: for each seed AdamW, Muon, MuonClip one after the other, so
  load drift on the machine hits them alike. Tuning on one seed and confirming on three.
  Stage 3 (``--horizons``) runs Muon's winner again after each seed's stage 2, scheduled over
  shorter lengths (fractions of the steps rounded to eval points, each run with its own warmup
  and decay): the shortest length whose final validation loss reaches tuned AdamW's final one
  (interpolated between lengths, the full run the longest) and its training seconds give the
  step and wall-clock ratios of a run scheduled to end at the target.

  Reported per contender (stage 2): final validation loss (mean, std, min-max over seeds);
  steps to reach tuned AdamW's final validation loss of the same seed (linear interpolation
  between eval points), / AdamW's steps = the step ratio; training seconds to reach it, / tuned
  AdamW's training seconds for its whole run (at whose end it reaches that loss) = the
  wall-clock ratio; tokens/s over the training steps. Training seconds are wall time from the
  start of the training loop with evaluation taken out: the Trainer's ``evaluate`` (and sample
  writing, off here) is timed and subtracted, so the clock holds batches, lr schedule, forward,
  backward, optimizer step and the telemetry reports (every ``eval_every`` steps, alike for all).
  The clock is read at every evaluation (before it runs) and interpolated at the crossing step.
  Targets: Muon's mean wall-clock ratio <= 0.7 (small) / <= 0.6 (large), read on stage 3's
  runs, each scheduled to end where it is measured, as AdamW's run is (without ``--horizons``, on
  stage 2's crossing inside the full run, which is always printed too); MuonClip's final
  validation loss within 1% of Muon's.

Part 3 (``--part family``, the Muon family against Muon): Muon and its variants (``--family``:
NorMuon; Muon and NorMuon with the query and key projections orthogonalized per head; Muon and
NorMuon with cautious weight decay 0.1) on part 1's protocol with Muon as the reference: stage 1
tunes each one's lr on the first seed (``--muon-lrs``; their AdamW part at the first of
``--adamw-lrs``), stage 2 runs the winners on every seed, stage 3 runs every variant's winner
scheduled over shorter lengths (default 0.6 to 0.9 of the steps) to find the steps at which a
run scheduled to end there reaches tuned Muon's final validation loss of the same seed. Reported:
each variant's final loss against Muon's, and its steps (and training seconds) to Muon's final
loss / Muon's, inside its full run and scheduled (the measure). Goal: the best variant at <= 0.9
of Muon's steps on the large configuration.

Part 1 also takes family variants as contenders (``--contenders normuon ...``): each is tuned,
run on every seed and scheduled over the shorter lengths as Muon is, against tuned AdamW's final
loss, and reported beside Muon (its steps there / Muon's, per seed).

``--jobs N`` trains N runs at a time, each in a spawned process of its own (on one GPU, where a
small model's step is bound by the host issuing its kernels, N runs overlap); the step counts
are those of one run at a time, the training seconds are not (only ``--jobs 1`` gives wall-clock
ratios). ``--progress FILE`` keeps every run's record as it ends, and ``--from-progress FILE...``
analyses part 1 or 3 from such records (runs cut short, or the seeds of one protocol run in
several invocations), training nothing.

Part 2 (logit growth): a fixed stress configuration (the small model, constant lr, no warmup,
Muon lr 0.05, tau 30, 400 steps, telemetry every step) in which plain Muon's max attention
logit (``attn_max_logit``, measured in each training forward before that step's clip) climbs
past 3 x tau. During the MuonClip run every step also replays an ideal clip: before step i's
update, one extra no-grad forward of the same weights on batch i + 1 gives r_h(i + 1) per head;
with s_h(i) from step i's training forward, ideal(i) = max_h min(1, tau / s_h(i)) * r_h(i + 1)
is what batch i + 1 reads after a perfect clip on batch i with no update in between. It is
compared with what MuonClip actually reads on batch i + 1 after its clip and update (step
i + 1's ``attn_max_logit``), over the steps from the first clip on. Targets: median of
MuonClip's max logit / tau <= 1.05, its p95 <= 1.02 x the ideal clip's p95, plain Muon past
3 x tau, MuonClip's final validation loss within 1% of plain Muon's or better. Beside K2's clip,
part 2 runs MuonClip re-measured after the update on the step's batch (``qk_clip_remeasure``)
and on it and the batch before (``qk_clip_remeasure_batches: 2``), each with its own replay
(``--clips`` picks which). The extra forward
uses no randomness (the model has no dropout) and leaves the recorded maxima to the training
forward, so the run itself is unchanged. Part 2 also re-measures the final weights' per-head
maxima on unseen batches (at the training batch and at a 32x larger one) with the same replay.

    .venv/bin/python bench/convergence.py --plan [--config large]   # the runs and an estimated time
    .venv/bin/python bench/convergence.py --threads 1 --json out.json [--config large] [--part convergence]
    .venv/bin/python bench/convergence.py --quick        # a smoke run of every code path (a few minutes)
    .venv/bin/python bench/convergence.py --replot out.json   # redraw the plots from a --json output
    python bench/convergence.py --device cuda --no-plots --json out.json ...  # every run on a CUDA device
    python bench/convergence.py --part family --config large --device cuda --jobs 8 --progress runs.jsonl
    .venv/bin/python bench/convergence.py --part family --config large --from-progress runs.jsonl more.jsonl
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import tempfile
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

import optim
from contract.spec import JobSpec
from worker.engine.config import job_config
from worker.engine.data import TokenData, load_data
from worker.engine.outcome import TrainingError
from worker.engine.telemetry import Report
from worker.engine.trainer import Trainer

try:
    from bench import convergence_protocol as proto
except ImportError:  # run as a script without the repository on sys.path: bench/ itself is
    import convergence_protocol as proto  # type: ignore[no-redef]
fmt = proto.describe

REPO = Path(__file__).resolve().parents[1]
DATA: dict[str, Any] = {"builtin": "pysource", "tokenizer": "char"}  # --data FILE: {"path": FILE, ...}
DEVICE = {"type": "cpu"}  # --device cuda: train.device of every run
IMG_DIR = REPO / "docs" / "img"


@dataclass(frozen=True)
class Config:
    model: dict[str, Any]
    steps: int
    eval_every: int
    target_wall_ratio: float  # Muon's mean wall-clock ratio must be at or below it
    # Seconds per step, evaluation included, of AdamW, Muon and MuonClip runs at 1 thread on the
    # 2-core CPU machine while it was shared (load 6-9), for --plan: small from a 400-step Muon
    # run (205 s) and the quick run's relative speeds, large from 30-step runs.
    seconds_per_step: dict[str, float] = field(default_factory=dict)


# The same small Muon run took about 60 s instead of 205 s on the machine when idle.
IDLE_FACTOR = 0.3

GPT = {"arch": "gpt", "n_head": 4, "seq_len": 64}
CONFIGS = {
    "small": Config(
        {**GPT, "n_layer": 2, "d_model": 128}, 400, 25, 0.7, {"adamw": 0.45, "muon": 0.51, "muonclip": 0.52}
    ),
    "large": Config(
        {**GPT, "n_layer": 4, "d_model": 256}, 1500, 50, 0.6, {"adamw": 3.05, "muon": 3.55, "muonclip": 3.6}
    ),
}
BATCH_SIZE = 32
EVAL_BATCHES = 16  # 16 x 32 x 64 = 32,768 validation tokens per evaluation (engine default: 8)
WARMUP_FRACTION = 0.05
SEEDS = (0, 1, 2)
SCHEDULES = ("wsd", "cosine")
ADAMW_LRS = (1e-3, 2e-3, 3e-3, 6e-3, 1e-2)
MUON_LRS = (0.01, 0.02, 0.04, 0.08)
CONVERGENCE_TAU = 100.0  # Kimi K2's tau
CONTENDERS = ("adamw", "muon", "muonclip")
# Part 3, the Muon family against Muon: each variant's optimizer fields over Muon's. The cautious
# variants decay by FAMILY_WEIGHT_DECAY (scaled by the scheduled lr), where plain Muon has none.
FAMILY_WEIGHT_DECAY = 0.1
CAUTIOUS = {"weight_decay": FAMILY_WEIGHT_DECAY, "weight_decay_mode": "cautious"}
FAMILY: dict[str, dict[str, Any]] = {
    "normuon": {"name": "normuon"},
    "muon-per-head": {"orthogonalize": "per_head"},
    "normuon-per-head": {"name": "normuon", "orthogonalize": "per_head"},
    "muon-cautious": CAUTIOUS,
    "normuon-cautious": {"name": "normuon", **CAUTIOUS},
}
FAMILY_HORIZONS = (0.6, 0.7, 0.8, 0.9)  # part 3's stage 3: the variants are expected near Muon
HORIZONS = (0.4, 0.5, 0.6, 0.7, 0.8)  # stage 3: fractions of the steps (rounded to eval points)
LOSS_TOLERANCE = 0.01  # MuonClip's final val loss within 1% of Muon's (or better)

# -- part 2: logit growth ------------------------------------------------------------------------
LOGIT_MODEL = CONFIGS["small"].model
LOGIT_STEPS = 400
LOGIT_MUON_LR, LOGIT_ADAMW_LR = 0.05, 3e-3
LOGIT_TAU = 30.0
# With the final-weights spread; MuonClip: its replay; re-measured: one more forward per step (estimated).
LOGIT_SECONDS_PER_STEP = {"muon": 0.7, "muonclip": 0.85, "muonclip-remeasure": 1.0, "muonclip-remeasure2": 1.1}
# Part 2's clipping contenders: K2's QK-Clip, then re-measured after the update on the step's batch
# (and, for the second, the one before it too): qk_clip_remeasure_batches of each.
REMEASURE_BATCHES = {"muonclip-remeasure": 1, "muonclip-remeasure2": 2}
CLIPS = ("muonclip", *REMEASURE_BATCHES)
# The final weights' max logit re-measured on fresh training batches, at the training batch and a
# 32x larger one (65,536 tokens); --quick takes fewer and smaller.
SPREAD = {"batches": 16, "large_batch": 1024}
SPREAD_OFFSET = 1_000_000  # batch indices far beyond any run's steps
GROWTH_FACTOR = 3.0  # plain Muon's max logit must pass GROWTH_FACTOR x tau
HOLD_MEDIAN = 1.05  # median of MuonClip's max logit / tau after its first clip
HOLD_P95_FACTOR = 1.02  # its p95 against the ideal clip's p95

QUICK = {
    "steps": 60,
    "eval_every": 20,
    "eval_batches": 4,
    "seeds": (0, 1),
    "adamw_lrs": (3e-3,),
    "muon_lrs": (0.02,),
    "horizons": (0.5,),
    "spread": {"batches": 3, "large_batch": 128},
    "logit_tau": 6.0,  # a tau that 60 steps pass, so that the hold measurement has steps to read
}
HEAD_KEY = re.compile(r"attn_max_logit/l(\d+)h(\d+)$")


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


class BenchTrainer(Trainer):
    """The engine's Trainer with a training clock that leaves evaluation out and, given
    ``replay_tau``, the per-step ideal-clip replay of part 2 (see the module docstring)."""

    def __init__(self, *args: Any, replay_tau: float | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.replay_tau = replay_tau
        self.clock: list[tuple[int, float]] = []  # (steps done, training seconds) at each evaluation
        self.heads: list[list[float]] = []  # per-head maxima of each step's training forward
        self.next_heads: list[list[float]] = []  # the same weights on the next step's batch
        self._start, self._excluded = 0.0, 0.0

    def run(self, *args: Any, **kwargs: Any):
        self._start, self._excluded = time.perf_counter(), 0.0
        return super().run(*args, **kwargs)

    def _now(self) -> float:
        """The clock once the device has done what was queued (CUDA runs ahead of the host)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def evaluate(self) -> torch.Tensor:
        t0 = self._now()
        self.clock.append((self.step, t0 - self._start - self._excluded))
        try:
            return super().evaluate()
        finally:
            self._excluded += self._now() - t0

    def write_sample(self) -> None:
        t0 = time.perf_counter()
        super().write_sample()
        self._excluded += time.perf_counter() - t0

    def train_step(self, report: bool) -> dict[str, torch.Tensor | float]:
        if self.replay_tau is None:
            return super().train_step(report)
        with torch.no_grad():  # before this step's update, on the next step's batch
            self.next_heads.append(head_maxima(self.model, self._batch("train", self.step + 1)[0]))
        values = super().train_step(report)
        heads = sorted((tuple(map(int, m.groups())), float(v)) for k, v in values.items() if (m := HEAD_KEY.match(k)))
        self.heads.append([v for _, v in heads])
        return values


@dataclass
class RunRecord:
    """What one training run reports: validation curve, training clock, max-logit curve, timing."""

    contender: str
    seed: int
    lr: float
    schedule: str
    optimizer: dict[str, Any]
    val_loss: list[tuple[int, float]]
    clock: list[tuple[int, float]]
    attn_max_logit: list[tuple[int, float]]
    heads_clipped: list[tuple[int, float]] = field(default_factory=list)
    tokens_per_s: float | None = None
    wall_s: float = 0.0
    replay: dict[str, Any] | None = None  # part 2, MuonClip: per-step heads and next-batch heads
    spread: dict[str, Any] | None = None

    @property
    def final_val(self) -> float:
        return self.val_loss[-1][1] if self.val_loss else float("inf")

    @property
    def train_seconds(self) -> float:
        return self.clock[-1][1]

    @property
    def peak_logit(self) -> float:
        return max((v for _, v in self.attn_max_logit), default=float("nan"))


def optimizer_section(contender: str, lr: float, adamw_lr: float, tau: float = CONVERGENCE_TAU) -> dict[str, Any]:
    """The JobSpec ``optimizer`` section of a contender at ``lr`` (Muon's AdamW part at ``adamw_lr``);
    ``muonclip-remeasure`` (``-remeasure2``) is MuonClip with ``qk_clip_remeasure`` on 1 (2) batches;
    a FAMILY variant is Muon with its fields."""
    if contender == "adamw":
        return {"name": "adamw", "lr": lr}
    muon = {"name": "muon", "lr": lr, "adamw_lr": adamw_lr}
    if contender == "muon":
        return muon
    if contender in FAMILY:
        return {**muon, **FAMILY[contender]}
    clip = {**muon, "name": "muonclip", "qk_clip_tau": tau}
    if contender in REMEASURE_BATCHES:
        clip.update(qk_clip_remeasure=True, qk_clip_remeasure_batches=REMEASURE_BATCHES[contender])
    return clip


def make_spec(
    model: dict,
    optimizer: dict,
    steps: int,
    seed: int,
    eval_every: int,
    schedule: str = "constant",
    warmup: int = 0,
    telemetry_every: int = 1,
) -> dict[str, Any]:
    """A validated JobSpec dict: char-level DATA, DEVICE, no checkpoints, no samples."""
    return JobSpec.model_validate(
        {
            "name": f"bench-convergence-{optimizer['name']}",
            "model": model,
            "data": DATA,
            "optimizer": optimizer,
            "train": {
                "steps": steps,
                "batch_size": BATCH_SIZE,
                "eval_every": eval_every,
                "lr_schedule": schedule,
                "warmup_steps": warmup,
                "checkpoint_every": steps + 1,
                "seed": seed,
                "device": DEVICE["type"],
            },
            "telemetry": {"every": telemetry_every, "sample_tokens": 0},
        }
    ).model_dump()


def train(
    contender: str,
    lr: float,
    spec: dict[str, Any],
    data: TokenData,
    eval_batches: int,
    replay_tau: float | None = None,
    spread_tau: float | None = None,
) -> RunRecord:
    """Train one spec through the engine's Trainer and collect its telemetry (``eval_batches`` is
    an engine setting the JobSpec does not expose, so it is set on the built config)."""
    job = job_config(spec)
    job = replace(job, eval_batches=eval_batches)
    sink = RecordingSink()
    trainer = BenchTrainer(job, data, None, sink, replay_tau=replay_tau)
    result = trainer.run(resume=False)
    if result.status != "succeeded":
        raise RuntimeError(f"{contender} seed {job.train.seed}: run ended {result.status}")
    seq_len = job.model.seq_len
    return RunRecord(
        contender=contender,
        seed=job.train.seed,
        lr=lr,
        schedule=job.train.lr_schedule,
        optimizer=spec["optimizer"],
        val_loss=sink.series["val_loss"],
        clock=trainer.clock,
        attn_max_logit=sink.series["attn_max_logit"],
        heads_clipped=sink.series.get("qk_clip/heads_clipped", []),
        tokens_per_s=result.tokens_per_s,
        wall_s=result.wall_s,
        replay=None if replay_tau is None else {"heads": trainer.heads, "next_heads": trainer.next_heads},
        spread=None if spread_tau is None else batch_spread(trainer.model, data, job.train.seed, seq_len, spread_tau),
    )


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


@torch.no_grad()
def batch_spread(model: torch.nn.Module, data: TokenData, seed: int, seq_len: int, tau: float) -> dict[str, Any]:
    """Per-head max logits of the final weights on SPREAD["batches"] unseen training batches, at the
    benchmark's batch size and at SPREAD["large_batch"], and the ideal-clip replay between
    consecutive ones: the batch-to-batch spread no clip on the batch just seen can remove."""
    out = {}
    for label, batch_size in (("train_batch", BATCH_SIZE), ("large_batch", SPREAD["large_batch"])):
        per_head = [
            head_maxima(model, data.batch("train", SPREAD_OFFSET + i, batch_size, seq_len, seed)[0])
            for i in range(SPREAD["batches"])
        ]
        maxima = [max(h) for h in per_head]
        ideal = [proto.ideal_clip(a, b, tau) for a, b in itertools.pairwise(per_head)]
        out[label] = {
            "batch_size": batch_size,
            "maxima": maxima,
            **proto.spread(maxima),
            "ideal_max": max(ideal),
            "ideal_over_1.05": sum(v > HOLD_MEDIAN for v in ideal) / len(ideal),
        }
    return out


# -- part 1 --------------------------------------------------------------------------------------
def contender_grids(args: argparse.Namespace) -> dict[str, list[float]]:
    """Each contender's lr grid, AdamW first (the others' AdamW part takes its tuned lr)."""
    return {c: args.adamw_lrs if c == "adamw" else args.muon_lrs for c in args.contenders}


@dataclass(frozen=True)
class Call:
    """One part-1 training run: a contender's setting on a seed, scheduled over ``steps``."""

    stage: int
    contender: str
    lr: float
    schedule: str
    seed: int
    adamw_lr: float
    steps: int


@dataclass(frozen=True)
class Setup:
    """What every part-1 run shares (what a worker process needs besides the data)."""

    model: dict[str, Any]
    eval_every: int
    eval_batches: int
    progress: str | None
    data: dict[str, Any]
    device: str
    threads: int | None


def train_call(call: Call, setup: Setup, data: TokenData) -> RunRecord:
    """Train one call; a diverged stage-1 grid point loses (an empty record), later ones raise."""
    warmup = max(1, round(WARMUP_FRACTION * call.steps))  # every run: its own warmup and schedule over its length
    spec = make_spec(
        setup.model,
        optimizer_section(call.contender, call.lr, call.adamw_lr),
        call.steps,
        call.seed,
        setup.eval_every,
        call.schedule,
        warmup,
        telemetry_every=setup.eval_every,
    )
    try:
        rec = train(call.contender, call.lr, spec, data, setup.eval_batches)
    except TrainingError as e:
        if call.stage > 1:
            raise
        print(f"  [stage 1] {call.contender} lr={call.lr:g} {call.schedule}: {e}", flush=True)
        return RunRecord(call.contender, call.seed, call.lr, call.schedule, spec["optimizer"], [], [(0, 0.0)], [])
    print(
        f"  [stage {call.stage}] seed {call.seed} {call.contender:<16} lr={call.lr:<7g}{call.schedule:<7}"
        f"{call.steps:>5} steps, final val {rec.final_val:.4f}  train {rec.train_seconds:6.1f} s  "
        f"{rec.tokens_per_s:7.0f} tok/s",
        flush=True,
    )
    if setup.progress:  # every run as it ends: a run cut short keeps what it finished
        with open(setup.progress, "a") as f:
            f.write(json.dumps({"stage": call.stage, **asdict(rec)}) + "\n")
    return rec


_WORKER: dict[str, Any] = {}  # a worker process's setup and data (Runner with jobs > 1)


def _start_worker(setup: Setup, cache: str) -> None:
    DATA.clear()
    DATA.update(setup.data)
    DEVICE["type"] = setup.device
    if setup.threads:
        torch.set_num_threads(setup.threads)
    _WORKER["setup"] = setup
    _WORKER["data"] = load_data(job_config(make_spec(setup.model, {"name": "adamw"}, 1, 0, 1)).data, 0, Path(cache))


def _train_in_worker(call: Call) -> RunRecord:
    return train_call(call, _WORKER["setup"], _WORKER["data"])


class Runner:
    """Trains calls here one after another, or (``jobs`` > 1) that many at a time in spawned
    processes: the step counts are the same either way, the training seconds are not (runs that
    share the machine slow each other), so wall-clock figures come from ``jobs`` 1 alone."""

    def __init__(self, setup: Setup, data: TokenData, cache: Path, jobs: int) -> None:
        self.setup, self.data, self.pool = setup, data, None
        if jobs > 1:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            context = multiprocessing.get_context("spawn")  # CUDA cannot be forked
            self.pool = ProcessPoolExecutor(jobs, context, _start_worker, (setup, str(cache)))

    def map(self, calls: list[Call]) -> list[RunRecord]:
        if self.pool is None:
            return [train_call(c, self.setup, self.data) for c in calls]
        return list(self.pool.map(_train_in_worker, calls))

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()


def part_roles(args: argparse.Namespace) -> tuple[str, tuple[str, ...]]:
    """The reference and the challengers (who run stage 3) of part 1 or 3: part 1 measures Muon and
    any family variant against AdamW, part 3 the variants against Muon."""
    if args.part == "family":
        return "muon", tuple(args.family)
    return "adamw", tuple(c for c in args.contenders if c == "muon" or c in FAMILY)


def winner(contender: str, stage1: list[RunRecord]) -> proto.Setting:
    """A contender's tuned setting: the stage-1 run with the lowest final validation loss."""
    return proto.pick_winner({proto.Setting(contender, r.lr, r.schedule): r.final_val for r in stage1})


def run_convergence(
    args: argparse.Namespace, runner: Runner, reference: str = "adamw", challengers: tuple[str, ...] = ("muon",)
) -> dict[str, Any]:
    """Stage 1 (tuning on the first seed), then stage 2 (the winners, every seed) and stage 3 (each
    of ``challengers``' winners scheduled over each shorter horizon, every seed), seed-major.
    Without AdamW among the contenders their AdamW part takes the first lr of ``--adamw-lrs``."""
    grids = contender_grids(args)
    horizons = proto.horizon_steps(args.horizons, args.steps, args.eval_every)
    stage1: dict[str, list[RunRecord]] = {}
    winners: dict[str, proto.Setting] = {}
    adamw_lr = args.adamw_lrs[0]
    tuned_first = [c for c in grids if c == "adamw"]  # the others' AdamW part takes its tuned lr
    for batch in (tuned_first, [c for c in grids if c != "adamw"]):
        calls = [
            Call(1, c, lr, s, args.seeds[0], adamw_lr, args.steps)
            for c in batch
            for s in args.schedules
            for lr in grids[c]
        ]
        recs = runner.map(calls)
        for contender in batch:
            stage1[contender] = [r for r in recs if r.contender == contender]
            best = winners[contender] = winner(contender, stage1[contender])
            edge = " (at the edge of the grid)" if proto.at_grid_edge(best.lr, grids[contender]) else ""
            print(f"stage 1 winner: {best.label}{edge}", flush=True)
            if contender == "adamw":
                adamw_lr = best.lr

    def reused(contender: str, seed: int) -> bool:  # nothing was tuned: that stage-1 run is this one
        return seed == args.seeds[0] and len(stage1[contender]) == 1

    calls = []
    for seed in args.seeds:
        calls += [
            Call(2, c, w.lr, w.schedule, seed, adamw_lr, args.steps) for c, w in winners.items() if not reused(c, seed)
        ]
        calls += [
            Call(3, c, winners[c].lr, winners[c].schedule, seed, adamw_lr, h) for c in challengers for h in horizons
        ]
    done = iter(runner.map(calls))
    stage2: dict[str, list[RunRecord]] = {c: [] for c in grids}
    shorter: dict[str, list[list[RunRecord]]] = {c: [] for c in challengers}  # per seed, the horizons' runs
    for seed in args.seeds:
        for contender in winners:
            stage2[contender].append(stage1[contender][0] if reused(contender, seed) else next(done))
        for contender in challengers:
            shorter[contender].append([next(done) for _ in horizons])
    return analyse_part(args, stage1, stage2, shorter, reference)


def analyse_part(
    args: argparse.Namespace,
    stage1: dict[str, list[RunRecord]],
    stage2: dict[str, list[RunRecord]],
    shorter: dict[str, list[list[RunRecord]]],
    reference: str,
) -> dict[str, Any]:
    """Part 1's (or 3's) figures and records from its runs: stage 1's per contender, stage 2's per
    contender (one per seed), and each challenger's shorter scheduled runs per seed."""
    analysis = analyse_convergence(stage2, args.steps, args.target_wall_ratio, reference)
    analysis["horizons"] = {
        c: analyse_horizons(stage2, runs, args.steps, args.target_wall_ratio, reference, c)
        for c, runs in shorter.items()
    }
    analysis["reference"] = reference
    analysis["winners"] = {c: asdict(winner(c, recs)) for c, recs in stage1.items()}
    analysis["stage1_final_val"] = {
        c: {f"{r.lr:g} {r.schedule}": r.final_val for r in recs} for c, recs in stage1.items()
    }
    return {
        "analysis": analysis,
        "stage1": records_json(stage1),
        "runs": records_json(stage2),
        "horizon_runs": {c: [asdict(r) for runs in per_seed for r in runs] for c, per_seed in shorter.items()},
    }


def from_progress(
    args: argparse.Namespace, paths: list[Path], reference: str, challengers: tuple[str, ...]
) -> dict[str, Any]:
    """Part 1 (or 3) analysed from the ``--progress`` records of earlier runs, trains nothing: runs
    cut short, or a protocol split over several invocations or machines. Each contender's setting
    is its stage-1 winner on the first seed; per seed, its full-length run at that setting and the
    challengers' shorter runs at it (a horizon that never ran is left out)."""
    found: list[tuple[int, RunRecord]] = []
    for path in paths:
        for line in path.read_text().splitlines():
            record = json.loads(line)
            stage = record.pop("stage")
            (run,) = runs_from_json({"": [record]})[""]
            if run.val_loss:  # a diverged grid point has none
                found.append((stage, run))
    first = args.seeds[0]
    stage1 = {
        c: [r for stage, r in found if stage == 1 and r.contender == c and r.seed == first] for c in args.contenders
    }
    winners = {c: winner(c, recs) for c, recs in stage1.items()}

    def at_winner(r: RunRecord) -> bool:
        return proto.Setting(r.contender, r.lr, r.schedule) == winners[r.contender]

    stage2: dict[str, list[RunRecord]] = {c: [] for c in args.contenders}
    shorter: dict[str, list[list[RunRecord]]] = {c: [] for c in challengers}
    for seed in args.seeds:
        for c in args.contenders:
            full = [
                r
                for _, r in sorted(found, key=lambda x: -x[0])  # a stage-2 run before a stage-1 one
                if r.contender == c and r.seed == seed and at_winner(r) and r.val_loss[-1][0] == args.steps
            ]
            if not full:
                raise SystemExit(
                    f"no full-length run of {c} at its winning setting on seed {seed} in {[str(p) for p in paths]}"
                )
            stage2[c].append(full[0])
        for c in challengers:
            runs = [r for stage, r in found if stage == 3 and r.contender == c and r.seed == seed and at_winner(r)]
            shorter[c].append(sorted(runs, key=lambda r: r.val_loss[-1][0]))
    return analyse_part(args, stage1, stage2, shorter, reference)


def analyse_horizons(
    stage2: dict[str, list[RunRecord]],
    shorter: list[list[RunRecord]],
    steps: int,
    target_wall_ratio: float,
    reference: str = "adamw",
    contender: str = "muon",
) -> dict[str, Any]:
    """Per seed, ``contender``'s steps and training seconds to ``reference``'s final validation loss
    with a schedule that ends there (proto.horizon_ratios over its ``shorter`` runs of that seed
    and the full one)."""
    if not any(shorter):
        return {}
    reach = []
    for base, full, runs_of_seed in zip(stage2[reference], stage2[contender], shorter):
        runs = [(r.val_loss[-1][0], r.final_val, r.train_seconds) for r in (full, *runs_of_seed)]
        reach.append(
            {
                **proto.horizon_ratios(runs, base.final_val, steps, base.train_seconds),
                "runs": runs,
                "shortest": min(h for h, _, _ in runs),
            }
        )
    wall = proto.mean_or_none(x["wall_ratio"] for x in reach)
    return {
        "horizon_steps": sorted({r.val_loss[-1][0] for runs in shorter for r in runs}),
        "reach": reach,
        "mean_wall_ratio": wall,
        "mean_step_ratio": proto.mean_or_none(x["step_ratio"] for x in reach),
        "wall_ok": wall is not None and wall <= target_wall_ratio,
    }


def analyse_convergence(
    runs: dict[str, list[RunRecord]], steps: int, target_wall_ratio: float, reference: str = "adamw"
) -> dict[str, Any]:
    """Per contender: final val loss over seeds, and per seed the steps / seconds to the tuned
    ``reference``'s final val loss."""
    adamw = runs[reference]
    out: dict[str, Any] = {"seeds": [r.seed for r in adamw], "contenders": {}}
    for name, recs in runs.items():
        reach = [
            proto.ratios_against(r.val_loss, r.clock, a.final_val, steps, a.train_seconds) for r, a in zip(recs, adamw)
        ]
        out["contenders"][name] = {
            "final_val_loss": [r.final_val for r in recs],
            "final_val": proto.spread([r.final_val for r in recs]),
            "reach": reach,
            "mean_wall_ratio": proto.mean_or_none(x["wall_ratio"] for x in reach),
            "mean_step_ratio": proto.mean_or_none(x["step_ratio"] for x in reach),
            "train_seconds": [r.train_seconds for r in recs],
            "tokens_per_s": proto.spread([r.tokens_per_s for r in recs]),
            "peak_attn_max_logit": max(r.peak_logit for r in recs),
            "heads_clipped_reported": sum(v for r in recs for _, v in r.heads_clipped),
        }
    c = out["contenders"]
    muon_ratio = c["muon"]["mean_wall_ratio"]
    clip = c.get("muonclip", {"final_val_loss": []})  # --contenders may leave it out
    clip_diff = [proto.rel_diff(a, b) for a, b in zip(clip["final_val_loss"], c["muon"]["final_val_loss"])]
    out["muonclip_vs_muon"] = clip_diff
    out["wall_ok"] = muon_ratio is not None and muon_ratio <= target_wall_ratio
    out["muonclip_loss_ok"] = all(d <= LOSS_TOLERANCE for d in clip_diff) if clip_diff else None
    return out


def report_convergence(part: dict[str, Any], cfg_name: str, cfg: Config, steps: int) -> None:
    a = part["analysis"]
    print(f"\nConvergence ({cfg_name}: {cfg.model}, {steps} steps), stage 1 final val loss on seed {a['seeds'][0]}:")
    for contender, finals in a["stage1_final_val"].items():
        print(f"  {contender:<17}" + "  ".join(f"{k} {v:.4f}" for k, v in finals.items()))
    print("winners: " + ", ".join(proto.Setting(**w).label for w in a["winners"].values()))
    print(f"\nStage 2, seeds {a['seeds']} (interleaved); ratios against tuned AdamW's final val loss, per seed")
    print(
        f"{'contender':<17}{'val mean':>9}{'std':>8}{'min-max':>16}{'wall ratio':>12}{'step ratio':>12}"
        f"{'per-seed wall':>22}{'tok/s':>8}"
    )
    for name, c in a["contenders"].items():
        v, per_seed = c["final_val"], " ".join(fmt(x["wall_ratio"], ".2f") for x in c["reach"])
        print(
            f"{name:<17}{v['mean']:>9.4f}{v['std']:>8.4f}{v['min']:>8.4f}-{v['max']:.4f}"
            f"{fmt(c['mean_wall_ratio']):>12}{fmt(c['mean_step_ratio']):>12}{per_seed:>22}"
            f"{c['tokens_per_s']['mean']:>8.0f}"
        )
    print(f"Muon inside its full run, wall-clock ratio <= {cfg.target_wall_ratio}: {a['wall_ok']}")
    if "muonclip" in a["contenders"]:
        diffs = " ".join(f"{100 * d:+.2f}%" for d in a["muonclip_vs_muon"])
        peak = a["contenders"]["muonclip"]["peak_attn_max_logit"]
        print(
            f"MuonClip vs Muon final val {diffs} (within {100 * LOSS_TOLERANCE:g}%: {a['muonclip_loss_ok']}); "
            f"MuonClip peak max logit {peak:.1f} at eval points (tau {CONVERGENCE_TAU:g})"
        )
    if h := a["horizons"].get("muon"):
        print(
            f"\nStage 3: Muon's winner scheduled to end at {h['horizon_steps']} steps (and the full run); the "
            f"shortest length that reaches tuned AdamW's final val loss, interpolated between lengths"
        )
        for seed, r in zip(a["seeds"], h["reach"]):
            finals = "  ".join(f"{s}: {v:.4f} in {t:.1f} s" for s, v, t in sorted(r["runs"]))
            bound = " (the shortest run: an upper bound)" if r["steps"] == r["shortest"] else ""
            print(
                f"  seed {seed}: target {r['target']:.4f}; steps {fmt(r['steps'], '.0f')}{bound}, wall ratio "
                f"{fmt(r['wall_ratio'])}, step ratio {fmt(r['step_ratio'])}  [{finals}]"
            )
        print(
            f"Muon, a schedule that ends at the target (the target's measure): wall-clock ratio "
            f"{fmt(h['mean_wall_ratio'])}, step ratio {fmt(h['mean_step_ratio'])} (<= {cfg.target_wall_ratio}: "
            f"{h['wall_ok']})"
        )
        report_variants_against_adamw(a)


def report_variants_against_adamw(a: dict[str, Any]) -> None:
    """Part 1 with family variants: each one's scheduled steps and seconds to tuned AdamW's final
    loss, and per seed over Muon's."""
    muon = a["horizons"]["muon"]["reach"]
    variants = [c for c in a["horizons"] if c != "muon"]
    if not variants:
        return
    print(
        "\nThe Muon family, scheduled to end at tuned AdamW's final val loss: step ratio, wall ratio; / Muon's per seed"
    )
    for name in variants:
        h = a["horizons"][name]
        steps = [
            None if v["steps"] is None or m["steps"] is None else v["steps"] / m["steps"]
            for v, m in zip(h["reach"], muon)
        ]
        print(
            f"  {name:<17} step ratio {fmt(h['mean_step_ratio'])}  wall ratio {fmt(h['mean_wall_ratio'])}  "
            f"steps / Muon's: {' '.join(fmt(x) for x in steps)} (mean {fmt(proto.mean_or_none(steps))})"
        )


def report_family(a: dict[str, Any], args: argparse.Namespace) -> None:
    """Part 3's table: each variant against tuned Muon, per seed and in the mean."""
    print(f"\nThe Muon family ({args.config}, {args.steps} steps), stage 1 final val loss on seed {a['seeds'][0]}:")
    for contender, finals in a["stage1_final_val"].items():
        print(f"  {contender:<17}" + "  ".join(f"{k} {v:.4f}" for k, v in finals.items()))
    horizons = sorted({h for v in a["horizons"].values() for h in v.get("horizon_steps", [])})
    print(
        f"\nSeeds {a['seeds']}; ratios against tuned Muon's final val loss of the same seed: inside the full run, "
        f"and scheduled to end there (stage 3, horizons {horizons})"
    )
    print(
        f"{'variant':<18}{'lr':>7}{'val mean':>10}{'std':>8}{'vs Muon':>9}{'in-run steps':>14}"
        f"{'scheduled steps':>17}{'per seed':>20}{'wall':>7}{'tok/s':>8}"
    )
    muon = a["contenders"]["muon"]["final_val"]["mean"]
    for name, c in a["contenders"].items():
        h = a["horizons"].get(name, {})
        per_seed = " ".join(fmt(x["step_ratio"], ".2f") for x in h.get("reach", []))
        v = c["final_val"]
        print(
            f"{name:<18}{a['winners'][name]['lr']:>7g}{v['mean']:>10.4f}{v['std']:>8.4f}"
            f"{100 * (v['mean'] / muon - 1):>+8.2f}%{fmt(c['mean_step_ratio']):>14}"
            f"{fmt(h.get('mean_step_ratio')):>17}{per_seed:>20}{fmt(h.get('mean_wall_ratio')):>7}"
            f"{c['tokens_per_s']['mean']:>8.0f}"
        )
    print("(wall: training seconds to Muon's final loss / Muon's for its run; comparable only with --jobs 1)")


# -- part 2 --------------------------------------------------------------------------------------
def run_logits(args: argparse.Namespace, data: TokenData) -> dict[str, Any]:
    """Plain Muon, MuonClip and its re-measured variants (``--clips``) at the same lr on every
    seed, telemetry every step; every clip replays the ideal clip."""
    runs: dict[str, list[RunRecord]] = {"muon": [], **{name: [] for name in args.clips}}
    for seed in args.seeds:
        for name in runs:
            opt = optimizer_section(name, LOGIT_MUON_LR, LOGIT_ADAMW_LR, args.logit_tau)
            spec = make_spec(LOGIT_MODEL, opt, args.logit_steps, seed, args.eval_every)
            replay = args.logit_tau if name in CLIPS else None
            rec = train(name, LOGIT_MUON_LR, spec, data, args.eval_batches, replay, spread_tau=args.logit_tau)
            runs[name].append(rec)
            print(
                f"  [logits] seed {seed} {name:<9} final val {rec.final_val:.4f}  peak logit {rec.peak_logit:7.2f}"
                f"  {rec.wall_s:5.1f} s",
                flush=True,
            )
    return {"analysis": analyse_logits(runs, args.logit_tau), "runs": records_json(runs)}


def first_clip_step(record: RunRecord, tau: float) -> int | None:
    """The step whose forward triggered MuonClip's first clip (a head's max logit above tau)."""
    for step, n in record.heads_clipped:
        if n > 0:
            return step
    return next((step for step, v in record.attn_max_logit if v > tau), None)


def hold_series(clip: RunRecord, tau: float) -> tuple[int | None, list[float], list[float]]:
    """A clipping run's first clip step, and from it on its max logit / tau at each step with
    the ideal clip's reading replayed on the same weights and batches."""
    first = first_clip_step(clip, tau)
    heads, nxt = clip.replay["heads"], clip.replay["next_heads"]
    # Pair i (i >= first clip): the ideal reading of batch i + 1 against the actual one (step i + 1's forward).
    pairs = range(first, len(heads) - 1) if first is not None else range(0)
    actual = [max(heads[i + 1]) / tau for i in pairs]
    ideal = [proto.ideal_clip(heads[i], nxt[i], tau) for i in pairs]
    return first, actual, ideal


def clip_hold(clip: RunRecord, tau: float) -> tuple[int | None, dict[str, Any]]:
    """A clipping run's first clip step and its per-step hold against the ideal clip."""
    first, actual, ideal = hold_series(clip, tau)
    return first, proto.hold_stats(actual, ideal, HOLD_MEDIAN, HOLD_P95_FACTOR)


def analyse_logits(runs: dict[str, list[RunRecord]], tau: float) -> dict[str, Any]:
    """Per seed: plain Muon's peak; for MuonClip and each re-measured variant that ran, the
    per-step hold against the ideal clip and the final val loss against plain Muon's."""
    rows = []
    for i, muon in enumerate(runs["muon"]):
        clip = runs["muonclip"][i]
        first, hold = clip_hold(clip, tau)
        rel = proto.rel_diff(clip.final_val, muon.final_val)
        row = {
            "seed": muon.seed,
            "muon_peak_over_tau": muon.peak_logit / tau,
            "muon_steps_over_3tau": sum(v > GROWTH_FACTOR * tau for _, v in muon.attn_max_logit),
            "first_clip_step": first,
            "hold": hold,
            "muon_final_val": muon.final_val,
            "muonclip_final_val": clip.final_val,
            "val_rel_diff": rel,
            "muonclip_spread": clip.spread,
            "growth_ok": muon.peak_logit > GROWTH_FACTOR * tau,
            "loss_ok": rel <= LOSS_TOLERANCE,
        }
        row["variants"] = {}
        for name in (n for n in REMEASURE_BATCHES if runs.get(n)):
            again = runs[name][i]
            rel_again = proto.rel_diff(again.final_val, muon.final_val)
            first_again, hold_again = clip_hold(again, tau)
            row["variants"][name] = {
                "first_clip_step": first_again,
                "hold": hold_again,
                "final_val": again.final_val,
                "val_rel_diff": rel_again,
                "loss_ok": rel_again <= LOSS_TOLERANCE,
                "val_rel_diff_vs_muonclip": proto.rel_diff(again.final_val, clip.final_val),
            }
        rows.append(row)
    medians = [r["hold"].get("median") for r in rows]

    def met(hold_of) -> bool:
        return all(
            r["growth_ok"]
            and hold_of(r)["loss_ok"]
            and hold_of(r)["hold"]["median_ok"]
            and hold_of(r)["hold"]["p95_ok"]
            for r in rows
        )

    out = {"tau": tau, "per_seed": rows, "mean_of_medians": proto.mean_or_none(medians), "all_ok": met(lambda r: r)}
    variants = rows[0]["variants"] if rows else {}
    out["variants_all_ok"] = {name: met(lambda r, n=name: r["variants"][n]) for name in variants}
    return out


def report_logits(a: dict[str, Any], steps: int) -> None:
    tau, rows = a["tau"], a["per_seed"]
    print(f"\nLogit growth: {LOGIT_MODEL}, {steps} steps, constant lr, muon lr {LOGIT_MUON_LR:g}, tau {tau:g}")
    print(f"{'seed':>4}{'muon peak/tau':>14}{'muon val':>10}{'clip val':>10}{'clip-muon':>11}{'1st clip':>9}")
    for r in rows:
        print(
            f"{r['seed']:>4}{r['muon_peak_over_tau']:>14.2f}{r['muon_final_val']:>10.4f}{r['muonclip_final_val']:>10.4f}"
            f"{100 * r['val_rel_diff']:>+10.2f}%{fmt(r['first_clip_step'], 'd'):>9}"
        )
    print(
        f"MuonClip max logit / tau per step after its first clip, against the ideal clip on the same weights and "
        f"batches (targets: median <= {HOLD_MEDIAN}, p95 <= {HOLD_P95_FACTOR} x ideal p95)"
    )
    print(
        f"{'seed':>4}{'steps':>6}{'median':>8}{'p95':>7}{'max':>7}{'ideal med':>10}{'ideal p95':>10}"
        f"{'p95/ideal':>10}  median/p95 ok"
    )
    variants = list(rows[0]["variants"]) if rows else []
    for label, hold_of in (("muonclip", lambda r: r), *((n, lambda r, n=n: r["variants"][n]) for n in variants)):
        print(label)
        for r in rows:
            h = hold_of(r)["hold"]
            print(
                f"{r['seed']:>4}{h['steps']:>6}{fmt(h.get('median')):>8}{fmt(h.get('p95')):>7}{fmt(h.get('max')):>7}"
                f"{fmt(h.get('ideal_median')):>10}{fmt(h.get('ideal_p95')):>10}{fmt(h.get('p95_over_ideal_p95')):>10}"
                f"  {'y' if h['median_ok'] else 'n'}/{'y' if h['p95_ok'] else 'n'}"
            )
    for r in rows:
        for name, again in r["variants"].items():
            print(
                f"{r['seed']:>4} {name} final val {again['final_val']:.4f}: "
                f"{100 * again['val_rel_diff']:+.2f}% against Muon, {100 * again['val_rel_diff_vs_muonclip']:+.2f}% "
                "against MuonClip"
            )
    print("final weights on unseen batches: max logit spread (max / mean) and the ideal clip's worst reading / tau")
    for r in rows:
        for s in (r["muonclip_spread"] or {}).values():
            print(
                f"{r['seed']:>4} batch {s['batch_size']:>5}: max/mean {s['max'] / s['mean']:.3f}, "
                f"ideal max {s['ideal_max']:.3f}, share > 1.05 {s['ideal_over_1.05']:.2f}"
            )
    others = ", ".join(f"{name}: {ok}" for name, ok in a["variants_all_ok"].items())
    print(f"all targets met: {a['all_ok']}" + (f" ({others})" if others else ""))


# -- output --------------------------------------------------------------------------------------
def records_json(runs: dict[str, list[RunRecord]]) -> dict[str, list[dict]]:
    return {name: [asdict(r) for r in recs] for name, recs in runs.items()}


def runs_from_json(data: dict[str, list[dict]]) -> dict[str, list[RunRecord]]:
    def points(values: list) -> list[tuple[int, float]]:
        return [(int(s), float(v)) for s, v in values]

    series = ("val_loss", "clock", "attn_max_logit", "heads_clipped")
    return {
        name: [RunRecord(**{**r, **{k: points(r[k]) for k in series}}) for r in recs] for name, recs in data.items()
    }


def plot_convergence(runs: dict[str, list[RunRecord]], analysis: dict[str, Any], path: Path) -> None:
    """Mean validation loss over seeds against steps (left) and training seconds (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), sharey=True)
    for name, recs in runs.items():
        steps = [s for s, _ in recs[0].val_loss]
        val = [sum(r.val_loss[i][1] for r in recs) / len(recs) for i in range(len(steps))]
        secs = [sum(r.clock[i][1] for r in recs) / len(recs) for i in range(len(steps))]
        w = proto.Setting(**analysis["winners"][name])
        for ax, x in zip(axes, (steps, secs)):
            ax.plot(x, val, "--" if name == "adamw" else "-", lw=1.8, label=w.label)
    target = analysis["contenders"]["adamw"]["final_val"]["mean"]
    for ax, xlabel in zip(axes, ("step", "training seconds (evaluation excluded)")):
        ax.axhline(target, color="grey", lw=0.8, ls=":", label=f"tuned AdamW final ({target:.3f})")
        ax.set(xlabel=xlabel, ylim=(target - 0.25, target + 0.8))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    c = analysis["contenders"]["muon"]
    wall, step = fmt(c["mean_wall_ratio"], ".2f"), fmt(c["mean_step_ratio"], ".2f")
    title = f"{len(analysis['seeds'])} seeds (mean); Muon wall-clock ratio {wall}, step ratio {step}"
    axes[0].set(ylabel="validation loss (nats/char)", title=title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_family(runs: dict[str, list[RunRecord]], analysis: dict[str, Any], path: Path) -> None:
    """Part 3: the mean validation loss over seeds against steps, second half of the run (left),
    and each variant's steps to Muon's final loss on a schedule that ends there, / Muon's, per
    seed and their mean (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (curves, bars) = plt.subplots(1, 2, figsize=(12, 4.8), gridspec_kw={"width_ratios": [3, 2]})
    target = analysis["contenders"]["muon"]["final_val"]["mean"]
    for name, recs in runs.items():
        steps = [s for s, _ in recs[0].val_loss]
        val = [sum(r.val_loss[i][1] for r in recs) / len(recs) for i in range(len(steps))]
        half = len(steps) // 2
        w = proto.Setting(**analysis["winners"][name])
        curves.plot(steps[half:], val[half:], "--" if name == "muon" else "-", lw=1.8, label=w.label)
    curves.axhline(target, color="grey", lw=0.8, ls=":", label=f"tuned Muon final ({target:.3f})")
    curves.set(xlabel="step", ylabel="validation loss (nats/char)", title=f"{len(analysis['seeds'])} seeds (mean)")
    curves.grid(alpha=0.3)
    curves.legend(fontsize=8)
    names = list(analysis["horizons"])
    for i, name in enumerate(names):
        h = analysis["horizons"][name]
        seeds = [x["step_ratio"] for x in h["reach"] if x["step_ratio"] is not None]
        bars.scatter([i] * len(seeds), seeds, color="black", s=12, zorder=3)
        if h["mean_step_ratio"] is not None:
            bars.bar(i, h["mean_step_ratio"], color="tab:blue", alpha=0.6)
            bars.text(i, h["mean_step_ratio"] + 0.005, f"{h['mean_step_ratio']:.3f}", ha="center", fontsize=8)
        missed = len(h["reach"]) - len(seeds)
        if missed:
            bars.text(i, 0.72, f"{missed} seed(s)\nnever reached", ha="center", fontsize=7)
    bars.axhline(1.0, color="grey", lw=0.8, ls=":")
    bars.axhline(0.9, color="tab:red", lw=0.8, ls="--", label="goal: 0.9")
    bars.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=8)
    bars.set(ylim=(0.7, 1.1), ylabel="steps to Muon's final loss / Muon's", title="scheduled to end there")
    bars.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_logits(runs: dict[str, list[RunRecord]], tau: float, path: Path) -> None:
    """Left: attn_max_logit per step of plain Muon and MuonClip (log scale). Right: for every
    clip that ran, its max logit / tau at the steps after its first clip (every seed pooled),
    sorted, against the ideal clip's readings on its own weights and batches: the value at 0.5 is
    the median, at 0.95 the p95."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, zoom) = plt.subplots(1, 2, figsize=(12, 4.8))
    for color, name in (("tab:red", "muon"), ("tab:blue", "muonclip")):
        for i, rec in enumerate(runs[name]):
            steps, values = zip(*rec.attn_max_logit)
            ax.plot(steps, values, ["-", "--", ":"][i % 3], color=color, lw=1.2, label=f"{name} seed {rec.seed}")
    for color, name in zip(("tab:blue", "tab:green", "tab:purple"), (n for n in CLIPS if runs.get(n))):
        actual, ideal = [], []
        for rec in runs[name]:
            _, a, i = hold_series(rec, tau)
            actual += a
            ideal += i
        for values, style, label in ((actual, "-", name), (ideal, "--", f"ideal clip on {name}'s weights")):
            quantiles = [(k + 0.5) / len(values) for k in range(len(values))]
            zoom.plot(quantiles, sorted(values), style, color=color, lw=1.2 if style == "-" else 0.9, label=label)
    ax.axhline(tau, color="black", lw=0.8, label=f"tau = {tau:g}")
    ax.axhline(GROWTH_FACTOR * tau, color="grey", lw=0.8, ls="--", label=f"{GROWTH_FACTOR:g} x tau")
    ax.set_yscale("log")
    ax.set(
        xlabel="step",
        ylabel="attn_max_logit (before the step's clip)",
        title=f"Muon lr {LOGIT_MUON_LR:g}: plain vs MuonClip tau {tau:g}",
    )
    zoom.axhline(HOLD_MEDIAN, color="black", lw=0.8, ls=":", label=f"{HOLD_MEDIAN:g} x tau")
    for q in (0.5, 0.95):
        zoom.axvline(q, color="grey", lw=0.6)
    zoom.set(
        xlabel="quantile of the steps after the first clip (seeds pooled)",
        ylabel="max logit / tau",
        ylim=(0.85, 1.35),
        title="Each clip against the ideal clip on its weights",
    )
    for a in (ax, zoom):
        a.grid(alpha=0.3)
        a.legend(fontsize=8, ncol=2 if a is ax else 1)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def replot(path: Path, img_dir: Path) -> None:
    """Redraw the plots from a ``--json`` output without training."""
    out = json.loads(path.read_text())
    if "convergence" in out:
        part, name = out["convergence"], out["settings"]["config"]
        png = "convergence.png" if name == "small" else f"convergence_{name}.png"
        plot_convergence(runs_from_json(part["runs"]), part["analysis"], img_dir / png)
    if "family" in out:
        part = out["family"]
        plot_family(runs_from_json(part["runs"]), part["analysis"], img_dir / f"family_{out['settings']['config']}.png")
    if "logit_growth" in out:
        part = out["logit_growth"]
        plot_logits(runs_from_json(part["runs"]), part["analysis"]["tau"], img_dir / "logit_growth.png")


def print_plan(args: argparse.Namespace, cfg: Config) -> None:
    """The runs the arguments ask for and an estimated duration at 1 thread; trains nothing."""
    total = 0.0
    if args.part in ("all", "convergence", "family"):
        grids = contender_grids(args)
        horizons = proto.horizon_steps(args.horizons, args.steps, args.eval_every)
        runs = proto.plan_runs(grids, args.schedules, args.seeds, args.steps, horizons, part_roles(args)[1])
        for stage in (1, 2, 3):
            some = [r for r in runs if r.stage == stage]
            est = proto.estimate_seconds(some, cfg.seconds_per_step, overhead_s=1.0)
            total += est
            print(f"stage {stage}: {len(some)} runs, about {est / 60:.0f} min")
            for r in some:
                what = f"lr={r.lr:g} {r.schedule}" if r.stage == 1 else "stage-1 winner"
                print(f"    seed {r.seed} {r.contender:<9} {what}, {r.steps} steps")
    if args.part in ("all", "logits"):
        contenders = ["muon", *args.clips]
        est = len(args.seeds) * args.logit_steps * sum(LOGIT_SECONDS_PER_STEP[c] for c in contenders)
        total += est
        runs = len(contenders) * len(args.seeds)
        print(f"logit growth: {runs} runs of {args.logit_steps} steps, about {est / 60:.0f} min")
    print(
        f"total about {total / 60:.0f} min ({total / 3600:.1f} h) at 1 thread on the 2-core CPU machine "
        f"while shared; about {IDLE_FACTOR * total / 60:.0f} min ({IDLE_FACTOR * total / 3600:.1f} h) on it idle"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", choices=sorted(CONFIGS), default="small", help="part 1's model (default small)")
    parser.add_argument(
        "--part",
        choices=("all", "convergence", "logits", "family"),
        default="all",
        help="all: parts 1 and 2; family: part 3 (the Muon family against Muon)",
    )
    parser.add_argument(
        "--family",
        nargs="+",
        choices=list(FAMILY),
        default=list(FAMILY),
        help="part 3's variants (default all); Muon is always run, their reference",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="part 1 and 3 runs at a time, each in a process of its own (default 1; step counts alike, "
        "training seconds only comparable at 1)",
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS), help="the first one tunes (default 0 1 2)")
    parser.add_argument("--steps", type=int, default=None, help="part 1 steps (default: the config's)")
    parser.add_argument("--logit-steps", type=int, default=LOGIT_STEPS, help=f"part 2 steps (default {LOGIT_STEPS})")
    parser.add_argument("--logit-tau", type=float, default=LOGIT_TAU, help=f"part 2 tau (default {LOGIT_TAU:g})")
    parser.add_argument("--eval-every", type=int, default=None, help="default: the config's")
    parser.add_argument("--eval-batches", type=int, default=EVAL_BATCHES, help=f"default {EVAL_BATCHES}")
    parser.add_argument("--adamw-lrs", type=float, nargs="+", default=list(ADAMW_LRS), help="AdamW's grid")
    parser.add_argument("--muon-lrs", type=float, nargs="+", default=list(MUON_LRS), help="Muon's and MuonClip's grid")
    parser.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=list(SCHEDULES))
    parser.add_argument(
        "--horizons",
        type=float,
        nargs="*",
        default=None,
        help=f"stage 3: the challengers' winners over these fractions of the steps, each with its own "
        f"schedule (default {list(HORIZONS)}, part 3 {list(FAMILY_HORIZONS)}; none: no stage 3)",
    )
    parser.add_argument(
        "--contenders",
        nargs="+",
        choices=[*CONTENDERS, *FAMILY],
        default=list(CONTENDERS),
        help="part 1's contenders (default adamw muon muonclip; AdamW and Muon are always run; a Muon "
        "family variant also gets stage 3, against AdamW's final loss as Muon)",
    )
    parser.add_argument(
        "--clips",
        nargs="*",
        choices=list(REMEASURE_BATCHES),
        default=list(REMEASURE_BATCHES),
        help="the re-measured MuonClip variants part 2 runs beside MuonClip (default: all)",
    )
    parser.add_argument("--plan", action="store_true", help="print the runs and an estimated time; train nothing")
    parser.add_argument("--quick", action="store_true", help="60 steps, 2 seeds, one lr per contender, no plots")
    parser.add_argument(
        "--img-dir",
        type=Path,
        default=None,
        help="where the PNGs go (default docs/img; a --quick run writes none unless given)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where every run trains (default cpu; cuda: the engine's defaults there, bf16 autocast)",
    )
    parser.add_argument("--no-plots", action="store_true", help="write no PNG (--replot draws them from --json)")
    parser.add_argument("--data", metavar="FILE", type=Path, help="a UTF-8 corpus instead of the builtin pysource text")
    parser.add_argument("--json", metavar="PATH", help="also write every figure and curve as JSON to PATH")
    parser.add_argument("--progress", metavar="PATH", help="append every part-1 run's record to PATH as it ends")
    parser.add_argument("--replot", metavar="PATH", type=Path, help="only redraw the plots from a --json output")
    parser.add_argument(
        "--from-progress",
        metavar="PATH",
        type=Path,
        nargs="+",
        help="part 1 or 3 from the --progress records of earlier runs (cut short, or split over invocations "
        "or machines; --seeds, --steps, --config, --family as they ran): the tables, plot and --json; trains nothing",
    )
    args = parser.parse_args()
    args.clips = ["muonclip", *args.clips]
    args.contenders = [c for c in (*CONTENDERS, *FAMILY) if c in {"adamw", "muon", *args.contenders}]
    if args.horizons is None:
        args.horizons = list(FAMILY_HORIZONS if args.part == "family" else HORIZONS)
    if args.part == "family":
        args.contenders = ["muon", *args.family]
    cfg = CONFIGS[args.config]
    args.target_wall_ratio = cfg.target_wall_ratio
    args.steps = args.steps or cfg.steps
    args.eval_every = args.eval_every or cfg.eval_every
    if args.quick:
        cfg = CONFIGS[args.config] = replace(cfg, model=CONFIGS["small"].model)
        args.steps = args.logit_steps = QUICK["steps"]
        args.eval_every, args.eval_batches = QUICK["eval_every"], QUICK["eval_batches"]
        args.seeds, args.adamw_lrs, args.muon_lrs = list(QUICK["seeds"]), QUICK["adamw_lrs"], QUICK["muon_lrs"]
        args.horizons = QUICK["horizons"]
        SPREAD.update(QUICK["spread"])
        args.logit_tau = QUICK["logit_tau"]
    if args.replot:
        replot(args.replot, args.img_dir if args.img_dir is not None else IMG_DIR)
        return
    if args.plan:
        print_plan(args, cfg)
        return
    if args.from_progress:
        report_progress(args, cfg)
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.data:
        DATA.update(path=str(args.data.resolve()), builtin=None)
    DEVICE["type"] = args.device
    img_dir = args.img_dir if args.img_dir is not None else (None if args.quick else IMG_DIR)
    img_dir = None if args.no_plots else img_dir
    with tempfile.TemporaryDirectory() as cache:  # the tokenized corpus, memory-mapped while training
        out = run(args, cfg, img_dir, Path(cache))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


def report_progress(args: argparse.Namespace, cfg: Config) -> None:
    """``--from-progress``: part 1 or 3 re-analysed from run records; its tables, plot and JSON."""
    family = args.part == "family"
    part = from_progress(args, args.from_progress, *part_roles(args))
    if family:
        report_family(part["analysis"], args)
    else:
        report_convergence(part, args.config, cfg, args.steps)
    if not args.no_plots:
        runs, img_dir = runs_from_json(part["runs"]), args.img_dir or IMG_DIR
        if family:
            plot_family(runs, part["analysis"], img_dir / f"family_{args.config}.png")
        else:
            png = "convergence.png" if args.config == "small" else f"convergence_{args.config}.png"
            plot_convergence(runs, part["analysis"], img_dir / png)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "settings": vars(args) | {"from_progress": [str(p) for p in args.from_progress]},
                    "family" if family else "convergence": part,
                },
                indent=1,
                default=str,
            )
        )


def run(args: argparse.Namespace, cfg: Config, img_dir: Path | None, cache: Path) -> dict[str, Any]:
    """Both parts as chosen by ``args``; prints the tables, writes the plots, returns every figure."""
    device = torch.device(args.device)
    ns_dtype = str(optim.auto_dtype(device)).removeprefix("torch.")  # cached: what every run gets
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{torch.get_num_threads()} threads"
    print(f"torch {torch.__version__}, {where}, Newton–Schulz auto dtype {ns_dtype}; data {DATA}; config {args.config}")
    out: dict[str, Any] = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
    out["settings"].update(threads=torch.get_num_threads(), model=cfg.model, ns_auto_dtype=ns_dtype, where=where)
    start = time.perf_counter()
    data = load_data(job_config(make_spec(cfg.model, {"name": "adamw"}, 1, 0, 1)).data, 0, cache)
    print(f"vocab {data.vocab_size}, train {len(data.train):,} chars, val {len(data.val):,} chars")
    setup = Setup(cfg.model, args.eval_every, args.eval_batches, args.progress, dict(DATA), args.device, args.threads)
    runner = Runner(setup, data, cache, args.jobs)
    if args.part in ("all", "convergence"):
        t0 = time.perf_counter()
        out["convergence"] = part = run_convergence(args, runner, *part_roles(args))
        part["analysis"]["runtime_s"] = time.perf_counter() - t0
        report_convergence(part, args.config, cfg, args.steps)
        print(f"part 1 took {part['analysis']['runtime_s'] / 60:.1f} min")
        if img_dir is not None:
            png = "convergence.png" if args.config == "small" else f"convergence_{args.config}.png"
            plot_convergence(runs_from_json(part["runs"]), part["analysis"], img_dir / png)
    if args.part == "family":
        t0 = time.perf_counter()
        out["family"] = part = run_convergence(args, runner, *part_roles(args))
        part["analysis"]["runtime_s"] = time.perf_counter() - t0
        report_family(part["analysis"], args)
        print(f"part 3 took {part['analysis']['runtime_s'] / 60:.1f} min")
        if img_dir is not None:
            plot_family(runs_from_json(part["runs"]), part["analysis"], img_dir / f"family_{args.config}.png")
    runner.close()
    if args.part in ("all", "logits"):
        t0 = time.perf_counter()
        out["logit_growth"] = part = run_logits(args, data)
        part["analysis"]["runtime_s"] = time.perf_counter() - t0
        report_logits(part["analysis"], args.logit_steps)
        print(f"part 2 took {part['analysis']['runtime_s'] / 60:.1f} min")
        if img_dir is not None:
            plot_logits(runs_from_json(part["runs"]), args.logit_tau, img_dir / "logit_growth.png")
    out["runtime_s"] = time.perf_counter() - start
    print(f"\ntotal {out['runtime_s'] / 60:.1f} min")
    return out


if __name__ == "__main__":
    main()
