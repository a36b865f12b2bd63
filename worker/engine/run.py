"""Run one job from a validated JobSpec dict: the entry point of `muonforge train` and of the worker task."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .config import job_config_from_dict
from .data import load_data
from .early_stop import RungCheck
from .telemetry import FanOut, JsonlSink, TelemetrySink
from .trainer import RunResult, Trainer


def checkpoint_dir(out_dir: Path) -> Path:
    """Where a run under ``out_dir`` keeps its checkpoints."""
    return out_dir / "checkpoints"


def run_job(
    spec: dict[str, Any],
    out_dir: Path,
    corpus: Path | None = None,
    sink: TelemetrySink | None = None,
    should_cancel: Callable[[], bool] | None = None,
    resume: bool = True,
    init_from: Path | None = None,
    rungs: RungCheck | None = None,
) -> RunResult:
    """Train ``spec`` (a JobSpec's ``model_dump()``) with artifacts under ``out_dir``:
    ``metrics.jsonl``, ``samples.jsonl``, ``checkpoints/``, ``summary.json`` and the tokenized
    corpus cache. ``init_from``: the checkpoint file of the spec's ``init_from`` (a warm start,
    unless the run resumes from a checkpoint of its own). ``rungs``: a sweep's ASHA decider,
    asked at its steps."""
    job = job_config_from_dict(spec)
    out_dir.mkdir(parents=True, exist_ok=True)
    data = load_data(job.data, job.train.seed, out_dir / "data", corpus)
    checkpoints = checkpoint_dir(out_dir)
    jsonl = JsonlSink(out_dir, append=resume and checkpoints.exists())
    try:
        trainer = Trainer(job, data, checkpoints, FanOut(jsonl, sink), should_cancel, rungs)
        result = trainer.run(resume=resume, init_from=init_from)
    finally:
        jsonl.close()
    (out_dir / "summary.json").write_text(json.dumps(result.as_dict(), indent=2) + "\n")
    return result
