"""All SQL about jobs. Every status change is a compare-and-set UPDATE: it names the states it
may leave (and, for a worker, its attempt number: the fencing token), so a stale writer
changes nothing and learns so from the row count.

A change into or out of contract.status.ACTIVE also updates the tenant's ``active_jobs``, by
trigger (migration 0005), in its transaction: it locks the job's row, then the tenant's. So a
transaction changes the status of one existing job at most, and locks no tenant before it: two
such changes in one transaction, or a tenant's lock then a change, can wait in a cycle on
another transaction that takes the same rows in another order (Postgres then aborts one)."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import delete, func, insert, select, tuple_, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from app.db.base import utcnow
from app.db.models import Checkpoint, Job, JobEvent, JobNode
from contract.status import FINISHED, RUNNING, JobStatus, check_transition


class JobRepository:
    def __init__(self, session: Session) -> None:
        self.session = session

    # -- reads ------------------------------------------------------------------------------------
    def get(self, job_id: str, tenant_id: str | None = None) -> Job | None:
        query = select(Job).where(Job.id == job_id)
        if tenant_id is not None:
            query = query.where(Job.tenant_id == tenant_id)
        return self.session.scalars(query).one_or_none()

    def fresh(self, job_id: str) -> Job:
        """The job's row as committed now, also when the session holds an older copy (a
        compare-and-set UPDATE bypasses loaded objects)."""
        return self.session.scalars(select(Job).where(Job.id == job_id).execution_options(populate_existing=True)).one()

    def locked(self, job_id: str) -> Job | None:
        """The job's row as committed now, locked until the transaction ends (Postgres; SQLite
        serialises writers)."""
        query = select(Job).where(Job.id == job_id).with_for_update().execution_options(populate_existing=True)
        return self.session.scalars(query).one_or_none()

    def page(self, tenant_id: str, limit: int, after: str | None, status: str | None) -> list[Job]:
        """Newest first; ``limit + 1`` rows so the caller can tell whether there is more."""
        query = select(Job).where(Job.tenant_id == tenant_id)
        if status:
            query = query.where(Job.status == status)
        if after:
            query = query.where(Job.id < after)
        return list(self.session.scalars(query.order_by(Job.id.desc()).limit(limit + 1)))

    def by_idempotency_key(self, tenant_id: str, key: str) -> Job | None:
        query = select(Job).where(Job.tenant_id == tenant_id, Job.idempotency_key == key)
        return self.session.scalars(query).one_or_none()

    def by_idempotency_keys(self, keys: Collection[tuple[str, str]]) -> dict[tuple[str, str], Job]:
        """The jobs that hold these (tenant, Idempotency-Key) pairs, by pair."""
        if not keys:
            return {}
        query = select(Job).where(tuple_(Job.tenant_id, Job.idempotency_key).in_(list(keys)))
        return {(job.tenant_id, job.idempotency_key): job for job in self.session.scalars(query)}

    def count_unfinished_using(self, tenant_id: str, dataset_id: str) -> int:
        """The tenant's unfinished jobs (queued, running, or a trial paused at a rung) that train
        on the dataset."""
        query = select(func.count()).where(
            Job.tenant_id == tenant_id, Job.dataset_id == dataset_id, Job.status.not_in(FINISHED)
        )
        return self.session.scalar(query) or 0

    def count_by_status(self) -> dict[str, int]:
        return dict(self.session.execute(select(Job.status, func.count()).group_by(Job.status)).all())

    def steps_completed(self) -> int:
        """Optimizer steps completed over all jobs."""
        return int(self.session.scalar(select(func.coalesce(func.sum(Job.progress_step), 0))) or 0)

    def cancel_requested(self, job_id: str) -> bool:
        return bool(self.session.scalar(select(Job.cancel_requested).where(Job.id == job_id)))

    # -- writes by the API ---------------------------------------------------------------------------
    def insert_new(self, rows: list[dict[str, Any]]) -> set[str]:
        """INSERT new jobs (rows with the same keys, ids included) in one statement; a row whose
        (tenant, Idempotency-Key) exists already is skipped. Returns the ids inserted."""
        if not rows:
            return set()
        dialect = postgresql if self.session.get_bind().dialect.name == "postgresql" else sqlite
        stmt = (
            dialect.insert(Job.__table__)
            .on_conflict_do_nothing(index_elements=["tenant_id", "idempotency_key"])
            .returning(Job.__table__.c.id)
        )
        return set(self.session.scalars(stmt, rows))

    def cancel_queued(self, job_id: str, now: datetime) -> bool:
        """A job no worker holds (queued, or a trial paused at a rung): cancelled at once."""
        return self._cas(
            job_id, (JobStatus.QUEUED, JobStatus.PAUSED), status=JobStatus.CANCELLED, cancel_requested=True,
            finished_at=now,
        )  # fmt: skip

    def promote(self, job_id: str) -> bool:
        """A trial paused at a rung, promoted by ASHA: queued again (sent now), to resume there.
        Its next attempt is no restart after a lost worker: ``max_restarts``, which the reaper
        compares with the attempt number, grows by one with it."""
        values = {"status": JobStatus.QUEUED, "enqueued_at": utcnow(), "max_restarts": Job.max_restarts + 1}
        return self._cas(job_id, (JobStatus.PAUSED,), **values)

    def unpromote(self, job_id: str) -> bool:
        """Undo ``promote`` in the same transaction (the promotion passed the tenant's job cap)."""
        return self._cas(job_id, (JobStatus.QUEUED,), status=JobStatus.PAUSED, max_restarts=Job.max_restarts - 1)

    def stop_paused(self, job_id: str, summary: dict[str, Any]) -> bool:
        """A trial paused at a rung that its sweep will not promote: stopped there."""
        return self._cas(
            job_id, (JobStatus.PAUSED,), status=JobStatus.STOPPED_EARLY, summary=summary, finished_at=utcnow()
        )

    def lock_paused(self, job_ids: Collection[str]) -> dict[str, Job]:
        """The paused ones of these jobs, locked in id order (before any status change of the
        transaction, as every multi-job change here does: no cycle with a single job's change)."""
        if not job_ids:
            return {}
        query = (
            select(Job)
            .where(Job.id.in_(list(job_ids)), Job.status == JobStatus.PAUSED)
            .order_by(Job.id)
            .with_for_update()
            .execution_options(populate_existing=True)
        )
        return {job.id: job for job in self.session.scalars(query)}

    def request_cancel(self, job_id: str) -> bool:
        return self._cas(job_id, (JobStatus.RUNNING,), status=JobStatus.CANCELLING, cancel_requested=True)

    def forget_dataset(self, tenant_id: str, dataset_id: str) -> None:
        """Unlink the tenant's finished jobs from a dataset about to be deleted (their spec still
        names it); an unfinished job keeps its link, and the foreign key refuses the delete."""
        query = update(Job).where(Job.tenant_id == tenant_id, Job.dataset_id == dataset_id, Job.status.in_(FINISHED))
        self.session.execute(query.values(dataset_id=None))

    # -- writes by a worker attempt (fenced by the attempt number) --------------------------------
    def claim(self, job_id: str, owner: str, lease: timedelta) -> int | None:
        """queued -> running for a new attempt holding a lease; returns the attempt or None."""
        check_transition((JobStatus.QUEUED,), JobStatus.RUNNING)
        now = utcnow()
        result = self.session.execute(
            update(Job)
            .where(Job.id == job_id, Job.status == JobStatus.QUEUED)
            .values(
                status=JobStatus.RUNNING,
                attempt=Job.attempt + 1,
                lease_owner=owner,
                lease_expires_at=now + lease,
                heartbeat_at=now,
                started_at=func.coalesce(Job.started_at, now),
            )
            .returning(Job.attempt)
        )
        return result.scalar_one_or_none()

    def heartbeat(self, job_id: str, attempt: int, lease: timedelta) -> bool:
        """Renew the lease; False means this attempt no longer owns the job and must stop."""
        now = utcnow()
        return self._cas(job_id, RUNNING, attempt, lease_expires_at=now + lease, heartbeat_at=now)

    def record_progress(self, job_id: str, attempt: int, step: int, summary: dict[str, Any]) -> bool:
        return self._cas(job_id, RUNNING, attempt, progress_step=step, summary=summary)

    def finish(self, job_id: str, attempt: int, status: str, error: dict | None = None, **values: Any) -> bool:
        return self._cas(
            job_id, RUNNING, attempt, status=status, error=error, finished_at=utcnow(),
            lease_owner=None, lease_expires_at=None, **values,
        )  # fmt: skip

    def pause(self, job_id: str, attempt: int, **values: Any) -> str | None:
        """The attempt of a trial that reached a rung where it waits (ASHA's promote form) ends:
        running -> paused, the lease dropped, nothing finished; a job being cancelled is cancelled
        instead. Returns the status it took, or None if this attempt no longer holds the job."""
        released = {"lease_owner": None, "lease_expires_at": None, **values}
        if self._cas(job_id, (JobStatus.RUNNING,), attempt, status=JobStatus.PAUSED, **released):
            return JobStatus.PAUSED
        if self._cas(job_id, (JobStatus.CANCELLING,), attempt, status=JobStatus.CANCELLED, finished_at=utcnow(),
                     **released):  # fmt: skip
            return JobStatus.CANCELLED
        return None

    def release(self, job_id: str, attempt: int, now: datetime, status: str, error: dict | None = None) -> bool:
        """An attempt that cannot go on (a process of its group died) gives its job up at once,
        as the reaper does once a lease lapses: back to queued (to resume), or to its final state."""
        return self._cas(job_id, RUNNING, attempt, **_released(now, status, error))

    # -- the node slots of a job of several nodes (fenced by the attempt number) ------------------
    def open_nodes(self, job_id: str, attempt: int, nnodes: int, owner: str) -> None:
        """The slots of a new attempt: node 0 held by ``owner``, the worker that claimed the job
        (the job's lease is its lease), the others free. The previous attempt's slots go."""
        self.session.execute(delete(JobNode).where(JobNode.job_id == job_id))
        rows = [
            {"job_id": job_id, "node": n, "attempt": attempt, "owner": owner if n == 0 else None} for n in range(nnodes)
        ]
        self.session.execute(insert(JobNode), rows)

    def claim_node(self, job_id: str, owner: str, lease: timedelta) -> tuple[int, int] | None:
        """A free slot of the job's running attempt, under a lease: (attempt, node), or None (the
        job is not running, or every slot is held)."""
        running = select(Job.attempt).where(Job.id == job_id, Job.status == JobStatus.RUNNING).scalar_subquery()
        free = select(JobNode.node).where(JobNode.job_id == job_id, JobNode.attempt == running, JobNode.owner.is_(None))
        for node in self.session.scalars(free.order_by(JobNode.node)).all():
            claimed = self.session.execute(
                update(JobNode)
                .where(
                    JobNode.job_id == job_id, JobNode.node == node, JobNode.owner.is_(None), JobNode.attempt == running
                )
                .values(owner=owner, lease_expires_at=utcnow() + lease)
                .returning(JobNode.attempt)
            ).scalar_one_or_none()
            if claimed is not None:
                return claimed, node
        return None

    def publish_meeting(self, job_id: str, attempt: int, rendezvous: str, run_id: str, report: str, token: str) -> bool:
        """Node 0 says where the others meet it."""
        stmt = update(JobNode).where(JobNode.job_id == job_id, JobNode.node == 0, JobNode.attempt == attempt)
        values = {"rendezvous": rendezvous, "run_id": run_id, "report": report, "token": token}
        return self.session.execute(stmt.values(**values)).rowcount == 1

    def nodes(self, job_id: str, attempt: int) -> list[JobNode]:
        query = select(JobNode).where(JobNode.job_id == job_id, JobNode.attempt == attempt)
        return list(self.session.scalars(query.order_by(JobNode.node)))

    def heartbeat_node(self, job_id: str, attempt: int, node: int, owner: str, lease: timedelta) -> bool:
        """Renew a slot's lease; False once the job has left this attempt (finished, given back,
        claimed again) or the slot is another's: the node must stop."""
        live = select(Job.id).where(Job.id == job_id, Job.attempt == attempt, Job.status.in_(RUNNING)).exists()
        stmt = update(JobNode).where(
            JobNode.job_id == job_id, JobNode.node == node, JobNode.attempt == attempt, JobNode.owner == owner, live
        )
        return self.session.execute(stmt.values(lease_expires_at=utcnow() + lease)).rowcount == 1

    def leave_node(self, job_id: str, attempt: int, node: int, owner: str) -> None:
        """A node that cannot go on lets its slot's lease lapse now (node 0 then gives the job back)."""
        stmt = update(JobNode).where(
            JobNode.job_id == job_id, JobNode.node == node, JobNode.attempt == attempt, JobNode.owner == owner
        )
        self.session.execute(stmt.values(lease_expires_at=utcnow()))

    def lost_nodes(self, job_id: str, attempt: int, now: datetime) -> list[int]:
        """The held slots of the attempt (node 0's aside: the job's lease is its) whose lease lapsed."""
        query = select(JobNode.node).where(
            JobNode.job_id == job_id, JobNode.attempt == attempt, JobNode.node > 0, JobNode.owner.is_not(None),
            JobNode.lease_expires_at < now,
        )  # fmt: skip
        return list(self.session.scalars(query.order_by(JobNode.node)))

    # -- writes by the reaper -------------------------------------------------------------------
    def expired_leases(self, now: datetime) -> Sequence[Job]:
        query = select(Job).where(Job.status.in_(RUNNING), Job.lease_expires_at < now)
        return list(self.session.scalars(query.order_by(Job.id)))

    def release_expired(self, job: Job, now: datetime, status: str, error: dict | None = None) -> bool:
        """A dead attempt's job: back to queued (to resume), or to its final state."""
        check_transition(RUNNING, status)
        stmt = (
            update(Job)
            .where(Job.id == job.id, Job.attempt == job.attempt, Job.status.in_(RUNNING), Job.lease_expires_at < now)
            .values(**_released(now, status, error))
        )
        return self.session.execute(stmt).rowcount == 1

    def stale_queued(self, before: datetime) -> list[Job]:
        """Queued jobs whose task was sent before ``before`` (lost, or not yet taken): their send
        time is reset, the caller re-sends."""
        # SKIP LOCKED: two reapers split the stale jobs instead of locking them in scan orders
        # that could cross (Postgres; SQLite serialises writers and has no row locks).
        stale = (
            select(Job.id)
            .where(Job.status == JobStatus.QUEUED, func.coalesce(Job.enqueued_at, Job.created_at) < before)
            .with_for_update(skip_locked=True)
        )
        result = self.session.scalars(
            update(Job)
            .where(Job.id.in_(stale), Job.status == JobStatus.QUEUED)
            .values(enqueued_at=utcnow())
            .returning(Job)
        )
        return list(result)

    def mark_enqueued(self, job_id: str) -> None:
        self.session.execute(update(Job).where(Job.id == job_id).values(enqueued_at=utcnow()))

    # -- events and checkpoints -------------------------------------------------------------------
    def add_event(self, job_id: str, kind: str, payload: dict[str, Any], step: int | None = None) -> dict[str, Any]:
        """Append an event to the job's log; returns it ({job_id, seq, step, kind, payload}). The
        seq comes from the job's row (UPDATE ... RETURNING: the row stays locked until commit, so a
        job's events commit in seq order and a reader never sees seq n + 1 without n)."""
        seq = self.session.execute(
            update(Job).where(Job.id == job_id).values(event_seq=Job.event_seq + 1).returning(Job.event_seq)
        ).scalar_one()
        event = {"job_id": job_id, "seq": seq, "step": step, "kind": kind, "payload": payload}
        self.session.execute(insert(JobEvent.__table__), event | {"created_at": utcnow()})
        return event

    def add_first_events(self, events: list[tuple[str, int, str, dict[str, Any]]]) -> None:
        """The first event (seq 1) of new jobs, (job id, step, kind, payload), in one statement: the
        jobs were inserted with ``event_seq`` 1."""
        if events:
            now = utcnow()
            rows = [
                {"job_id": j, "seq": 1, "step": step, "kind": k, "payload": p, "created_at": now}
                for j, step, k, p in events
            ]
            self.session.execute(insert(JobEvent.__table__), rows)

    def events(self, job_id: str, after_seq: int = 0, limit: int | None = None) -> list[JobEvent]:
        query = select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.seq > after_seq)
        return list(self.session.scalars(query.order_by(JobEvent.seq).limit(limit)))

    def add_checkpoint(
        self, job_id: str, attempt: int, step: int, path: str, nbytes: int, metrics: dict[str, float]
    ) -> None:
        existing = self.checkpoint(job_id, step)
        if existing is None:
            self.session.add(
                Checkpoint(job_id=job_id, attempt=attempt, step=step, path=path, bytes=nbytes, metrics=metrics)
            )
        else:  # a resumed attempt rewrote the same step: the file is the same path
            existing.attempt, existing.bytes, existing.metrics = attempt, nbytes, metrics

    def delete_checkpoints(self, job_id: str, steps: Sequence[int]) -> None:
        self.session.execute(delete(Checkpoint).where(Checkpoint.job_id == job_id, Checkpoint.step.in_(steps)))

    def checkpoint(self, job_id: str, step: int) -> Checkpoint | None:
        query = select(Checkpoint).where(Checkpoint.job_id == job_id, Checkpoint.step == step)
        return self.session.scalars(query).one_or_none()

    def checkpoints_page(self, job_id: str, limit: int, before_step: int | None) -> list[Checkpoint]:
        """Up to ``limit`` checkpoints, newest first, below ``before_step`` when given."""
        query = select(Checkpoint).where(Checkpoint.job_id == job_id)
        if before_step is not None:
            query = query.where(Checkpoint.step < before_step)
        return list(self.session.scalars(query.order_by(Checkpoint.step.desc()).limit(limit)))

    def checkpoints(self, job_id: str) -> list[Checkpoint]:
        query = select(Checkpoint).where(Checkpoint.job_id == job_id).order_by(Checkpoint.step.desc())
        return list(self.session.scalars(query))

    def warm_start_steps(self, job_id: str) -> set[int]:
        """The steps of the job's checkpoints that other jobs start from (their ``init_from``)."""
        return set(self.session.scalars(select(Job.parent_step).where(Job.parent_job_id == job_id)))

    def lock_shared(self, job_ids: Collection[str]) -> None:
        """Share-lock the jobs' rows in id order until the transaction ends (Postgres; SQLite
        serialises writers): a warm start's insert against its parent's checkpoint retention,
        which takes the parent's row for update before it deletes checkpoints."""
        if job_ids:
            query = select(Job.id).where(Job.id.in_(list(job_ids))).order_by(Job.id).with_for_update(read=True)
            self.session.execute(query)

    def existing_checkpoints(self, keys: Collection[tuple[str, int]]) -> set[tuple[str, int]]:
        """Which of these (job, step) checkpoints exist."""
        if not keys:
            return set()
        query = select(Checkpoint.job_id, Checkpoint.step).where(
            tuple_(Checkpoint.job_id, Checkpoint.step).in_(list(keys))
        )
        return {(job_id, step) for job_id, step in self.session.execute(query)}

    # -- helpers ------------------------------------------------------------------------------------
    def _cas(self, job_id: str, states: Collection[str], attempt: int | None = None, **values: Any) -> bool:
        """UPDATE the job if its status is one of ``states`` (and its attempt ``attempt``); whether it
        did. A change of status must be one that contract.status.TRANSITIONS allows from each."""
        if "status" in values:
            check_transition(states, values["status"])
        stmt = update(Job).where(Job.id == job_id, Job.status.in_(states))
        if attempt is not None:
            stmt = stmt.where(Job.attempt == attempt)
        return self.session.execute(stmt.values(**values)).rowcount == 1


def _released(now: datetime, status: str, error: dict | None) -> dict[str, Any]:
    """The values of a job whose attempt ended without finishing it: the lease dropped, and queued
    again (sent now) or final."""
    values: dict[str, Any] = {"status": status, "lease_owner": None, "lease_expires_at": None}
    if status == JobStatus.QUEUED:
        values["enqueued_at"] = now
    else:
        values.update(finished_at=now, error=error)
    return values
