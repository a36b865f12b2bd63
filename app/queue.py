"""Enqueueing by task name: the service sends ``muonforge.train_job`` without importing the worker."""

from __future__ import annotations

from functools import lru_cache

from celery import Celery

from app.settings import Settings

TRAIN_TASK = "muonforge.train_job"


@lru_cache(maxsize=4)
def _client(broker_url: str) -> Celery:
    return Celery("muonforge-api", broker=broker_url, set_as_current=False)


def enqueue_train(settings: Settings, job_id: str, queue: str) -> None:
    """Send the task for ``job_id``; called only after the job's row is committed."""
    _client(settings.broker_url).send_task(TRAIN_TASK, args=[job_id], queue=queue)
