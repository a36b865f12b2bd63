"""The reaper: jobs whose worker stopped renewing its lease go back to the queue (to resume from
their latest checkpoint), or end cancelled / failed; queued jobs whose task got lost are re-sent;
running sweeps start their next trials where slots have freed up (app.services.sweeps.advance).
Several reapers may run at once (API and workers): every change is a compare-and-set. Every
SWEEP_SECONDS it also removes the dataset files that no row names (app.services.datasets)."""

from __future__ import annotations

import logging
import threading
import time
from datetime import datetime, timedelta

from app.broker import send_train_tasks
from app.db.base import utcnow
from app.db.models import Job
from app.db.session import transaction
from app.job_status import JobStatus
from app.live import live_bus
from app.repositories.jobs import JobRepository
from app.services.datasets import sweep_orphans
from app.services.job_events import record_status
from app.services.sweeps import advance_running
from app.settings import Settings

log = logging.getLogger("muonforge.reaper")
SWEEP_SECONDS = 600.0  # how often the dataset files are swept (a directory listing per tenant)


def release(settings: Settings, job: Job, now: datetime) -> tuple[str, str] | None:
    """Release the expired lease of ``job`` in a transaction of its own: back to the queue, or
    to its final state. Returns (job id, queue) where its task must be sent again, else None.
    The outcome is decided on the job's row as locked in that transaction, not on ``job`` (read
    earlier): a cancel requested in between ends the job cancelled instead of queuing it again."""
    with transaction(settings) as session:
        repo = JobRepository(session)
        current = repo.locked(job.id)
        if current is None or current.attempt != job.attempt:
            return None  # deleted, or another reaper released it and a new attempt began
        status, error = released_status(current)
        if not repo.release_expired(current, now, status, error):
            return None  # another reaper, or the attempt itself, changed it first
        log.warning("job %s: lease of attempt %d expired -> %s", job.id, job.attempt, status)
        record_status(session, live_bus(settings), job.id)
    return (job.id, job.queue) if status == JobStatus.QUEUED else None


def released_status(job: Job) -> tuple[JobStatus, dict | None]:
    """Where a job whose attempt was lost goes: cancelled if a cancel was requested, failed once
    its restarts are used up (with the error), else back to the queue."""
    if job.cancel_requested:
        return JobStatus.CANCELLED, None
    if job.attempt > job.max_restarts:
        return JobStatus.FAILED, {
            "code": "worker_lost",
            "message": f"the worker of attempt {job.attempt} stopped renewing its lease; "
            f"max_restarts ({job.max_restarts}) used up",
        }
    return JobStatus.QUEUED, None


def reap_once(settings: Settings) -> int:
    """Release expired leases, then re-send the tasks of stale queued jobs; returns how many
    tasks were sent. One job per transaction: a final status locks the job's row and then, by
    trigger, its tenant's (the tenant's active jobs), as a worker's finish and a cancel do.
    Releasing several jobs in one transaction would lock job, tenant, job, tenant, and could
    wait in a cycle on another reaper (API and workers each run one) or on a worker."""
    now = utcnow()
    with transaction(settings) as session:
        expired = JobRepository(session).expired_leases(now)
    resend = [task for job in expired if (task := release(settings, job, now))]
    with transaction(settings) as session:  # no status change: locks queued jobs' rows only
        resend += JobRepository(session).stale_queued(now - timedelta(seconds=settings.requeue_after_seconds))
    if resend:  # after commit
        send_train_tasks(settings, resend)
    advance_running(settings)
    return len(resend)


def sweep_once(settings: Settings) -> int:
    with transaction(settings) as session:
        return sweep_orphans(session, settings)


def run_reaper(settings: Settings, stop: threading.Event) -> None:
    """Reap every ``reaper_seconds``, and sweep the dataset files every SWEEP_SECONDS, until
    ``stop`` is set."""
    next_sweep = time.monotonic() + SWEEP_SECONDS
    while not stop.wait(settings.reaper_seconds):
        try:
            reap_once(settings)
        except Exception:
            log.exception("reaper pass failed")
        if time.monotonic() >= next_sweep:
            next_sweep = time.monotonic() + SWEEP_SECONDS
            try:
                sweep_once(settings)
            except Exception:
                log.exception("dataset sweep failed")
