"""The JobWriter: new jobs are inserted by one thread, in batches (group commit).

Every job submitted while the previous transaction ran goes into the next one: one multi-row
INSERT per table and one commit for all of them, where a job per transaction would cost each
submission its own round trips and its own fsync. A job's task is sent (by the TaskPublisher)
only after its row is committed. A batch that fails is retried one job at a time, so one bad
job fails alone.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from concurrent.futures import Future

from app.batching import batches
from app.db.models import Job
from app.db.session import transaction
from app.queue import TaskPublisher
from app.services.jobs import NewJob, insert_jobs
from app.settings import Settings

log = logging.getLogger("muonforge.api")
MAX_BATCH = 256  # jobs per transaction
LINGER_SECONDS = 0.01  # at most this much latency buys batches of rate x linger jobs

Pending = tuple[NewJob, Future]


class JobWriter:
    def __init__(self, settings: Settings, publisher: TaskPublisher) -> None:
        self.settings, self.publisher = settings, publisher
        self._pending: queue.SimpleQueue[Pending | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="job-writer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Write what is pending, then stop."""
        self._pending.put(None)
        self._thread.join(timeout)

    def submit(self, new: NewJob) -> Future[tuple[Job, bool]]:
        """Queue ``new`` for the next batch; the future gives (job, created) or the job's error."""
        future: Future[tuple[Job, bool]] = Future()
        self._pending.put((new, future))
        return future

    async def insert(self, new: NewJob) -> tuple[Job, bool]:
        """``submit``, awaited."""
        return await asyncio.wrap_future(self.submit(new))

    def _run(self) -> None:
        for batch in batches(self._pending, LINGER_SECONDS, MAX_BATCH):
            self._write(batch)

    def _write(self, batch: list[Pending]) -> None:
        try:
            with transaction(self.settings) as session:
                results = insert_jobs(session, [new for new, _ in batch])
        except Exception as exc:
            if len(batch) > 1:
                log.warning("a batch of %d new jobs failed (%s); writing them one by one", len(batch), exc)
                for item in batch:
                    self._write([item])
            else:
                batch[0][1].set_exception(exc)
            return
        created = [r[0] for r in results if isinstance(r, tuple) and r[1]]
        self.publisher.submit((job.id, job.queue) for job in created)  # committed: send their tasks
        for (_, future), result in zip(batch, results):
            if isinstance(result, Exception):
                future.set_exception(result)
            else:
                future.set_result(result)
