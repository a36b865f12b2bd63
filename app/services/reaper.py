"""The reaper: lapsed leases, lost task messages, sweeps' next trials and orphaned dataset files.

Jobs whose worker stopped renewing its lease go back to the queue (to resume from their latest
checkpoint), or end cancelled or failed; queued jobs whose task got lost are sent again; running
sweeps start their next trials where slots have freed up (app.services.sweeps.advance). Several
reapers may run at once (API and workers): every change is a compare-and-set
(app.services.lifecycle ``release``). Every SWEEP_SECONDS it also removes the dataset files that
no row names (app.services.datasets).
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import datetime, timedelta

from app.db.base import utcnow
from app.db.models import Job
from app.db.session import transaction
from app.messaging.broker import send_train_tasks, train_tasks
from app.messaging.live_bus import live_bus
from app.repositories.jobs import JobRepository
from app.repositories.leases import LeaseRepository
from app.services import lifecycle, models, uploads
from app.services.datasets import sweep_orphans
from app.services.sweeps import advance_running
from app.settings import Settings
from contract.status import JobStatus

log = logging.getLogger("muonforge.reaper")
SWEEP_SECONDS = 600.0  # how often the dataset files are swept (a directory listing per tenant)


def release(settings: Settings, job: Job, now: datetime) -> list[tuple[str, str]]:
    """Release the expired lease of ``job`` in a transaction of its own: back to the queue, or
    to its final state. Returns its tasks (job id, queue), one per node, where they must be sent
    again, else none. The outcome is decided on the job's row as locked in that transaction, not
    on ``job`` (read earlier): a cancel requested in between ends the job cancelled instead of
    queuing it again."""
    cause = f"the worker of attempt {job.attempt} stopped renewing its lease"
    with transaction(settings) as session:
        released = lifecycle.release(session, live_bus(settings), job.id, job.attempt, cause, now, lapsed=True)
        if released is None:
            return []  # deleted, or another reaper or the attempt itself changed it first
        log.warning("job %s: lease of attempt %d expired -> %s", job.id, job.attempt, released.status)
    return train_tasks(job.id, job.queue, job.nnodes) if released.status == JobStatus.QUEUED else []


def release_attempt(settings: Settings, job_id: str, attempt: int, cause: str) -> JobStatus | None:
    """A live attempt that cannot go on (a process of its group died) gives its job up now, by the
    rule of a lapsed lease (app.services.lifecycle ``after_lost_attempt``), instead of leaving it
    to lapse; a job sent back to the queue has its task sent at once. None if the attempt no
    longer held the job."""
    with transaction(settings) as session:
        released = lifecycle.release(session, live_bus(settings), job_id, attempt, cause, utcnow())
        if released is None:
            return None
    status = JobStatus(released.status)
    if status == JobStatus.QUEUED:  # after commit
        send_train_tasks(settings, train_tasks(job_id, released.queue, released.nnodes))
    return status


def reap_once(settings: Settings) -> int:
    """Release expired leases, then re-send the tasks of stale queued jobs; returns how many
    tasks were sent. One job per transaction: a final status locks the job's row and then, by
    trigger, its tenant's (the tenant's active jobs), as a worker's finish and a cancel do.
    Releasing several jobs in one transaction would lock job, tenant, job, tenant, and could
    wait in a cycle on another reaper (API and workers each run one) or on a worker."""
    now = utcnow()
    with transaction(settings) as session:
        expired = LeaseRepository(session).expired_leases(now)
    resend = [task for job in expired for task in release(settings, job, now)]
    with transaction(settings) as session:  # no status change: locks queued jobs' rows only
        for job in JobRepository(session).stale_queued(now - timedelta(seconds=settings.requeue_after_seconds)):
            resend += train_tasks(job.id, job.queue, job.nnodes)
    if resend:  # after commit
        send_train_tasks(settings, resend)
    advance_running(settings)
    return len(resend)


def sweep_once(settings: Settings) -> int:
    with transaction(settings) as session:
        swept = sweep_orphans(session, settings) + models.sweep_orphans(session, settings)
        return swept + uploads.sweep_expired(session, settings)


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
