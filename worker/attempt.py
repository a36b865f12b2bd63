"""One worker attempt at a job: claim it, keep its lease, train with the engine, record the outcome.

This module is the adapter between the Celery task, the engine and the service: the job's
progress and summary stay current in the database while it trains, every status change is a use
case of app.services.lifecycle, in a transaction of its own, retried through a database outage,
and the engine's exceptions become error codes.

Every write is fenced by the attempt number: an attempt that lost its lease (the reaper gave the
job to another) changes nothing and stops at its next step.

A job of several processes (``resources.nproc``) trains in a torch.distributed group that the
engine launches as a child process group of this one (worker.engine.launch): the lease, the sink
and the cancel flag stay here, rank 0's telemetry comes back over a local socket, a lost lease
kills the group, and a rank that dies gives the job back to the queue at once (it resumes from its
latest checkpoint, as after a lost worker, and the attempt counts against ``max_restarts``). A job
of several nodes (``resources.nnodes``) is gang-scheduled (worker.gang): this attempt is its node 0,
and a task that finds the job running takes one of its other nodes instead.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import timedelta
from functools import partial

import torch

from app.db.models import Job
from app.db.session import is_transient, retrying, transaction
from app.messaging.live_bus import live_bus
from app.services import leases, lifecycle, sweeps
from app.services.asha import record_rung, rung_outcome
from app.services.caps import gib
from app.services.reaper import release_attempt
from app.settings import Settings
from contract.status import JobStatus
from worker.artifacts import (
    InputUnusable,
    dataset_file,
    discard_scratch,
    model_directory,
    read_as_stored,
    restore_checkpoint,
    run_directory,
    token_entries,
    warm_start_file,
)
from worker.engine.device import device_type
from worker.engine.early_stop import RungCheck
from worker.engine.facts import peak_memory_bytes, vocabulary
from worker.engine.launch import RankFailed
from worker.engine.outcome import TrainingError
from worker.engine.request import RunRequest
from worker.engine.run import run_job
from worker.gang import nnodes_of, run_node, this_node
from worker.lease import GangBroken, Lease
from worker.sink import JobSink, LeaseLost

log = logging.getLogger("muonforge.worker")
EXCEEDS_MEMORY = (
    "this job needs about {needed} of memory at its peak; this worker gives a job {budget} "
    "(MUONFORGE_WORKER_MEMORY_BYTES): lower train.batch_size, model.seq_len or the model's size"
)
OUT_OF_MEMORY = "the run ran out of the accelerator's memory: lower train.batch_size, model.seq_len or the model's size"
INTERNAL_ERROR = (
    "the job stopped on an internal error; the service's operators can find it in the worker log "
    "(job {job_id}, attempt {attempt})"
)


def run_attempt(settings: Settings, job_id: str, owner: str) -> str:
    """Claim and run ``job_id``; returns what happened ("skipped" if another attempt holds it,
    "handed_back" if the database stayed out of reach: the job resumes once its lease lapses)."""
    patience = settings.outage_patience_seconds
    claimed = retrying(lambda: _claim(settings, job_id, owner), f"job {job_id}: claim", patience)
    if claimed is None:  # a redelivery, a finished job, another worker's live lease, or a node of a gang to join
        return run_node(settings, job_id, owner)
    claim, dataset = claimed
    attempt, spec, progress, summary = claim.attempt, claim.spec, claim.progress, claim.summary
    needed = peak_memory(claim)
    log.info("job %s: attempt %d started by %s", job_id, attempt, owner)

    model_id = spec.model.hf.model_id if spec.model.hf is not None else None
    if needed is not None and needed > settings.worker_memory_bytes:
        # The API admitted it under its own budget; this worker is smaller. Failing with the figures
        # beats starting a run that the kernel's OOM killer ends, again at every restart.
        message = EXCEEDS_MEMORY.format(needed=gib(needed), budget=gib(settings.worker_memory_bytes))
        error = {"code": "exceeds_worker_memory", "message": message}
        return _finish(settings, job_id, attempt, JobStatus.FAILED, progress, summary, error)
    out_dir = run_directory(settings, job_id)
    sink = JobSink(settings, job_id, attempt, progress, summary, spec.train.keep_checkpoints)
    nnodes = nnodes_of(spec)
    with Lease(settings, job_id, attempt, nnodes=nnodes) as lease:
        should_cancel = _cancel_flag(settings, job_id, lease)
        node = this_node(settings, job_id, attempt, 0, lease, nnodes) if nnodes > 1 else None
        try:
            try:
                # Held, so kept in the cache, for the whole run.
                with (
                    dataset_file(settings, dataset) as corpus,
                    warm_start_file(settings, spec) as init_from,
                    model_directory(settings, job_id, model_id, claim.model) as model_dir,
                    token_entries(settings) as tokens,
                ):
                    sink.adopt_checkpoints()
                    restore_checkpoint(settings, job_id)
                    lease.pulse()  # a download's time is not the run's: the wait for its first step starts now
                    rungs = rung_check(settings, job_id, claim.rungs) if claim.rungs else None
                    request = RunRequest(
                        read_as_stored(spec, dataset),
                        out_dir,
                        corpus,
                        sink,
                        should_cancel,
                        init_from=init_from,
                        rungs=rungs,
                        watch=lease.check,
                        node=node,
                        model_dir=model_dir,
                        tokens=tokens,
                    )
                    result = run_job(request)
                if result is None:  # only a node other than 0 leaves the outcome to another
                    raise RuntimeError("node 0's run ended without its outcome")
            finally:
                sink.close()  # the metrics are stored before the outcome
        except LeaseLost:
            return "lease_lost"
        except InputUnusable as exc:
            return _finish(settings, job_id, attempt, JobStatus.FAILED, sink.step, sink.summary, exc.error)
        except RankFailed as exc:
            log.warning("job %s: attempt %d lost a process or a node of its group: %s", job_id, attempt, exc)
            cause = str(exc) if isinstance(exc, GangBroken) else f"a process of attempt {attempt}'s group exited early"
            return _release(settings, job_id, attempt, cause)
        except TrainingError as exc:
            error = {"code": exc.code, "message": str(exc)}
            return _finish(settings, job_id, attempt, JobStatus.FAILED, sink.step, sink.summary, error)
        except torch.OutOfMemoryError:
            log.exception("job %s: attempt %d ran out of accelerator memory", job_id, attempt)
            error = {"code": "out_of_memory", "message": OUT_OF_MEMORY}
            return _finish(settings, job_id, attempt, JobStatus.FAILED, sink.step, sink.summary, error)
        except Exception as exc:
            if is_transient(exc):  # infrastructure, not the job: it resumes from its checkpoint
                log.warning("job %s: attempt %d hands the job back: %s", job_id, attempt, exc)
                return "handed_back"
            # The tenant sees a code and a sentence; the traceback (SQL, hosts, paths) stays here.
            log.exception("job %s: attempt %d crashed", job_id, attempt)
            error = {"code": "internal", "message": INTERNAL_ERROR.format(job_id=job_id, attempt=attempt)}
            return _finish(settings, job_id, attempt, JobStatus.FAILED, sink.step, sink.summary, error)
        if lease.lost.is_set() or lease.stalled.is_set():
            return "lease_lost"
    if result.status == JobStatus.PAUSED:
        return _pause(settings, job_id, attempt, result.steps, result.summary)
    return _finish(settings, job_id, attempt, JobStatus(result.status), result.steps, result.summary, None)


def peak_memory(claim: lifecycle.Claim) -> int | None:
    """The estimated peak memory of the claimed job's run on a CPU, or None for a CUDA run (one
    that does not fit raises OutOfMemoryError instead)."""
    if device_type(claim.spec.train.device) != "cpu":
        return None
    vocab = vocabulary(claim.spec.data, claim.char_vocab)
    return peak_memory_bytes(claim.spec, vocab, claim.corpus_bytes, on_cuda=False)


def rung_check(settings: Settings, job_id: str, rungs: lifecycle.Rungs) -> RungCheck:
    """The engine's hook for a sweep's ASHA: at each rung, the trial's metric goes to the database,
    which decides once (app.services.asha.record_rung) under the sweep's lock; a retry or a
    resumed attempt gets the stored decision, a promoted one goes on."""
    sweep_id, asha, metric = rungs.sweep_id, rungs.asha, rungs.metric

    def decide(step: int, value: float) -> tuple[JobStatus, str] | None:
        def record():
            with transaction(settings) as session:
                decision = record_rung(session, sweep_id, job_id, step, value)
                return rung_outcome(decision, metric, asha)

        return retrying(record, f"job {job_id}: rung {step}", settings.outage_patience_seconds)

    return RungCheck(steps=tuple(asha["rungs"]), metric=metric, decide=decide)


def _claim(settings: Settings, job_id: str, owner: str) -> tuple[lifecycle.Claim, leases.DatasetObject | None] | None:
    """The job's new attempt and its dataset's store object, or None if it is not to be run
    (finished, or another attempt's live lease)."""
    with transaction(settings) as session:
        lease = timedelta(seconds=settings.lease_seconds)
        claim = lifecycle.claim(session, live_bus(settings), job_id, owner, lease)
        return (claim, leases.dataset_object(session, job_id)) if claim is not None else None


def _finish(
    settings: Settings, job_id: str, attempt: int, status: JobStatus, step: int, summary: dict, error: dict | None
) -> str:
    """The attempt's outcome, with the steps completed and the run's summary."""
    return _end(settings, job_id, attempt, partial(lifecycle.finish, status=status, error=error), step, summary)


def _pause(settings: Settings, job_id: str, attempt: int, step: int, summary: dict) -> str:
    """A sweep's trial waits at a rung (ASHA's promote form): its attempt ends, the job is paused
    (or cancelled, if a cancel came meanwhile) with the steps completed and the run's summary."""
    return _end(settings, job_id, attempt, lifecycle.pause, step, summary)


def _end(
    settings: Settings, job_id: str, attempt: int, change: Callable[..., Job | None], step: int, summary: dict
) -> str:
    """Record how the attempt ended (``change``: a lifecycle use case), fenced, through a database
    outage of up to the outage patience; a sweep's trial then lets its sweep advance."""

    def end() -> Job | None:
        with transaction(settings) as session:
            return change(session, live_bus(settings), job_id=job_id, attempt=attempt, step=step, summary=summary)

    ended = retrying(end, f"job {job_id}: recording how attempt {attempt} ended", settings.outage_patience_seconds)
    if ended is None:
        return "lease_lost"
    discard_scratch(settings, job_id)
    log.info("job %s: attempt %d %s", job_id, attempt, ended.status)
    # A sweep's trial: its next trial starts (or a waiting one resumes) now, else at the reaper's pass.
    if ended.sweep_id:
        try:
            sweeps.advance_after(settings, ended.sweep_id)
        except Exception:
            log.exception("job %s: advancing sweep %s failed", job_id, ended.sweep_id)
    return ended.status


def _release(settings: Settings, job_id: str, attempt: int, cause: str) -> str:
    """Give the job up now (app.services.reaper.release_attempt), through a database outage of up
    to the outage patience; past it the lease lapses and the reaper does the same."""
    try:
        release = partial(release_attempt, settings, job_id, attempt, cause)
        status = retrying(release, f"job {job_id}: giving it up", settings.outage_patience_seconds)
    except Exception as exc:
        if not is_transient(exc):
            raise
        return "handed_back"
    if status is None:
        return "lease_lost"
    log.info("job %s: attempt %d gave the job up: %s", job_id, attempt, status)
    return status


def _cancel_flag(settings: Settings, job_id: str, lease: Lease) -> Callable[[], bool]:
    """should_cancel for the trainer: the job's cancel flag, read at most every cancel_poll_seconds,
    or a lost lease (LeaseLost, also once the attempt stalled and let its lease lapse); every call
    is a pulse of the lease."""
    read_at, cancel = 0.0, False

    def should_cancel() -> bool:
        nonlocal read_at, cancel
        lease.pulse()  # asked before every step: the trainer is making progress
        lease.check()
        now = time.monotonic()
        if now - read_at >= settings.cancel_poll_seconds:
            read_at = now
            try:
                with transaction(settings) as session:
                    cancel = lifecycle.cancel_requested(session, job_id)
            except Exception as exc:  # an outage: train on; the lease decides whether this attempt lives
                if not is_transient(exc):
                    raise
        return cancel

    return should_cancel
