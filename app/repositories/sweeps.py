"""All SQL about sweeps: the sweep, its trials and its ASHA rung decisions.

The sweep's row is the lock of its decisions (``lock``: ``SELECT ... FOR UPDATE`` on Postgres;
SQLite's one writer at a time serializes instead): which trials start next, and each rung's
decision. It is taken before the tenant's row (the job cap), never after: a transaction that
changes a job's status (job row, then tenant row, by trigger) does not lock a sweep."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from sqlalchemy import func, insert, select, update
from sqlalchemy.orm import Session

from app.db.base import utcnow
from app.db.models import Job, Sweep, SweepRung, SweepTrial
from app.repositories.statements import changed_rows
from contract.status import ACTIVE, FINISHED, JobStatus, SweepStatus


class SweepRepository:
    def __init__(self, session: Session) -> None:
        self.session = session

    # -- reads ------------------------------------------------------------------------------------
    def get(self, sweep_id: str, tenant_id: str) -> Sweep | None:
        query = select(Sweep).where(Sweep.id == sweep_id, Sweep.tenant_id == tenant_id)
        return self.session.scalars(query).one_or_none()

    def page(self, tenant_id: str, limit: int, after: str | None, status: str | None = None) -> list[Sweep]:
        """Newest first; ``limit + 1`` rows so the caller can tell whether there is more."""
        query = select(Sweep).where(Sweep.tenant_id == tenant_id)
        if status:
            query = query.where(Sweep.status == status)
        if after:
            query = query.where(Sweep.id < after)
        return list(self.session.scalars(query.order_by(Sweep.id.desc()).limit(limit + 1)))

    def by_idempotency_key(self, tenant_id: str, key: str) -> Sweep | None:
        query = select(Sweep).where(Sweep.tenant_id == tenant_id, Sweep.idempotency_key == key)
        return self.session.scalars(query).one_or_none()

    def lock(self, sweep_id: str, skip_locked: bool = False) -> Sweep | None:
        """The sweep's row, locked until the transaction ends and read as committed now; None if
        it is gone, or (``skip_locked``) if another transaction holds it."""
        query = select(Sweep).where(Sweep.id == sweep_id).with_for_update(skip_locked=skip_locked)
        return self.session.scalars(query.execution_options(populate_existing=True)).one_or_none()

    def running_ids(self) -> list[str]:
        return list(self.session.scalars(select(Sweep.id).where(Sweep.status == SweepStatus.RUNNING)))

    def trials(self, sweep_ids: Collection[str]) -> dict[str, list[tuple[SweepTrial, Job | None]]]:
        """Each sweep's trials in order, with their jobs (one query for a page of sweeps)."""
        found: dict[str, list[tuple[SweepTrial, Job | None]]] = {s: [] for s in sweep_ids}
        if sweep_ids:
            query = (
                select(SweepTrial, Job)
                .outerjoin(Job, Job.id == SweepTrial.job_id)
                .where(SweepTrial.sweep_id.in_(list(sweep_ids)))
                .order_by(SweepTrial.sweep_id, SweepTrial.number)
                .execution_options(populate_existing=True)  # as committed now: a trial started in this transaction
            )
            for trial, job in self.session.execute(query):
                found[trial.sweep_id].append((trial, job))
        return found

    def pending(self, sweep_id: str, limit: int) -> list[SweepTrial]:
        """The trials not started yet, first number first."""
        query = select(SweepTrial).where(
            SweepTrial.sweep_id == sweep_id, SweepTrial.job_id.is_(None), SweepTrial.error.is_(None)
        )
        return list(self.session.scalars(query.order_by(SweepTrial.number).limit(limit)))

    def active_trials(self, sweep_id: str) -> int:
        """The sweep's trials queued or running now."""
        query = select(func.count()).where(Job.sweep_id == sweep_id, Job.status.in_(ACTIVE))
        return self.session.scalar(query) or 0

    def unfinished_jobs(self, sweep_id: str, lock: bool = False) -> list[Job]:
        """The sweep's jobs not finished, by id (locked in that order with ``lock``)."""
        query = select(Job).where(Job.sweep_id == sweep_id, Job.status.not_in(FINISHED)).order_by(Job.id)
        if lock:
            query = query.with_for_update().execution_options(populate_existing=True)
        return list(self.session.scalars(query))

    def rung(self, job_id: str, rung: int) -> SweepRung | None:
        query = select(SweepRung).where(SweepRung.job_id == job_id, SweepRung.rung == rung)
        return self.session.scalars(query).one_or_none()

    def rung_values(self, sweep_id: str, rung: int) -> list[float]:
        """The values recorded at a rung of the sweep, in the order they were recorded."""
        query = select(SweepRung.value).where(SweepRung.sweep_id == sweep_id, SweepRung.rung == rung)
        return list(self.session.scalars(query.order_by(SweepRung.position)))

    def paused_jobs(self, sweep_id: str) -> set[str]:
        """The sweep's trials waiting at a rung (their jobs paused)."""
        query = select(Job.id).where(Job.sweep_id == sweep_id, Job.status == JobStatus.PAUSED)
        return set(self.session.scalars(query))

    def rungs(self, sweep_ids: Collection[str]) -> list[SweepRung]:
        """Every decision of the sweeps, by rung then position."""
        if not sweep_ids:
            return []
        query = select(SweepRung).where(SweepRung.sweep_id.in_(list(sweep_ids)))
        return list(self.session.scalars(query.order_by(SweepRung.rung, SweepRung.position)))

    # -- writes -----------------------------------------------------------------------------------
    def add(self, sweep: Sweep, trials: list[dict[str, Any]]) -> Sweep:
        """The sweep and its trials (rows of SweepTrial's columns but ``job_id`` and ``error``,
        both NULL until it starts, in one statement)."""
        self.session.add(sweep)
        self.session.flush()
        self.session.execute(insert(SweepTrial.__table__), [t | {"sweep_id": sweep.id} for t in trials])
        return sweep

    def start_trial(self, sweep_id: str, number: int, job_id: str | None, error: dict | None = None) -> None:
        """The trial's job once created, or the error that kept it from starting (``error`` stays
        SQL NULL otherwise: a JSON column would store None as a JSON null)."""
        stmt = update(SweepTrial).where(SweepTrial.sweep_id == sweep_id, SweepTrial.number == number)
        self.session.execute(stmt.values(job_id=job_id, **({"error": error} if error is not None else {})))

    def finish(self, sweep_id: str, status: str) -> bool:
        """running -> ``status`` (completed, cancelled); whether it changed."""
        stmt = update(Sweep).where(Sweep.id == sweep_id, Sweep.status == SweepStatus.RUNNING)
        return changed_rows(self.session, stmt.values(status=status, finished_at=utcnow())) == 1

    def mark_promoted(self, rung_id: int) -> None:
        self.session.execute(update(SweepRung).where(SweepRung.id == rung_id).values(promoted_at=utcnow()))

    def add_rung(self, sweep_id: str, job_id: str, rung: int, position: int, value: float, go_on: bool) -> SweepRung:
        row = SweepRung(
            sweep_id=sweep_id,
            job_id=job_id,
            rung=rung,
            position=position,
            value=value,
            go_on=go_on,
            created_at=utcnow(),
        )
        self.session.add(row)
        self.session.flush()
        return row
