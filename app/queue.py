"""Sending tasks by name: the service sends ``muonforge.train_job`` without importing the worker.

Tasks are sent only after the job's row is committed. The API hands them to a
:class:`TaskPublisher`, whose one background thread sends whatever has accumulated through one
producer and one Redis pipeline, off the request's path; a task that could not be sent is sent
again by the reaper once the job has been queued for ``requeue_after_seconds``.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterable
from functools import lru_cache

from celery import Celery

from app.batching import batches
from app.settings import Settings

log = logging.getLogger("muonforge.queue")
TRAIN_TASK = "muonforge.train_job"
MAX_BATCH = 500  # tasks per pipeline
LINGER_SECONDS = 0.05  # a task waits at most this long for others to share its pipeline


@lru_cache(maxsize=4)
def _client(broker_url: str) -> Celery:
    return Celery("muonforge-api", broker=broker_url, set_as_current=False)


def enqueue_train(settings: Settings, jobs: Iterable[tuple[str, str]]) -> None:
    """Send the train task of every (job id, queue) pair, in one producer batch."""
    app = _client(settings.broker_url)
    with app.producer_or_acquire() as producer, producer.batch(MAX_BATCH):
        for job_id, queue_name in jobs:
            args = [job_id]  # argsrepr given: Celery would otherwise run its (slow) saferepr on every send
            app.send_task(TRAIN_TASK, args=args, argsrepr=repr(args), queue=queue_name, producer=producer)


class TaskPublisher:
    """Sends train tasks from a background thread, in batches of whatever has accumulated."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._pending: queue.SimpleQueue[tuple[str, str] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="task-publisher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, jobs: Iterable[tuple[str, str]]) -> None:
        """Queue the tasks of committed jobs for sending."""
        for job in jobs:
            self._pending.put(job)

    def stop(self, timeout: float = 10.0) -> None:
        """Send what is pending, then stop."""
        self._pending.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        for batch in batches(self._pending, LINGER_SECONDS, MAX_BATCH):
            try:
                enqueue_train(self.settings, batch)
            except Exception:  # the jobs are stored as queued: the reaper sends their tasks later
                log.exception("could not send %d task(s); the reaper will send them again", len(batch))
