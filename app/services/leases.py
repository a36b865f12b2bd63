"""A worker attempt's hold on its job between its claim and its end: leases and node slots.

The lease is renewed here; for a job of several nodes (gang-scheduled, worker.gang) the other
workers take node slots, and node 0 publishes their meeting point. Every write is fenced by the
attempt number. Services never commit.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from sqlalchemy.orm import Session

from app.db.base import utcnow
from app.db.models import JobNode
from app.repositories.jobs import JobRepository
from app.repositories.leases import LeaseRepository
from app.services import lifecycle
from contract.spec import JobSpec


@dataclass(frozen=True)
class DatasetObject:
    """A job's uploaded corpus as the artifact store holds it, and as its row records it."""

    id: str
    key: str  # the row's path: relative to the artifact dir, the object's key in a bucket
    bytes: int
    sha256: str


@dataclass(frozen=True)
class NodeClaim:
    """A node slot of a running attempt, taken by another worker than node 0's."""

    attempt: int
    node: int
    spec: JobSpec
    dataset: DatasetObject | None  # the corpus; None for a builtin corpus
    model: lifecycle.ModelObjects | None = None  # model.hf.model_id's files (None: none, or deleted since)


@dataclass(frozen=True)
class Gang:
    """The node slots of an attempt, and whether a cancel was asked of its job."""

    nodes: list[JobNode]
    cancel: bool


def dataset_object(session: Session, job_id: str) -> DatasetObject | None:
    """The store object of the job's dataset (read by node 0 in its claim's transaction, by another
    node in its join's); None for a builtin corpus, or once the dataset's row is gone."""
    row = LeaseRepository(session).dataset_object(job_id)
    return DatasetObject(*row) if row is not None else None


def renew(session: Session, job_id: str, attempt: int, lease: timedelta, nnodes: int = 1) -> list[int] | None:
    """Renew the attempt's lease on its job: None once the attempt no longer holds it (it must
    stop), else the nodes of a job of several whose slot lease lapsed (node 0's aside)."""
    repo = LeaseRepository(session)
    if not repo.heartbeat(job_id, attempt, lease):
        return None
    return repo.lost_nodes(job_id, attempt, utcnow()) if nnodes > 1 else []


def renew_node(session: Session, job_id: str, attempt: int, node: int, owner: str, lease: timedelta) -> bool:
    """Renew the lease of a node slot (not node 0's); False once the job has left this attempt or
    the slot is another's: the node must stop."""
    return LeaseRepository(session).heartbeat_node(job_id, attempt, node, owner, lease)


def join(session: Session, job_id: str, owner: str, lease: timedelta) -> NodeClaim | None:
    """A free slot of the job's running attempt, taken by ``owner`` under a lease; None if the job
    is not running or every slot is held."""
    claimed = LeaseRepository(session).claim_node(job_id, owner, lease)
    if claimed is None:
        return None
    job = JobRepository(session).get(job_id)
    if job is None:  # the slot is the job's: it is there
        return None
    spec = JobSpec.model_validate(job.spec)
    return NodeClaim(*claimed, spec, dataset_object(session, job_id), lifecycle.uploaded_model(session, job))


def publish_meeting(
    session: Session, job_id: str, attempt: int, rendezvous: str, run_id: str, report: str, token: str
) -> bool:
    """Node 0 says where the others meet it; False once the attempt's slots are gone."""
    return LeaseRepository(session).publish_meeting(job_id, attempt, rendezvous, run_id, report, token)


def gang(session: Session, job_id: str, attempt: int) -> Gang:
    """The attempt's node slots as they stand, and the job's cancel flag."""
    return Gang(LeaseRepository(session).nodes(job_id, attempt), JobRepository(session).cancel_requested(job_id))


def leave(session: Session, job_id: str, attempt: int, node: int, owner: str) -> None:
    """A node that cannot go on lets its slot's lease lapse now (node 0 then gives the job back)."""
    LeaseRepository(session).leave_node(job_id, attempt, node, owner)
