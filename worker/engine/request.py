"""What a run of a job is given: ``RunRequest``, the argument of run_job, run_process, run_group."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from contract.spec import JobSpec

from .early_stop import RungCheck
from .telemetry import TelemetrySink

if TYPE_CHECKING:
    from .data import Tokens
    from .launch import Node


@dataclass(frozen=True)
class RunRequest:
    """One run of a job: what to train, where its files go, and the hooks of whoever runs it.

    ``spec``: a JobSpec, or a dict that validates as one. ``out_dir`` holds ``metrics.jsonl``,
    ``samples.jsonl``, ``checkpoints/``, ``summary.json`` and, without ``tokens``, the
    tokenized corpus cache.
    """

    spec: JobSpec | dict[str, Any]
    out_dir: Path
    corpus: Path | None = None  # an uploaded dataset's file; None for a builtin corpus or ``data.path``
    sink: TelemetrySink | None = None
    should_cancel: Callable[[], bool] | None = None  # asked before every step (rank 0's, in a group)
    resume: bool = True  # from the latest checkpoint under out_dir, if there is one
    init_from: Path | None = None  # the checkpoint file of the spec's init_from (every rank loads it)
    rungs: RungCheck | None = None  # a sweep's ASHA decider (a trial of one process)
    watch: Callable[[], None] | None = None  # called every fraction of a second while a group runs
    node: Node | None = None  # this process's node of a job of several nodes
    model_dir: Path | None = None  # model.hf.model_id's directory: its weights and tokenizer.json
    tokens: Tokens | None = None  # the token cache (data.Tokens) jobs share (None: out_dir / "data")
