"""All SQL about leases: a worker attempt's on its job, and the node slots of a job of several nodes.

The job's lease is taken by the claim (a status change of app.repositories.jobs), renewed here and
found lapsed by the reaper; each node slot (``job_nodes``) has a lease of its own. Every write is
fenced by the attempt number.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta

from sqlalchemy import Row, delete, insert, select, update
from sqlalchemy.orm import Session

from app.db.base import utcnow
from app.db.models import Dataset, Job, JobNode
from app.repositories.statements import changed_rows
from contract.status import RUNNING, JobStatus


class LeaseRepository:
    def __init__(self, session: Session) -> None:
        self.session = session

    # -- the job's lease --------------------------------------------------------------------------
    def heartbeat(self, job_id: str, attempt: int, lease: timedelta) -> bool:
        """Renew the lease; False means this attempt no longer owns the job and must stop."""
        now = utcnow()
        stmt = update(Job).where(Job.id == job_id, Job.status.in_(RUNNING), Job.attempt == attempt)
        return changed_rows(self.session, stmt.values(lease_expires_at=now + lease, heartbeat_at=now)) == 1

    def dataset_object(self, job_id: str) -> Row[str, str, int, str] | None:
        """The store object of the job's dataset: its id, key (the row's path), bytes and sha256;
        None for a job without one (a builtin corpus) or whose dataset's row is gone."""
        query = select(Dataset.id, Dataset.path, Dataset.bytes, Dataset.sha256).join(Job, Job.dataset_id == Dataset.id)
        return self.session.execute(query.where(Job.id == job_id)).one_or_none()

    def expired_leases(self, now: datetime) -> Sequence[Job]:
        query = select(Job).where(Job.status.in_(RUNNING), Job.lease_expires_at < now)
        return list(self.session.scalars(query.order_by(Job.id)))

    # -- the node slots of a job of several nodes -------------------------------------------------
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
        return changed_rows(self.session, stmt.values(**values)) == 1

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
        return changed_rows(self.session, stmt.values(lease_expires_at=utcnow() + lease)) == 1

    def leave_node(self, job_id: str, attempt: int, node: int, owner: str) -> None:
        """A node that cannot go on lets its slot's lease lapse now (node 0 then gives the job back)."""
        stmt = update(JobNode).where(
            JobNode.job_id == job_id, JobNode.node == node, JobNode.attempt == attempt, JobNode.owner == owner
        )
        self.session.execute(stmt.values(lease_expires_at=utcnow()))

    def lost_nodes(self, job_id: str, attempt: int, now: datetime) -> list[int]:
        """The held slots of the attempt (node 0's aside: the job's lease is its) whose lease lapsed."""
        query = select(JobNode.node).where(
            JobNode.job_id == job_id,
            JobNode.attempt == attempt,
            JobNode.node > 0,
            JobNode.owner.is_not(None),
            JobNode.lease_expires_at < now,
        )
        return list(self.session.scalars(query.order_by(JobNode.node)))
