"""Sending tasks by name: the service sends ``muonforge.train_job`` without importing the worker.

A job's task is sent only after its row has committed, and carries the job's id alone: the
database, not the message, says what to run. A task that was never sent (the process died
between the commit and the send) is sent again by the reaper once the job has been queued for
``requeue_after_seconds``.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache

from celery import Celery
from kombu import Connection

from app.settings import Settings

TRAIN_TASK = "muonforge.train_job"
MAX_BATCH = 500  # task messages per Redis pipeline


@lru_cache(maxsize=4)
def _client(broker_url: str) -> Celery:
    return Celery("muonforge-api", broker=broker_url, set_as_current=False)


def train_tasks(job_id: str, queue_name: str, nnodes: int = 1) -> list[tuple[str, str]]:
    """A job's tasks, (job id, queue): one per node slot (a job of several nodes is trained by as
    many workers, each of which claims a slot of it)."""
    return [(job_id, queue_name)] * nnodes


def send_train_tasks(settings: Settings, jobs: Iterable[tuple[str, str]]) -> None:
    """Send the train task of every (job id, queue) pair, in one producer batch."""
    app = _client(settings.broker_url)
    with app.producer_or_acquire() as producer, producer.batch(MAX_BATCH):
        for job_id, queue_name in jobs:
            args = [job_id]  # argsrepr given: Celery would otherwise run its (slow) saferepr on every send
            app.send_task(TRAIN_TASK, args=args, argsrepr=repr(args), queue=queue_name, producer=producer)


def broker_reachable(settings: Settings) -> None:
    """Raises if the broker cannot be reached within a couple of seconds."""
    with Connection(settings.broker_url, connect_timeout=2) as conn:
        conn.ensure_connection(max_retries=1)
