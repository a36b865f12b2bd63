"""The memory cap's estimate (worker.engine.facts.peak_memory_bytes) against the peak resident
memory of real runs: above it, and within a factor of 2, for runs whose peak is dominated by
each term in turn (attention scores, parameters and optimizer state, routed experts). The
estimate's coefficients were fitted on a wider grid (docs/service.md, "Admission")."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from contract.spec import JobSpec
from worker.engine.facts import SYNTHETIC_VOCAB, peak_memory_bytes

pytestmark = pytest.mark.system  # its tests start processes: the service's, torchrun's or a command's

ROOT = Path(__file__).resolve().parents[2]
HF_SIZES = {"hidden_size": 256, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 16}
RUNS = {
    "attention scores": ({"arch": "gpt", "n_layer": 1, "n_head": 16, "d_model": 64, "seq_len": 1024}, 4),
    "parameters": ({"arch": "gpt", "n_layer": 2, "n_head": 4, "d_model": 1024, "seq_len": 32}, 8),
    "experts": (
        {"arch": "moe", "n_layer": 2, "n_head": 2, "d_model": 256, "n_experts": 4, "top_k": 4, "seq_len": 64},
        32,
    ),
    "transformers activations": (
        {"arch": "hf", "seq_len": 64, "hf": {"config": {"model_type": "llama", **HF_SIZES, "intermediate_size": 1024}}},
        64,
    ),
    "transformers attention, sliding window": (
        {
            "arch": "hf",
            "seq_len": 1024,
            "hf": {"config": {"model_type": "mistral", **HF_SIZES, "hidden_size": 64, "sliding_window": 64}},
        },
        8,
    ),
}


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="measures with Linux's /proc/self/clear_refs")
@pytest.mark.parametrize("term", RUNS)
def test_the_estimate_is_above_the_measured_peak_and_within_2x(term):
    model, batch_size = RUNS[term]
    train = {"steps": 3, "batch_size": batch_size, "eval_every": 2, "checkpoint_every": 2, "device": "cpu"}
    spec = JobSpec.model_validate(
        {"model": model, "data": {"builtin": "synthetic"}, "train": train, "telemetry": {"sample_tokens": 0}}
    )
    run = subprocess.run(
        [sys.executable, "-m", "tests.engine.peak_memory", json.dumps(spec.stored())],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    measured = json.loads(run.stdout.strip().splitlines()[-1])["peak_growth"]
    estimate = peak_memory_bytes(spec, SYNTHETIC_VOCAB)
    assert measured <= estimate <= 2 * measured, (term, measured / 2**20, estimate / 2**20)
