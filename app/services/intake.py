"""Job intake: ``Intake.submit_job`` takes a JobSpec to a stored, queued job whose task is on its way.

Three stages, each built so that the common case costs no database round trip of its own
(docs/service.md, "Job intake"):

1. prepare (``prepare_submission``, in the request's unit of work): replay a known
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
import hashlib
import json
import logging
import queue
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar, overload

from sqlalchemy.orm import Session

from app.db.base import new_id, utcnow
from app.db.models import Job
from app.db.session import transaction
from app.errors import Conflict, RateLimited, TenantSuspended, ValidationFailed
from app.messaging.broker import send_train_tasks, train_tasks
from app.repositories.checkpoints import CheckpointRepository
from app.repositories.jobs import JobRepository
from app.repositories.tenants import DatasetRepository, TenantRepository
from app.services.admission import Admission
from app.services.auth import TenantRef
from app.services.caps import check_caps
from app.services.lifecycle import record_created
from app.services.tenants import job_cap
from app.services.warm_start import resolve_init_from
from app.settings import Settings
from contract.spec import DataSpec, JobSpec
from contract.status import INITIAL
from worker.engine.facts import CHAR_VOCAB_MAX, vocabulary

log = logging.getLogger("muonforge.api")
T = TypeVar("T")
WRITER_BATCH, WRITER_LINGER = 256, 0.01  # jobs per transaction; at most this latency buys batches of rate x linger
SENDER_BATCH, SENDER_LINGER = 500, 0.05  # tasks per pipeline; a task waits at most this long for others


# -- stage 1: prepare ----------------------------------------------------------------------------
@dataclass
class Submission:
    """A validated submission of a new job: its row, to insert."""

    digest: str  # request_hash of the validated spec
    row: dict[str, Any]  # the jobs table's columns
    cap: int  # the tenant's job cap, checked again, exactly, where the row is inserted


def request_hash(spec: dict[str, Any]) -> str:
    """Of the validated spec, defaults filled in: bodies that mean the same job hash the same."""
    return hashlib.sha256(json.dumps(spec, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def queue_for(spec: JobSpec) -> str:
    """Workers listen on their device class ("cpu", "cuda") and on "default" (device: auto)."""
    return "default" if spec.train.device == "auto" else spec.train.device


@overload
def prepare_submission(
    session: Session,
    tenant: TenantRef,
    spec: JobSpec,
    idempotency_key: None,
    settings: Settings,
    admission: Admission | None = None,
) -> Submission: ...


@overload
def prepare_submission(
    session: Session,
    tenant: TenantRef,
    spec: JobSpec,
    idempotency_key: str | None,
    settings: Settings,
    admission: Admission | None = None,
) -> Submission | Job: ...


def prepare_submission(
    session: Session,
    tenant: TenantRef,
    spec: JobSpec,
    idempotency_key: str | None,
    settings: Settings,
    admission: Admission | None = None,
) -> Submission | Job:
    """Everything a submission needs before its insert: the replay of a known Idempotency-Key,
    the dataset, the resource caps, the warm start's checkpoint and the tenant's job cap.
    ``admission`` (the API process's) spares most submissions the read of the tenant's active
    jobs (a round trip)."""
    repo = JobRepository(session)
    digest = request_hash(with_server_limits(spec, settings).stored())
    if idempotency_key:
        existing = repo.by_idempotency_key(tenant.id, idempotency_key)
        if existing is not None:
            return replay(existing, digest)
    cap = job_cap(tenant.job_cap, settings.tenant_job_cap)
    if cap <= 0:
        raise TenantSuspended("this tenant is suspended: it may not start jobs (ask the service's operators)")
    spec = check_spec(session, tenant, spec, settings)
    active_jobs = partial(TenantRepository(session).active_jobs, tenant.id)
    if not (admission.admit(tenant.id, cap, active_jobs) if admission else active_jobs() < cap):
        raise cap_reached(cap)
    now = utcnow()
    row = dict(
        id=new_id("job"),
        created_at=now,
        tenant_id=tenant.id,
        name=spec.name,
        status=INITIAL,
        spec=spec.stored(),
        queue=queue_for(spec),
        dataset_id=spec.data.dataset_id,
        idempotency_key=idempotency_key,
        request_hash=digest,
        max_restarts=spec.train.max_restarts,
        total_steps=spec.train.steps,
        summary={},
        enqueued_at=now,
        attempt=0,
        progress_step=0,
        cancel_requested=False,
        event_seq=1,
        sweep_id=None,
        parent_job_id=spec.init_from.job_id if spec.init_from else None,
        parent_step=spec.init_from.step if spec.init_from else None,
    )
    return Submission(digest, row, cap)


def no_dataset(dataset_id: str) -> ValidationFailed:
    return ValidationFailed(f"no dataset {dataset_id!r} for this tenant", param="data.dataset_id")


def no_checkpoint(job_id: str, step: int) -> ValidationFailed:
    return ValidationFailed(
        f"job {job_id!r} no longer has a checkpoint at step {step} (its retention policy removed it meanwhile); "
        "submit again from another step",
        param="init_from.step",
    )


def cap_reached(cap: int) -> RateLimited:
    return RateLimited(f"this tenant already has {cap} queued or running jobs (the cap)", retry_after=30)


def replay(existing: Job, digest: str) -> Job:
    """The job a repeated Idempotency-Key answers with, if the body is the same."""
    if existing.request_hash != digest:
        raise Conflict("this Idempotency-Key was used with a different request body", param="Idempotency-Key")
    return existing


def with_server_limits(spec: JobSpec, settings: Settings) -> JobSpec:
    """The spec as this server runs it: an unset ``train.max_minutes`` is the server's limit,
    which the stored spec then shows."""
    if spec.train.max_minutes is not None:
        return spec
    train = spec.train.model_copy(update={"max_minutes": settings.max_job_minutes})
    return spec.model_copy(update={"train": train})


def check_spec(session: Session, tenant: TenantRef, spec: JobSpec, settings: Settings) -> JobSpec:
    """Every check of a job's spec before its insert, bar the job cap: its dataset, the resource
    caps and a warm start's checkpoint. Returns the spec as the service runs it: the server's time
    limit filled in, and ``init_from.step`` resolved (the stored spec names the file the worker
    loads)."""
    spec = with_server_limits(spec, settings)
    vocab, corpus_bytes = data_facts(session, tenant, spec.data)
    check_caps(spec, vocab, corpus_bytes, settings)
    return spec.model_copy(update={"init_from": resolve_init_from(session, tenant, spec, vocab)})


def data_facts(session: Session, tenant: TenantRef, data: DataSpec) -> tuple[int, int]:
    """(vocabulary size, corpus bytes) of a validated spec's ``data``, as the engine will see them
    (for the parameter and memory caps). A dataset with more distinct characters than the char
    tokenizer takes is refused here."""
    if data.path is not None:
        raise ValidationFailed("data.path is for local runs; upload the corpus and use data.dataset_id", "data.path")
    if data.dataset_id is None:
        return vocabulary(data), 0
    dataset = DatasetRepository(session).get(data.dataset_id, tenant.id)
    if dataset is None:
        raise no_dataset(data.dataset_id)
    if data.tokenizer == "char" and dataset.char_vocab > CHAR_VOCAB_MAX:  # counted up to CHAR_VOCAB_MAX + 1
        raise ValidationFailed(
            f"the dataset has more than {CHAR_VOCAB_MAX:,} distinct characters, the most the char tokenizer "
            "takes: use tokenizer byte",
            param="data.tokenizer",
        )
    return vocabulary(data, dataset.char_vocab), dataset.bytes


# -- stage 2: insert -----------------------------------------------------------------------------
def insert_submissions(session: Session, submissions: list[Submission]) -> list[tuple[Job, bool] | Exception]:
    """Insert new jobs and their first status events, in one statement per table. The tenants'
    rows are locked first and their active jobs read with the lock (``tenants.active_jobs``, one
    row each, kept by triggers), so the job cap holds exactly however many API processes insert
    at once. A job whose Idempotency-Key another request inserted first is that request's replay
    (or a 409); one whose dataset was deleted since it was prepared, or whose warm start's
    checkpoint its parent's retention removed since, a 422. Returns, per submission, (job,
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
    pruned = {job_id for job_id, start in starts.items() if start not in present_starts}
    # Jobs that hold the batch's Idempotency-Keys already, read (no wait) and left out of the
    # insert: an INSERT meeting one in the unique index would wait for a transaction changing
    # that job's status, which waits for the tenant's lock held here (the job's trigger).
    keys = {(s.row["tenant_id"], s.row["idempotency_key"]) for s in submissions if s.row["idempotency_key"]}
    holders = repo.by_idempotency_keys(keys)
    admitted: list[Submission] = []
    for sub in submissions:
        tenant = sub.row["tenant_id"]
        if sub.row["id"] in gone or sub.row["id"] in pruned or (tenant, sub.row["idempotency_key"]) in holders:
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
