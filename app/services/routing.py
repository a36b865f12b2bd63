"""A job's parameter routing: the table its worker recorded (worker.sink.JobSink.routing), as the API shows it."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from sqlalchemy.orm import Session

from app.db.models import Job
from app.repositories.jobs import JobRepository
from app.schemas.routing import OptimizerShare, RoutedParameter, Routing, RoutingSummary
from app.services.auth import TenantRef
from app.services.jobs import get_job
from contract.status import JobStatus


def job_routing(session: Session, tenant: TenantRef, job_id: str) -> Routing:
    """The routing table of the model the job's latest attempt built; state awaiting or unavailable before one did."""
    job = get_job(session, tenant, job_id)
    stored = JobRepository(session).routing(job.id)
    optimizer = str(job.spec["optimizer"]["name"])
    return not_recorded(job, optimizer) if stored is None else recorded(job.id, optimizer, stored)


def not_recorded(job: Job, optimizer: str) -> Routing:
    """The answer for a job with no table: awaiting while a worker may still build its model, else unavailable."""
    state, message = why_not_recorded(job)
    return Routing(
        job_id=job.id,
        state=state,
        message=message,
        optimizer=optimizer,
        attempt=None,
        parameters=[],
        summary=None,
        warnings=[],
    )


def why_not_recorded(job: Job) -> tuple[str, str]:
    """(state, message) of a job with no table: it ended without one, has not started, or is starting."""
    if JobStatus(job.status).finished:
        return "unavailable", f"job {job.id} ended ({job.status}) before a worker recorded its routing"
    if job.attempt == 0:
        return "awaiting", f"job {job.id} has not started: its routing is known once a worker builds its model"
    return "awaiting", f"job {job.id} is starting: its routing is known once its worker builds the model"


def recorded(job_id: str, optimizer: str, stored: dict[str, Any]) -> Routing:
    """The API's answer from the stored table: each row with its value count, each optimizer's share."""
    rows = [parameter(row) for row in stored["parameters"]]
    return Routing(
        job_id=job_id,
        state="recorded",
        message=None,
        optimizer=optimizer,
        attempt=stored["attempt"],
        parameters=rows,
        summary=RoutingSummary(
            muon=share(r for r in rows if r.optimizer == "muon"),
            adamw=share(r for r in rows if r.optimizer == "adamw"),
            total=share(rows),
        ),
        warnings=[r.warning for r in rows if r.warning],
    )


def parameter(row: dict[str, Any]) -> RoutedParameter:
    """A stored row (worker.engine.optimizer.RoutedParameter) with its number of values."""
    return RoutedParameter(**row, values=math.prod(row["shape"]))


def share(rows: Iterable[RoutedParameter]) -> OptimizerShare:
    """How many parameters, and how many values, ``rows`` hold."""
    taken = list(rows)
    return OptimizerShare(parameters=len(taken), values=sum(r.values for r in taken))
