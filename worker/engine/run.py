"""Run one job from a validated JobSpec dict: the entry of `muonforge train` and of the worker task."""

from __future__ import annotations

import contextlib
import json
from functools import partial
from pathlib import Path

from .checkpoints import latest_checkpoint
from .config import job_config
from .data import load_data
from .distributed import Group
from .launch import run_group
from .request import RunRequest
from .telemetry import FanOut, JsonlSink
from .trainer import RunResult, Trainer


def checkpoint_dir(out_dir: Path) -> Path:
    """Where a run under ``out_dir`` keeps its checkpoints."""
    return out_dir / "checkpoints"


def run_job(request: RunRequest) -> RunResult | None:
    """Train ``request.spec`` in this process, or in a torch.distributed group it launches.

    A job of one process trains here; a job of more (``resources``) trains in a group that this
    process launches and follows (launch.run_group, which calls ``watch``: it raises to stop the
    group at once), on this process's ``node`` of a job of several (None: a node other than 0 is
    done). A warm start's ``init_from`` is loaded unless the run resumes from a checkpoint of its own.
    """
    if job_config(request.spec).resources.world_size > 1:
        if request.rungs is not None:
            raise ValueError("a sweep's rungs apply to trials of one process")
        return run_group(request)
    return run_process(request)


def run_process(request: RunRequest, group: Group | None = None) -> RunResult:
    """Train in this process: the whole job, or this rank's part of it in ``group``.

    Rank 0 alone writes the run's files; it tokenizes a corpus first, the others then read its cache.
    """
    job, out_dir = job_config(request.spec), request.out_dir
    lead = group is None or group.lead
    out_dir.mkdir(parents=True, exist_ok=True)
    checkpoints = checkpoint_dir(out_dir)
    # An uploaded model's weights start a fresh run; a resume or a warm start loads its checkpoint instead.
    resumes = request.resume and latest_checkpoint(checkpoints) is not None
    pretrained = request.model_dir if not resumes and request.init_from is None else None
    jsonl = JsonlSink(out_dir, append=request.resume and checkpoints.exists()) if lead else None
    try:
        sink = FanOut(jsonl, request.sink)
        say = partial(sink.log, "info") if lead else None
        with group.lead_first() if group else contextlib.nullcontext():
            tokens = request.tokens or out_dir / "data"
            data = load_data(job.data, job.train.seed, tokens, request.corpus, request.model_dir, say)
        trainer = Trainer(job, data, checkpoints, sink, request.should_cancel, group, request.rungs, pretrained)
        result = trainer.run(resume=request.resume, init_from=request.init_from)
    finally:
        if jsonl is not None:
            jsonl.close()
    if lead:
        (out_dir / "summary.json").write_text(json.dumps(result.as_dict(), indent=2) + "\n")
    return result
