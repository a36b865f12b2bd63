"""Job intake: ``Intake.submit_job`` takes a JobSpec to a stored, queued job whose task is on its way.

Three stages, each built so that the common case costs no database round trip of its own
(docs/service.md, "Job intake"):

1. prepare (app.services.submission ``prepare_submission``, in the request's unit of work): replay a known
   Idempotency-Key, look up the dataset, check the resource caps and the tenant's job cap, and
   build the job's row;
2. insert (the JobWriter thread, group commit): every job prepared while the previous
   transaction ran goes into one multi-row INSERT per table and one commit;
3. send (the TaskPublisher thread): the tasks of committed jobs go out in batches, through one
   producer and one Redis pipeline.

A request waits for its job's commit (stage 2), not for the send: a task lost there is sent
again by the reaper.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from concurrent.futures import Future
from typing import Any, TypeVar

from sqlalchemy.orm import Session

from app.db.models import Job
from app.db.session import transaction
from app.errors import Conflict
from app.messaging.broker import send_train_tasks, train_tasks
from app.repositories.checkpoints import CheckpointRepository
from app.repositories.jobs import JobRepository
from app.repositories.models import ModelRepository
from app.repositories.tenants import DatasetRepository, TenantRepository
from app.services.admission import Admission
from app.services.lifecycle import record_created
from app.services.model_start import no_model, uploaded_model_id
from app.services.submission import Submission, cap_reached, no_checkpoint, no_dataset, prepare_submission, replay
from app.settings import Settings
from contract.spec import JobSpec

log = logging.getLogger("muonforge.api")
T = TypeVar("T")
# Jobs per transaction, and no linger: a batch is what arrived while the previous one was written
# (waiting for more would add its wait to every request's latency; measured in docs/benchmarks.md).
WRITER_BATCH, WRITER_LINGER = 256, 0.0
SENDER_BATCH, SENDER_LINGER = 500, 0.05  # tasks per pipeline; a task waits at most this long for others


# -- stage 2: insert -----------------------------------------------------------------------------
def insert_submissions(session: Session, submissions: list[Submission]) -> list[tuple[Job, bool] | Exception]:
    """Insert new jobs and their first status events, in one statement per table. The tenants'
    rows are locked first and their active jobs read with the lock (``tenants.active_jobs``, one
    row each, kept by triggers), so the job cap holds exactly however many API processes insert
    at once. A job whose Idempotency-Key another request inserted first is that request's replay
    (or a 409); one whose dataset or uploaded model was deleted since it was prepared, or whose
    warm start's checkpoint its parent's retention removed since, a 422. Returns, per submission, (job,
    created) or the error it answers with."""
    repo = JobRepository(session)
    # A warm start's checkpoint, checked again under its parent's row (shared: the parent's
    # retention takes it for update), locked before the tenants as every job row is.
    starts = {
        s.row["id"]: (s.row["parent_job_id"], s.row["parent_step"]) for s in submissions if s.row["parent_job_id"]
    }
    repo.lock_shared({parent for parent, _ in starts.values()})
    present_starts = CheckpointRepository(session).existing_checkpoints(set(starts.values()))
    tenants = sorted({s.row["tenant_id"] for s in submissions})
    active = TenantRepository(session).lock(tenants)
    # A dataset deleted since its job was prepared (a delete takes the same lock): refused as then.
    named = {s.row["dataset_id"] for s in submissions if s.row["dataset_id"]}
    present = DatasetRepository(session).existing_ids(named)
    gone = {s.row["id"] for s in submissions if s.row["dataset_id"] and s.row["dataset_id"] not in present}
    # Likewise an uploaded model (its delete takes the same lock).
    models = {s.row["id"]: model_id for s in submissions if (model_id := uploaded_model_id(s.row["spec"]))}
    kept = ModelRepository(session).existing_ids(set(models.values()))
    unmodelled = {job_id for job_id, model_id in models.items() if model_id not in kept}
    pruned = {job_id for job_id, start in starts.items() if start not in present_starts}
    # Jobs that hold the batch's Idempotency-Keys already, read (no wait) and left out of the
    # insert: an INSERT meeting one in the unique index would wait for a transaction changing
    # that job's status, which waits for the tenant's lock held here (the job's trigger).
    keys = {(s.row["tenant_id"], s.row["idempotency_key"]) for s in submissions if s.row["idempotency_key"]}
    holders = repo.by_idempotency_keys(keys)
    admitted: list[Submission] = []
    skipped = gone | pruned | unmodelled
    for sub in submissions:
        tenant = sub.row["tenant_id"]
        if sub.row["id"] in skipped or (tenant, sub.row["idempotency_key"]) in holders:
            continue
        if active.get(tenant, 0) < sub.cap:
            active[tenant] = active.get(tenant, 0) + 1
            admitted.append(sub)
    inserted = repo.insert_new([s.row for s in admitted])
    results: list[tuple[Job, bool] | Exception] = []
    for sub in submissions:
        if sub.row["id"] in inserted:
            results.append((Job(**sub.row), True))
            continue
        if sub.row["id"] in gone:
            results.append(no_dataset(sub.row["dataset_id"]))
            continue
        if sub.row["id"] in pruned:
            results.append(no_checkpoint(*starts[sub.row["id"]]))
            continue
        if sub.row["id"] in unmodelled:
            results.append(no_model(models[sub.row["id"]]))
            continue
        tenant, key = sub.row["tenant_id"], sub.row["idempotency_key"]
        # Else an earlier submission of the batch with the same key.
        existing = holders.get((tenant, key)) or (repo.by_idempotency_key(tenant, key) if key else None)
        if existing is None:
            results.append(cap_reached(sub.cap))  # only the cap (or a concurrent insert of the same key) skips a row
            continue
        try:
            results.append((replay(existing, sub.digest), False))
        except Conflict as exc:
            results.append(exc)
    record_created(session, [r[0] for r in results if isinstance(r, tuple) and r[1]])
    return results


def batches(pending: queue.SimpleQueue[T | None], linger: float, size: int) -> Iterator[list[T]]:
    """Batches of what ``pending`` holds: wait for an item, ``linger`` seconds more so that a
    burst shares the batch, then take up to ``size`` items. Ends after the None sentinel (the
    items before it are yielded first)."""
    while True:
        batch: list[T] = []
        item = pending.get()
        if linger:
            time.sleep(linger)
        while item is not None:
            batch.append(item)
            if len(batch) >= size or pending.empty():
                break
            item = pending.get()
        if batch:
            yield batch
        if item is None:
            return


class JobWriter:
    """Inserts submissions from one thread, in batches (group commit): one multi-row INSERT per
    table and one commit for every job submitted while the previous transaction ran, where a job
    per transaction would cost each submission its own round trips and its own fsync. A batch
    that fails is retried one job at a time, so one bad job fails alone."""

    def __init__(self, settings: Settings, publisher: TaskPublisher) -> None:
        self.settings, self.publisher = settings, publisher
        self._pending: queue.SimpleQueue[tuple[Submission, Future] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="job-writer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Write what is pending, then stop."""
        self._pending.put(None)
        self._thread.join(timeout)

    def submit(self, submission: Submission) -> Future[tuple[Job, bool]]:
        """Queue a new job for the next batch; the future gives (job, created) or the job's error."""
        future: Future[tuple[Job, bool]] = Future()
        self._pending.put((submission, future))
        return future

    def _run(self) -> None:
        for batch in batches(self._pending, WRITER_LINGER, WRITER_BATCH):
            self._write(batch)

    def _write(self, batch: list[tuple[Submission, Future]]) -> None:
        try:
            with transaction(self.settings) as session:
                results = insert_submissions(session, [submission for submission, _ in batch])
        except Exception as exc:
            if len(batch) > 1:
                log.warning("a batch of %d new jobs failed (%s); writing them one by one", len(batch), exc)
                for item in batch:
                    self._write([item])
            else:
                batch[0][1].set_exception(exc)
            return
        created = [r[0] for r in results if isinstance(r, tuple) and r[1]]
        # Committed: send their tasks.
        self.publisher.submit(task for job in created for task in train_tasks(job.id, job.queue, job.nnodes))
        for (_, future), result in zip(batch, results):
            if isinstance(result, Exception):
                future.set_exception(result)
            else:
                future.set_result(result)


