"""All SQL about job events.

A job's log of status changes, checkpoints, log lines and samples, numbered per job
(app.services.job_journal writes them).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import insert, select, update
from sqlalchemy.orm import Session

from app.db.base import utcnow
from app.db.models import Job, JobEvent


class JobEventRepository:
    def __init__(self, session: Session) -> None:
        self.session = session

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
