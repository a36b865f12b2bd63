"""Run one job from a validated JobSpec dict: the entry of `muonforge train` and of the worker task."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .config import job_config
from .data import load_data
from .distributed import Group
from .early_stop import RungCheck
from .launch import Node, run_group
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
    watch: Callable[[], None] | None = None,
    node: Node | None = None,
) -> RunResult | None:
    """Train ``spec`` (a JobSpec's ``model_dump()``) with artifacts under ``out_dir``.

    The artifacts are ``metrics.jsonl``, ``samples.jsonl``, ``checkpoints/``, ``summary.json`` and
    the tokenized corpus cache. ``init_from``: the checkpoint file of the spec's ``init_from`` (a
    warm start, unless the run resumes from a checkpoint of its own). ``rungs``: a sweep's ASHA
    decider, asked at its steps (a trial of one process: sweeps with ASHA take no others). A job of
    one process trains here; a job of more (``resources``) trains in a torch.distributed group that
    this process launches and follows (launch.run_group, which calls ``watch`` every fraction of a
    second: it raises to stop the group at once), on this process's ``node`` of a job of several
    (None: a node other than 0 is done); every rank starts from ``init_from``'s file.
    """
    if job_config(spec).resources.world_size > 1:
        if rungs is not None:
            raise ValueError("a sweep's rungs apply to trials of one process")
        return run_group(spec, out_dir, corpus, sink, should_cancel, resume, watch, node, init_from=init_from)
    return run_process(spec, out_dir, corpus, sink, should_cancel, resume, init_from=init_from, rungs=rungs)


def run_process(
    spec: dict[str, Any],
    out_dir: Path,
    corpus: Path | None = None,
    sink: TelemetrySink | None = None,
    should_cancel: Callable[[], bool] | None = None,
    resume: bool = True,
    group: Group | None = None,
    init_from: Path | None = None,
    rungs: RungCheck | None = None,
) -> RunResult:
    """Train in this process: the whole job, or this rank's part of it in ``group`` (rank 0 alone
    writes the run's files; it tokenizes a corpus first, the others then read its cache)."""
    job = job_config(spec)
    lead = group is None or group.lead
    out_dir.mkdir(parents=True, exist_ok=True)
    with group.lead_first() if group else contextlib.nullcontext():
        data = load_data(job.data, job.train.seed, out_dir / "data", corpus)
    checkpoints = checkpoint_dir(out_dir)
    jsonl = JsonlSink(out_dir, append=resume and checkpoints.exists()) if lead else None
    try:
        trainer = Trainer(job, data, checkpoints, FanOut(jsonl, sink), should_cancel, group, rungs)
        result = trainer.run(resume=resume, init_from=init_from)
    finally:
        if jsonl is not None:
            jsonl.close()
    if lead:
        (out_dir / "summary.json").write_text(json.dumps(result.as_dict(), indent=2) + "\n")
    return result
