"""A transformers llama (arch hf) against the engine's own gpt of the same shape: training tokens/s
with MuonClip and per-head telemetry every step, and what measuring each head's max logit costs.

    .venv/bin/python bench/hf.py [--rounds 3] [--steps 30] [--json PATH]

Both train on the builtin pysource text (byte tokens) in the engine's Trainer, one process, at
the threads torch has. The gpt: 4 layers, d_model 256, 4 heads, seq_len 256, batch 16 (its MLP
4 x d_model, two matrices); the llama: the same layers, width, heads and context with a SwiGLU
of intermediate size 8/3 x d_model (three matrices: the same parameters in the MLP), no
grouped-query attention, its head tied to the embedding as the gpt's is. Each contender runs
``--steps`` training steps after 3 warm-up steps; rounds alternate the order.

Contenders:
- gpt, MuonClip, telemetry every step (the engine's own model);
- llama, MuonClip, telemetry every step;
- llama, MuonClip, no telemetry: each head's maximum measured every step (the clip needs it);
- llama, Muon, no telemetry: no maximum measured at all, so the step time of the third over
  this one's, minus 1, is what measuring the maxima (and the clip) costs.
Targets: llama tokens/s >= 0.85 x gpt's; the measurement <= 10% of the step.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from contract.spec import JobSpec
from worker.engine.config import job_config
from worker.engine.data import load_data
from worker.engine.telemetry import JsonlSink
from worker.engine.trainer import Trainer

LAYERS, WIDTH, HEADS, CONTEXT, BATCH = 4, 256, 4, 256, 16
WARMUP = 3
GPT = {"arch": "gpt", "n_layer": LAYERS, "n_head": HEADS, "d_model": WIDTH, "seq_len": CONTEXT}
LLAMA = {
    "arch": "hf",
    "seq_len": CONTEXT,
    "hf": {
        "config": {
            "model_type": "llama",
            "hidden_size": WIDTH,
            "intermediate_size": 8 * WIDTH // 3 // 8 * 8,  # SwiGLU's 8/3 x width: the MLP's parameters of a 4x GELU
            "num_hidden_layers": LAYERS,
            "num_attention_heads": HEADS,
            "tie_word_embeddings": True,
        }
    },
}
CONTENDERS = {
    "gpt, muonclip, telemetry": (GPT, "muonclip", True),
    "llama, muonclip, telemetry": (LLAMA, "muonclip", True),
    "llama, muonclip, no telemetry": (LLAMA, "muonclip", False),
    "llama, muon, no maxima": (LLAMA, "muon", False),
}


def steps_per_second(model: dict[str, Any], optimizer: str, report: bool, steps: int, work: Path) -> float:
    """Training steps per second of a fresh model (after WARMUP steps)."""
    spec = JobSpec.model_validate(
        {
            "model": model,
            "data": {"builtin": "pysource", "tokenizer": "byte"},
            "optimizer": {"name": optimizer},
            "train": {"steps": steps + WARMUP, "batch_size": BATCH, "eval_every": 10_000, "checkpoint_every": 10_000},
            "telemetry": {"sample_tokens": 0},
        }
    )
    job = job_config(spec)
    data = load_data(spec.data, 0, work / "data")
    trainer = Trainer(job, data, None, JsonlSink(work / "metrics.jsonl"))
    for _ in range(WARMUP):
        trainer.train_step(report)
        trainer.step += 1
    start = time.perf_counter()
    for _ in range(steps):
        trainer.train_step(report)
        trainer.step += 1
    return steps / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    rates: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            order = list(CONTENDERS) if round_ % 2 == 0 else list(reversed(CONTENDERS))
            for name in order:
                model, optimizer, report = CONTENDERS[name]
                rates[name].append(steps_per_second(model, optimizer, report, args.steps, Path(tmp)))
    tokens = BATCH * CONTEXT
    print(f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads; {tokens} tokens a step")
    median = {name: statistics.median(r) * tokens for name, r in rates.items()}
    for name, r in rates.items():
        print(f"{name:<30} {median[name]:>10,.0f} tokens/s  (rounds: {', '.join(f'{x * tokens:,.0f}' for x in r)})")
    gpt, llama, clipped, bare = (median[name] for name in CONTENDERS)
    ratio = {"llama_over_gpt": llama / gpt, "measurement_share": bare / clipped - 1}
    print(f"llama / gpt tokens/s: {ratio['llama_over_gpt']:.3f} (target >= 0.85)")
    print(f"measuring the maxima and clipping: {100 * ratio['measurement_share']:.1f}% of the step (target <= 10%)")
    if args.json:
        Path(args.json).write_text(json.dumps({"tokens_per_s": median, "rounds": rates, **ratio}, indent=2))


if __name__ == "__main__":
    main()