# -- stage 3: send -------------------------------------------------------------------------------
class TaskPublisher:
    """Sends the train tasks of committed jobs from one thread, in batches of whatever has
    accumulated. A batch that cannot be sent is left to the reaper (the jobs are stored as queued)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._pending: queue.SimpleQueue[tuple[str, str] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="task-publisher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, jobs: Iterable[tuple[str, str]]) -> None:
        """Queue the tasks of committed jobs, (job id, queue), for sending."""
        for job in jobs:
            self._pending.put(job)

    def stop(self, timeout: float = 10.0) -> None:
        """Send what is pending, then stop."""
        self._pending.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        for batch in batches(self._pending, SENDER_LINGER, SENDER_BATCH):
            try:
                send_train_tasks(self.settings, batch)
            except Exception:
                log.exception("could not send %d task(s); the reaper will send them again", len(batch))


# -- the whole path ------------------------------------------------------------------------------
RunInUnitOfWork = Callable[..., Awaitable[Any]]  # app.api.deps.UnitOfWork: runs fn(session, tenant, *args)


class Intake:
    """An API process's job intake: its admission estimate, JobWriter and TaskPublisher."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.admission = Admission()
        self.publisher = TaskPublisher(settings)
        self.writer = JobWriter(settings, self.publisher)

    def start(self) -> None:
        self.publisher.start()
        self.writer.start()

    def stop(self) -> None:
        """Write what is pending, then send its tasks."""
        self.writer.stop()
        self.publisher.stop()

    async def submit_job(self, work: RunInUnitOfWork, spec: JobSpec, idempotency_key: str | None) -> tuple[Job, bool]:
        """The job of a submission, stored and committed, and whether it was created (False: a
        replay of its Idempotency-Key)."""
        submission = await work(prepare_submission, spec, idempotency_key, self.settings, self.admission)
        if isinstance(submission, Job):  # a replay of its Idempotency-Key
            return submission, False
        return await asyncio.wrap_future(self.writer.submit(submission))
