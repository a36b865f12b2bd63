"""Job specs the tests and the benchmarks submit: small enough to train in a second on one CPU thread."""

from __future__ import annotations

from typing import Any


def tiny_spec(steps: int = 20, **train: Any) -> dict:
    """A one-layer GPT on the builtin synthetic task, evaluated and checkpointed every 10 steps."""
    return {
        "name": "tiny",
        "model": {"arch": "gpt", "n_layer": 1, "n_head": 2, "d_model": 16, "seq_len": 16},
        "data": {"builtin": "synthetic"},
        "train": {"steps": steps, "batch_size": 4, "eval_every": 10, "checkpoint_every": 10, **train},
    }


def group_spec(steps: int, nnodes: int = 1, **train: Any) -> dict:
    """``tiny_spec`` run by two processes: both on one node, or one on each of two."""
    return tiny_spec(steps=steps, **train) | {"resources": {"nproc": 2 // nnodes, "nnodes": nnodes}}


def chaos_spec(steps: int, index: int) -> dict:
    """``tiny_spec`` for jobs under faults: about 1 s per 100 steps on one CPU thread, checkpoints
    and evals every steps / 4. max_restarts is the cap (10) so that a job that is interrupted often
    does not end worker_lost."""
    every = steps // 4
    spec = tiny_spec(steps, eval_every=every, checkpoint_every=every, max_restarts=10, seed=index)
    return spec | {"name": f"chaos-{index}"}
