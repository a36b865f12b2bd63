"""A job's events, each recorded in its change's transaction and published once that commits.

Events are status changes, checkpoints, log lines and text samples; one whose transaction rolls
back is never published. Every writer of a job event goes through here: the job lifecycle
(app.services.lifecycle: a new job's first status and every status change) and a worker
attempt's telemetry sink (checkpoints, logs, samples). The event's seq comes from the job's row
(locked until commit), so a job's events commit in seq order; the events stream
(app.services.event_stream) replays them from the database and tails them from the bus. A final
status also queues the job's webhook deliveries (app.services.webhooks) in its transaction: the
one place every job's end passes.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from sqlalchemy.orm import Session

from app.db.models import Job
from app.db.session import on_commit
from app.messaging.live_bus import LiveBus
from app.repositories.checkpoints import CheckpointRepository
from app.repositories.job_events import JobEventRepository
from app.repositories.jobs import JobRepository
from app.repositories.metrics import MetricRepository
from app.schemas import api as schemas
from app.services import webhooks
from app.storage import Staged
from contract import metrics
from contract.status import is_finished
from contract.webhooks import job_event_type


def record_status(session: Session, bus: LiveBus, job_id: str) -> Job:
    """Record the job's current state as a ``status`` event (the Job as the API shows it), and for
    a final state its webhook deliveries (``job.succeeded`` ...); returns the job. Called once per
    change (after a compare-and-set that changed the row), so an event is queued once. The row is
    read again first: a compare-and-set UPDATE bypasses loaded objects."""
    job = JobRepository(session).fresh(job_id)
    payload = status_payload(job, MetricRepository(session).last_steps([job_id], metrics.VAL_LOSS).get(job_id))
    _record(session, bus, job_id, "status", payload, step=job.progress_step)
    if is_finished(job.status) and (event_type := job_event_type(job.status)) is not None:
        webhooks.enqueue(session, job.tenant_id, event_type, payload)
    return job


def record_checkpoint(
    session: Session,
    bus: LiveBus,
    job_id: str,
    attempt: int,
    step: int,
    stored: Staged,
    key: str,
    metrics: dict[str, float],
    position: int,
) -> None:
    """Record a checkpoint written after ``step`` steps (the store's object at ``key``, of the size
    and sha256 ``stored``), with every metric's latest value, and its ``checkpoint`` event, which
    streams before the telemetry step ``position`` (the first step not yet published)."""
    nbytes = stored.size
    CheckpointRepository(session).add_checkpoint(job_id, attempt, step, key, nbytes, stored.sha256, metrics)
    _record(session, bus, job_id, "checkpoint", {"step": step, "bytes": nbytes}, step=position)


def record_log(session: Session, bus: LiveBus, job_id: str, level: str, message: str, step: int | None) -> None:
    """A human-readable line (``log`` event)."""
    _record(session, bus, job_id, "log", {"level": level, "message": message}, step=step)


def record_sample(session: Session, bus: LiveBus, job_id: str, step: int, prompt: str, text: str) -> None:
    """What the model wrote from the fixed prompt at an evaluation after ``step`` steps (``sample``
    event). Postgres's JSON holds no NUL character: one the model wrote is stored as U+FFFD."""
    prompt, text = prompt.replace("\x00", "\ufffd"), text.replace("\x00", "\ufffd")
    _record(session, bus, job_id, "sample", {"step": step, "prompt": prompt, "text": text}, step=step)


def record_first_statuses(session: Session, jobs: list[Job]) -> None:
    """The first event (seq 1) of jobs just inserted with ``event_seq`` 1, in one statement. Not
    published: nobody can follow a job before its insert has committed."""
    JobEventRepository(session).add_first_events([(job.id, 0, "status", status_payload(job)) for job in jobs])


def status_payload(job: Job, val_loss_step: int | None = None) -> dict[str, Any]:
    """The Job as the API shows it (its place in the queue aside: read when asked for)."""
    return schemas.Job.of(job, val_loss_step=val_loss_step).model_dump(mode="json")


def _record(session: Session, bus: LiveBus, job_id: str, kind: str, payload: dict[str, Any], step: int | None) -> None:
    event = JobEventRepository(session).add_event(job_id, kind, payload, step)
    if bus.live:
        on_commit(session, partial(bus.publish_events, [event]))
