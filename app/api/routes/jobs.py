"""/v1/jobs: thin routes over app.services.jobs (event_stream for the stream, routing for the parameter table)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Query, Request, Response
from fastapi.sse import EventSourceResponse

from app.api.deps import After, JobId, JobIntake, Work
from app.schemas import api as schemas
from app.schemas.routing import Routing
from app.services import event_stream
from app.services import jobs as service
from app.services import routing as routing_service
from app.services.metric_history import MAX_STEP
from contract.spec import NO_NUL, JobSpec
from contract.status import JobStatus

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])
ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": schemas.ErrorBody} for code in (401, 404, 409, 422, 429)}
# The errors of a route whose own answer is not JSON (the events stream): the same bodies, said to be JSON.
JSON_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {
        "description": "An error.",
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}},
    }
    for code in (401, 404, 422, 429)
}


REPLAY = {"model": schemas.Job, "description": "A replay of an `Idempotency-Key` with the same body: its job."}


@router.post(
    "",
    status_code=201,
    response_model=schemas.Job,
    responses={200: REPLAY, **ERRORS, 403: ERRORS[401], 413: ERRORS[401]},
)
async def create_job(
    spec: JobSpec,
    work: Work,
    intake: JobIntake,
    response: Response,
    idempotency_key: Annotated[str | None, Header(alias="Idempotency-Key", min_length=1, max_length=200)] = None,
) -> schemas.Job:
    """Validate a JobSpec, store it and queue it.

    A replay with the same `Idempotency-Key` and body answers 200 with the same job; the same key
    with another body is 409.
    """
    job, created = await intake.submit_job(work, spec, idempotency_key)
    response.status_code = 201 if created else 200
    return schemas.Job.of(job)


@router.get("", response_model=schemas.JobList, responses=ERRORS)
async def list_jobs(
    work: Work,
    status: JobStatus | None = None,
    limit: Annotated[int, Query(ge=1, le=service.MAX_LIMIT)] = 20,
    after: After = None,
    trials: Annotated[
        bool | None, Query(description="false: leave out sweeps' trials; true: only them; omitted: every job.")
    ] = None,
) -> schemas.JobList:
    """Newest first. Pass the previous page's `next_after` as `after`."""
    return await work(service.list_jobs, limit, after, status, trials)


@router.get("/{job_id}", response_model=schemas.Job, responses=ERRORS)
async def get_job(job_id: JobId, work: Work) -> schemas.Job:
    """The job; while it is queued, `queue_position` says how many queued jobs are ahead of it."""
    return await work(service.show_job, job_id)


@router.post("/{job_id}/cancel", response_model=schemas.Job, responses=ERRORS)
async def cancel_job(job_id: JobId, work: Work) -> schemas.Job:
    """Queued: cancelled at once. Running: `cancelling` until the worker stops. Finished: 409."""
    return schemas.Job.of(await work(service.cancel_job, job_id, work.bus))


@router.get("/{job_id}/metrics", response_model=schemas.MetricHistory, responses=ERRORS)
async def job_metrics(
    job_id: JobId,
    work: Work,
    names: Annotated[
        str | None, Query(pattern=NO_NUL, description="Comma-separated metric names; all when omitted.")
    ] = None,
    max_points: Annotated[int, Query(ge=3, le=100_000, description="Real points per series, at most.")] = 1000,
    from_step: Annotated[int | None, Query(ge=0, le=MAX_STEP)] = None,
    to_step: Annotated[int | None, Query(ge=0, le=MAX_STEP)] = None,
) -> schemas.MetricHistory:
    """History, downsampled on the server.

    A series with more than `max_points` points in the range is cut into about `max_points / 3`
    step buckets, each keeping its min, max and last point, so spikes survive.
    """
    return await work(service.metric_history, job_id, names, max_points, from_step, to_step)


@router.get("/{job_id}/routing", response_model=Routing, responses=ERRORS)
async def job_routing(job_id: JobId, work: Work) -> Routing:
    """Where each parameter of the job's model goes, Muon or AdamW, and by which rule.

    The table of the model the latest attempt built (a resumed job records it again): every
    parameter once, its shape, optimizer and role, each optimizer's share, and the warnings of the
    job's log (matrices whose role no rule knows, which AdamW takes). Before a worker has built the
    model, `state` is `awaiting` (queued, or starting) with no parameters; `unavailable` for a job that ended
    without one.
    """
    return await work(routing_service.job_routing, job_id)


EVENT_ID = r"^[0-9]{0,19}$"


async def event_cursor(
    last_event_id: Annotated[
        str, Header(alias="Last-Event-ID", pattern=EVENT_ID, description="The last event's id: resume after it.")
    ] = "",
    after: Annotated[
        str,
        Query(
            alias="last_event_id",
            pattern=EVENT_ID,
            description="The same as `Last-Event-ID`, for a client that cannot set headers (a browser opening a "
            "new EventSource); the header wins.",
        ),
    ] = "",
    from_step: Annotated[
        int | None, Query(ge=0, le=MAX_STEP, description="Telemetry from this step on (job events: all).")
    ] = None,
) -> event_stream.Cursor:
    """Resume after the last event received (the header, else the query), telemetry from ``from_step``.

    The telemetry starts at ``from_step`` at the earliest: an id sent on a stream opened with
    ``from_step`` is never behind it, so the browser's own reconnects are unchanged.
    """
    cursor = event_stream.Cursor.parse(last_event_id or after, "Last-Event-ID" if last_event_id else "last_event_id")
    cursor.next_step = max(cursor.next_step, from_step or 0)
    return cursor


async def first_page(
    job_id: JobId, work: Work, cursor: Annotated[event_stream.Cursor, Depends(event_cursor)]
) -> event_stream.Page:
    """The stream's first page, once the job is known to be the tenant's, in one unit of work.

    Another tenant's job answers 404 before any event is sent. The tenant's stream slot is not
    taken here: the edge (app.api.limits) takes it before routing and holds it until the stream
    ends, so a burst beyond the cap never gets this far.
    """
    return await work(event_stream.first_page, job_id, cursor)


@router.get("/{job_id}/events", response_class=EventSourceResponse, responses=JSON_ERRORS)
async def job_events(
    request: Request,
    work: Work,
    job_id: JobId,
    first: Annotated[event_stream.Page, Depends(first_page)],
    cursor: Annotated[event_stream.Cursor, Depends(event_cursor)],
):
    """The job's events as Server-Sent Events, from the first or after the last one received.

    `status` (the Job), `metrics` ({step, metrics}, one per telemetry step), `checkpoint` ({step,
    bytes}), `log` ({level, message}), `sample` ({step, prompt, text}, at evaluations), then `done`
    once the job has finished. Reconnect with `Last-Event-ID` (or `?last_event_id=`, for a new
    EventSource) to resume exactly after the last event received. A finished job's stream replays
    its history and ends. `from_step` skips the telemetry before it (a page that has drawn the
    history follows from there). A `: ping` comment comes every 15 s. The key is checked again
    every `MUONFORGE_AUTH_CACHE_SECONDS`: once it is revoked, the stream ends without `done` and a
    reconnect answers 401.
    """
    state = request.app.state
    stream = event_stream.follow(state.settings, state.live_reader, job_id, cursor, first, work.in_thread)
    async for event in event_stream.while_key_valid(stream, work.key_still_valid, state.settings.auth_cache_seconds):
        yield event
