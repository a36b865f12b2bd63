"""The Celery app of the workers: one process per device, prefetch 1, late acks.

Postgres (or the embedded SQLite file) is the source of truth for job status; Celery only
delivers job ids. A redelivered message is harmless: the attempt's claim is a compare-and-set
that finds the job already running (or finished) and does nothing.
"""

from __future__ import annotations

import threading

from celery import Celery
from celery.signals import worker_ready, worker_shutdown

from app.services.reaper import run_reaper
from app.settings import get_settings
from worker.health import keep_alive

settings = get_settings()
celery = Celery("muonforge", broker=settings.broker_url, include=["worker.tasks"])
celery.conf.update(
    task_acks_late=True,  # a worker that dies mid-job leaves its message for redelivery
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,  # a long job must not hold a second message hostage
    task_ignore_result=True,  # status lives in the database, not in a result backend
    task_default_queue="default",
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)

_stop = threading.Event()


@worker_ready.connect
def _start_threads(**_) -> None:
    threading.Thread(target=run_reaper, args=(settings, _stop), name="reaper", daemon=True).start()
    if settings.worker_alive_file is not None:  # the healthcheck's file (worker.health)
        args = (settings, settings.worker_alive_file, _stop)
        threading.Thread(target=keep_alive, args=args, name="alive", daemon=True).start()


@worker_shutdown.connect
def _stop_threads(**_) -> None:
    _stop.set()
