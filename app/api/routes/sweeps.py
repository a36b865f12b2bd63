"""/v1/sweeps: hyperparameter sweeps, thin routes over app.services.sweeps (trials are ordinary jobs)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Query, Response

from app.api.deps import After, SweepId, Work
from app.api.routes.jobs import ERRORS
from app.schemas import api as schemas
from app.schemas.sweep import SweepSpec
from app.services import sweeps as service
from contract.status import SweepStatus

router = APIRouter(prefix="/v1/sweeps", tags=["sweeps"])


REPLAY = {
    "model": schemas.SweepDetail,
    "description": "A replay of an `Idempotency-Key` with the same body: its sweep.",
}


@router.post(
    "", status_code=201, response_model=schemas.SweepDetail, responses={200: REPLAY, **ERRORS, 403: ERRORS[401]}
)
async def create_sweep(
    spec: SweepSpec,
    work: Work,
    response: Response,
    idempotency_key: Annotated[str | None, Header(alias="Idempotency-Key", min_length=1, max_length=200)] = None,
) -> schemas.SweepDetail:
    """Validate the sweep and every trial's JobSpec, store it, and start its first trials.

    A trial's spec is the base with the trial's values; a 422 names `space.<path>` or
    `base.<field>`, and nothing is stored. At most `max_concurrent` of its trials are queued or
    running at once, and never more than the tenant's job cap allows; the others wait and start as
    trials finish. With `asha`, a trial reaching a rung goes on at once only if its metric is within
    the top floor(n / reduction_factor) of the n results recorded at that rung so far (itself
    included); otherwise it waits there (`paused`) to be promoted, and ends `stopped_early` if it
    never is. With `stop_once` it ends `stopped_early` at once instead, and the top
    max(1, floor(n / reduction_factor)) go on. Each decision is taken once, by the database. Once
    every trial has finished, the sweep is `completed` and `sweep.completed` is sent to the
    webhooks that take it. A replay with the same `Idempotency-Key` and body answers 200 with the
    same sweep; the same key with another body is 409.
    """
    sweep, created = await work(service.create_sweep, spec, work.settings, idempotency_key)
    response.status_code = 201 if created else 200
    return sweep


@router.get("", response_model=schemas.SweepList, responses=ERRORS)
async def list_sweeps(
    work: Work,
    status: SweepStatus | None = None,
    limit: Annotated[int, Query(ge=1, le=service.MAX_LIMIT)] = 20,
    after: After = None,
) -> schemas.SweepList:
    """Newest first, each with its trials' counts by status and its best trial.

    Pass the previous page's `next_after` as `after`.
    """
    return await work(service.list_sweeps, limit, after, status)


@router.get("/{sweep_id}", response_model=schemas.SweepDetail, responses=ERRORS)
async def get_sweep(sweep_id: SweepId, work: Work) -> schemas.SweepDetail:
    """The sweep, every trial (parameters, job, status, latest metric, ASHA rung results) and
    the best trial: the succeeded one with the best metric."""
    return await work(service.show_sweep, sweep_id)


@router.post("/{sweep_id}/cancel", response_model=schemas.SweepDetail, responses=ERRORS)
async def cancel_sweep(sweep_id: SweepId, work: Work) -> schemas.SweepDetail:
    """No trial starts any more: queued trials are cancelled at once, running ones are
    `cancelling` until their workers stop. A cancelled sweep answers as it is; a completed one, 409."""
    return await work(service.cancel_sweep, sweep_id, work.bus)
