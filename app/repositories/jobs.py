"""All SQL about a job's row: reads, inserts, and its status.

The status changes in one place, ``change_status``: a compare-and-set UPDATE that names its rule
of contract.status.TRANSITIONS and the states it may leave (and, for a worker, its attempt
number: the fencing token), so a stale writer changes nothing and learns so from the row count.
Its caller is app.services.lifecycle. A job's events, checkpoints and leases have repositories of
their own (job_events, checkpoints, leases).

A change into or out of contract.status.ACTIVE also updates the tenant's ``active_jobs``, by
trigger (migration 0005), in its transaction: it locks the job's row, then the tenant's. So a
transaction changes the status of one existing job at most, and locks no tenant before it: two
such changes in one transaction, or a tenant's lock then a change, can wait in a cycle on
another transaction that takes the same rows in another order (Postgres then aborts one).
"""

from __future__ import annotations

from collections.abc import Collection
from datetime import datetime
from typing import Any

from sqlalchemy import func, select, tuple_, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from app.db.base import utcnow
from app.db.models import Job
from app.repositories.statements import changed_rows
from contract.status import FINISHED, INITIAL, RULES, RUNNING, IllegalTransition, JobStatus, check_transition


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

    def held(self, job_id: str, attempt: int) -> Job | None:
        """The job's row, locked until the transaction ends, while ``attempt`` still holds it; None
        once it does not (the fence of a write that is not an update of the row itself)."""
        job = self.locked(job_id)
        return job if job is not None and job.status in RUNNING and job.attempt == attempt else None

    def page(
        self, tenant_id: str, limit: int, after: str | None, status: str | None, trials: bool | None = None
    ) -> list[Job]:
        """Newest first; ``limit + 1`` rows so the caller can tell whether there is more. ``trials``:
        False leaves out sweeps' trials, True keeps only them."""
        query = select(Job).where(Job.tenant_id == tenant_id)
        if status:
            query = query.where(Job.status == status)
        if trials is not None:
            query = query.where(Job.sweep_id.is_not(None) if trials else Job.sweep_id.is_(None))
        if after:
            query = query.where(Job.id < after)
        return list(self.session.scalars(query.order_by(Job.id.desc()).limit(limit + 1)))

    def queued_ahead(self, job: Job) -> int:
        """The queued jobs of ``job``'s queue, every tenant's, submitted before it (ids sort by
        creation time): those the workers of that queue take first."""
        query = select(func.count()).where(Job.status == JobStatus.QUEUED, Job.queue == job.queue, Job.id < job.id)
        return self.session.scalar(query) or 0

    def by_idempotency_key(self, tenant_id: str, key: str) -> Job | None:
        query = select(Job).where(Job.tenant_id == tenant_id, Job.idempotency_key == key)
        return self.session.scalars(query).one_or_none()

    def by_idempotency_keys(self, keys: Collection[tuple[str, str]]) -> dict[tuple[str, str], Job]:
        """The jobs that hold these (tenant, Idempotency-Key) pairs, by pair."""
        if not keys:
            return {}
        query = select(Job).where(tuple_(Job.tenant_id, Job.idempotency_key).in_(list(keys)))
        jobs = self.session.scalars(query)
        return {(job.tenant_id, job.idempotency_key): job for job in jobs if job.idempotency_key is not None}

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

    def routing(self, job_id: str) -> dict[str, Any] | None:
        """The job's parameter routing table as its latest attempt recorded it; None before that."""
        return self.session.scalar(select(Job.routing).where(Job.id == job_id))

    def cancel_requested(self, job_id: str) -> bool:
        return bool(self.session.scalar(select(Job.cancel_requested).where(Job.id == job_id)))

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

    def lock_shared(self, job_ids: Collection[str]) -> None:
        """Share-lock the jobs' rows in id order until the transaction ends (Postgres; SQLite
        serialises writers): a warm start's insert against its parent's checkpoint retention,
        which takes the parent's row for update before it deletes checkpoints."""
        if job_ids:
            query = select(Job.id).where(Job.id.in_(list(job_ids))).order_by(Job.id).with_for_update(read=True)
            self.session.execute(query)

    # -- writes ---------------------------------------------------------------------------------------
    def insert_new(self, rows: list[dict[str, Any]]) -> set[str]:
        """INSERT new jobs (rows with the same keys, ids included, each in contract.status.INITIAL)
        in one statement; a row whose (tenant, Idempotency-Key) exists already is skipped. Returns
        the ids inserted."""
        if not rows:
            return set()
        if born := sorted({str(row["status"]) for row in rows} - {INITIAL}):
            raise IllegalTransition(f"a new job is {INITIAL}, not {', '.join(born)}")
        dialect = postgresql if self.session.get_bind().dialect.name == "postgresql" else sqlite
        stmt = (
            dialect.insert(Job.__table__)
            .on_conflict_do_nothing(index_elements=["tenant_id", "idempotency_key"])
            .returning(Job.__table__.c.id)
        )
        return set(self.session.scalars(stmt, rows))

    def change_status(
        self,
        job_id: str,
        rule: str,
        target: str,
        *,
        sources: Collection[str] | None = None,
        attempt: int | None = None,
        now: datetime | None = None,
        lapsed: bool = False,
        **values: Any,
    ) -> int | None:
        """Move the job to ``target`` by the rule named ``rule`` if its status is one of
        ``sources`` (the rule's, unless narrowed), its attempt is ``attempt`` (a worker's fencing
        token) and, with ``lapsed``, its lease lapsed before ``now``; ``values`` are the other
        columns to set. Returns the job's attempt number after the change, or None where the row
        was not in that state and nothing changed (test it with ``is None``: a job never claimed
        has attempt 0). A change the rule does not name, or contract.status.ALLOWED refuses, is
        IllegalTransition before any SQL.

        The columns the change itself implies are set here: a claim starts a new attempt; a job
        that leaves its worker drops the lease; one queued again is sent at ``now``, a final one
        finished at ``now``; a promotion is no restart after a lost worker (``max_restarts``,
        which the reaper compares with the attempt number, grows by one with it), and its undo
        takes that back."""
        named = RULES.get(rule)
        if named is None:
            raise IllegalTransition(f"no rule named {rule!r} in contract.status.TRANSITIONS")
        leaving = named.sources if sources is None else frozenset(JobStatus(s) for s in sources)
        target = JobStatus(target)
        if not leaving <= named.sources or target not in named.targets:
            origin = ", ".join(sorted(leaving))
            raise IllegalTransition(f"the rule {rule} does not take a job from {origin} to {target}")
        check_transition(leaving, target)
        if "status" in values:
            raise TypeError("the status is the target, not a value")
        now = now or utcnow()
        stmt = update(Job).where(Job.id == job_id, Job.status.in_(leaving))
        if attempt is not None:
            stmt = stmt.where(Job.attempt == attempt)
        if lapsed:
            stmt = stmt.where(Job.lease_expires_at < now)
        implied = _implied(rule, leaving, target, now)
        stmt = stmt.values(status=target, **(implied | values)).returning(Job.attempt)
        return self.session.execute(stmt).scalar_one_or_none()

    def record_progress(self, job_id: str, attempt: int, step: int, summary: dict[str, Any]) -> bool:
        """The attempt's steps completed and summary so far (fenced); False once it no longer
        holds the job."""
        stmt = update(Job).where(Job.id == job_id, Job.status.in_(RUNNING), Job.attempt == attempt)
        return changed_rows(self.session, stmt.values(progress_step=step, summary=summary)) == 1

    def record_routing(self, job_id: str, attempt: int, routing: dict[str, Any]) -> bool:
        """The attempt's parameter routing table, in place of an earlier attempt's (fenced); False
        once it no longer holds the job."""
        stmt = update(Job).where(Job.id == job_id, Job.status.in_(RUNNING), Job.attempt == attempt)
        return changed_rows(self.session, stmt.values(routing=routing)) == 1

    def forget_dataset(self, tenant_id: str, dataset_id: str) -> None:
        """Unlink the tenant's finished jobs from a dataset about to be deleted (their spec still
        names it); an unfinished job keeps its link, and the foreign key refuses the delete."""
        query = update(Job).where(Job.tenant_id == tenant_id, Job.dataset_id == dataset_id, Job.status.in_(FINISHED))
        self.session.execute(query.values(dataset_id=None))

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


def _implied(rule: str, sources: frozenset[JobStatus], target: JobStatus, now: datetime) -> dict[str, Any]:
    """The columns a status change sets by itself (``change_status``)."""
    values: dict[str, Any] = {}
    if rule == "claim":  # a new attempt, numbered: its number fences every later write of it
        values.update(attempt=Job.attempt + 1, heartbeat_at=now, started_at=func.coalesce(Job.started_at, now))
    elif rule == "promote":
        values["max_restarts"] = Job.max_restarts + 1
    elif rule == "unpromote":
        values["max_restarts"] = Job.max_restarts - 1
    if sources <= RUNNING and target not in RUNNING:  # off its worker
        values.update(lease_owner=None, lease_expires_at=None)
    if target == JobStatus.QUEUED:
        values["enqueued_at"] = now
    if target in FINISHED:
        values["finished_at"] = now
    return values
