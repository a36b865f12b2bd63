"""The reaper: jobs whose worker stopped renewing its lease go back to the queue (to resume from
their latest checkpoint), or end cancelled / failed; queued jobs whose task got lost are re-sent.
Several reapers may run at once (API and workers): every change is a compare-and-set."""

from __future__ import annotations

import logging
import threading
from datetime import datetime, timedelta

from sqlalchemy.orm import Session

from app.broker import send_train_tasks
from app.db.base import utcnow
from app.db.session import transaction
from app.job_status import JobStatus
from app.live import live_bus
from app.repositories.jobs import JobRepository
from app.services.job_events import record_status
from app.settings import Settings

log = logging.getLogger("muonforge.reaper")


def reap(session: Session, settings: Settings, now: datetime) -> list[tuple[str, str]]:
    """Release expired leases; returns the (job id, queue) pairs whose task must be sent."""
    repo = JobRepository(session)
    resend: list[tuple[str, str]] = []
    for job in repo.expired_leases(now):
        error = None
        if job.cancel_requested:
            status = JobStatus.CANCELLED
        elif job.attempt > job.max_restarts:
            status = JobStatus.FAILED
            error = {
                "code": "worker_lost",
                "message": f"the worker of attempt {job.attempt} stopped renewing its lease; "
                f"max_restarts ({job.max_restarts}) used up",
            }
        else:
            status = JobStatus.QUEUED
        if repo.release_expired(job, now, status, error):
            log.warning("job %s: lease of attempt %d expired -> %s", job.id, job.attempt, status)
            record_status(session, live_bus(settings), job.id)
            if status == JobStatus.QUEUED:
                resend.append((job.id, job.queue))
    resend += repo.stale_queued(now - timedelta(seconds=settings.requeue_after_seconds))
    return resend


def reap_once(settings: Settings) -> int:
    with transaction(settings) as session:
        resend = reap(session, settings, utcnow())
    if resend:  # after commit
        send_train_tasks(settings, resend)
    return len(resend)


def run_reaper(settings: Settings, stop: threading.Event) -> None:
    """Reap every ``reaper_seconds`` until ``stop`` is set."""
    while not stop.wait(settings.reaper_seconds):
        try:
            reap_once(settings)
        except Exception:
            log.exception("reaper pass failed")
