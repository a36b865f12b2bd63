"""Sweeps: submission, list, get, cancel, and ``advance``, which starts trials as slots free up.

A submission validates every trial's spec and stores the sweep, its trials and its first jobs in
one transaction. ``advance`` promotes waiting trials, starts the next ones and completes the
sweep. ASHA's decisions and promotions are app.services.asha; the rules themselves are pure
functions (app.services.search). Services never commit.

Trials are ordinary jobs, inserted through the job intake's own stages (``prepare_submission``,
``insert_submissions``): the tenant's job cap holds exactly, and a trial beyond it or beyond the
sweep's ``max_concurrent`` waits in ``sweep_trials`` until ``advance`` starts it. ``advance``
runs after a trial's final status has committed (the worker's finish) and from every reaper pass
(a trial cancelled or reaped, a slot freed by another job, a process that died in between): the
database, not a process's memory, says which trial starts next.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

from pydantic import ValidationError
from sqlalchemy.orm import Session

from app.db.models import Job, Sweep, SweepTrial, Tenant
from app.db.session import on_commit, transaction
from app.errors import Conflict, DomainError, NotFound, RateLimited, TenantSuspended, ValidationFailed
from app.messaging.broker import send_train_tasks, train_tasks
from app.messaging.live_bus import LiveBus
from app.repositories.sweeps import SweepRepository
from app.repositories.tenants import TenantRepository
from app.schemas import api as schemas
from app.schemas.sweep import SweepSpec
from app.services import lifecycle, search, webhooks
from app.services.asha import promote, promotion_candidates, stop_waiting, waits_at_rungs
from app.services.auth import TenantRef
from app.services.intake import insert_submissions
from app.services.submission import check_spec, prepare_submission, request_hash
from app.services.tenants import job_cap
from app.settings import Settings
from contract.spec import JobSpec, error_path
from contract.status import JobStatus, SweepStatus, TrialStatus
from contract.webhooks import WebhookEventType

log = logging.getLogger("muonforge.sweeps")
MAX_LIMIT = 100


# -- submission ----------------------------------------------------------------------------------
def trial_params(spec: SweepSpec) -> list[search.Params]:
    """The sweep's trials' parameters: the grid's combinations (the first ``max_trials``) or
    ``max_trials`` seeded draws."""
    space = {path: p.model_dump() for path, p in spec.space.items()}
    if spec.method == "grid":
        for path, param in spec.space.items():
            if param.kind != "values":
                message = f"method grid takes values lists only ({path} has {param.kind})"
                raise ValidationFailed(message, f"space.{path}")
        combos = search.grid(space)
        if spec.max_trials is None and len(combos) > 100:
            raise ValidationFailed(f"the grid has {len(combos)} combinations, more than 100: set max_trials", "space")
        return combos[: spec.max_trials or len(combos)]
    return search.sample(space, spec.max_trials or 1, spec.seed)


def trial_spec(spec: SweepSpec, number: int, params: search.Params) -> JobSpec:
    """Trial ``number``'s JobSpec, validated, defaults filled in; a 422 names the swept path
    (``space.optimizer.lr``) or the base's field (``base.train.steps``) that makes it invalid."""
    try:
        merged = search.with_params(spec.base, params)
    except search.BadPath as exc:
        path = str(exc).split(":", 1)[0]
        raise ValidationFailed(f"space.{path} names no place in a JobSpec: {exc}", f"space.{path}") from None
    if merged.get("name") is None:
        merged["name"] = f"{spec.name or 'sweep'} #{number}"
    try:
        job = JobSpec.model_validate(merged)
    except ValidationError as exc:
        error = exc.errors()[0]
        loc = error_path(error["loc"])
        swept = next((p for p in params if loc == p or loc.startswith(p + ".") or p.startswith(loc + ".")), None)
        param = f"space.{swept}" if swept else f"base.{loc}" if loc else "base"
        value = f" ({swept} = {params[swept]!r}, trial {number})" if swept else ""
        message = str(error["msg"]).removeprefix("Value error, ")
        raise ValidationFailed(f"{loc or 'the spec'}: {message}{value}", param) from None
    if spec.asha is not None and spec.asha.rungs[-1] >= job.train.steps:
        raise ValidationFailed(
            f"every rung must come before the trial's last step (train.steps {job.train.steps}, trial {number})",
            "asha.rungs",
        )
    if spec.asha is not None and job.resources.world_size > 1:
        raise ValidationFailed(
            f"ASHA stops trials of one process only; this trial runs on resources.nproc x nnodes = "
            f"{job.resources.world_size} (trial {number}): drop asha or train each trial in one process",
            "asha",
        )
    return job


def create_sweep(
    session: Session, tenant: TenantRef, spec: SweepSpec, settings: Settings, idempotency_key: str | None = None
) -> tuple[schemas.SweepDetail, bool]:
    """Validate every trial, store the sweep and its trials, and start the first ones (their
    tasks go out once the transaction has committed). Nothing is stored on a 422. Returns the
    sweep and whether this request created it: a repeated ``idempotency_key`` with the same
    request answers with the sweep the first one created (the same key with another request is
    a 409)."""
    request = spec.model_dump(mode="json")
    digest = request_hash(request)
    repo = SweepRepository(session)
    if idempotency_key:
        # One keyed submission of the tenant at a time. The tenant's row before a sweep's is the
        # other order from advance()'s, but the only sweep this transaction then locks is its own
        # new one, which no other transaction can see: no cycle.
        TenantRepository(session).lock([tenant.id])
        if (existing := repo.by_idempotency_key(tenant.id, idempotency_key)) is not None:
            if existing.request_hash != digest:
                raise Conflict("this Idempotency-Key was used with a different request body", param="Idempotency-Key")
            return sweep_detail(session, existing), False
    if job_cap(tenant.job_cap, settings.tenant_job_cap) <= 0:
        raise TenantSuspended("this tenant is suspended: it may not start jobs (ask the service's operators)")
    trials = []
    for number, params in enumerate(trial_params(spec)):
        job_spec = trial_spec(spec, number, params)
        try:
            check_spec(session, tenant, job_spec, settings)  # what intake checks, bar the job cap a trial waits for
        except ValidationFailed as exc:
            swept = next((p for p in params if exc.param and (exc.param + ".").startswith(p + ".")), None)
            exc.param = f"space.{swept}" if swept else f"base.{exc.param}" if exc.param else "base"
            raise
        trials.append({"number": number, "params": params, "spec": job_spec.stored()})
    sweep = Sweep(
        tenant_id=tenant.id,
        name=spec.name,
        status=SweepStatus.RUNNING,
        request=request,
        metric=spec.metric,
        mode=spec.mode,
        max_concurrent=spec.max_concurrent,
        asha=spec.asha.model_dump() if spec.asha else None,
        idempotency_key=idempotency_key,
        request_hash=digest,
    )
    repo.add(sweep, trials)
    advance(session, sweep.id, settings)
    return sweep_detail(session, sweep), True


# -- starting trials -----------------------------------------------------------------------------
def advance(session: Session, sweep_id: str, settings: Settings, skip_locked: bool = False) -> int:
    """Under the sweep's lock: promote the trials waiting at rungs that ASHA lets go on, then
    start its next trials, as many as ``max_concurrent`` and the tenant's job cap leave room for
    (their tasks are sent after commit); once nothing runs and no trial waits to start, promote
    the best waiting trial of a rung with fewer results than its reduction factor, or else stop
    the waiting ones; once every trial has finished, complete the sweep (``sweep.completed``
    webhook, once). Returns how many trials started or resumed. ``skip_locked``: leave a sweep
    another transaction is advancing (the reaper)."""
    repo = SweepRepository(session)
    sweep = repo.lock(sweep_id, skip_locked=skip_locked)
    if sweep is None or sweep.status != SweepStatus.RUNNING:
        return 0
    room = sweep.max_concurrent - repo.active_trials(sweep_id)
    promoted = 0
    if room > 0 and waits_at_rungs(sweep.asha):
        promoted = promote(session, sweep, promotion_candidates(session, sweep), room, settings)
        room -= promoted
    pending = repo.pending(sweep_id, max(room, 1))
    if not pending:
        if waits_at_rungs(sweep.asha) and not promoted and not repo.active_trials(sweep_id):
            # Nothing runs and nothing waits to start: the last promotions, else the end of the waits.
            if last := promotion_candidates(session, sweep, at_least_one=True):
                promoted = promote(session, sweep, last, room, settings)  # 0 if the job cap holds them back
            else:
                stop_waiting(session, sweep, settings)
        if not promoted and not repo.unfinished_jobs(sweep_id) and repo.finish(sweep_id, SweepStatus.COMPLETED):
            payload = sweep_payload(session, _locked(repo, sweep_id))  # as it finished
            webhooks.enqueue(session, sweep.tenant_id, WebhookEventType.SWEEP_COMPLETED, payload)
        return promoted
    if room <= 0:
        return promoted
    row = session.get_one(Tenant, sweep.tenant_id)
    tenant = TenantRef(id=row.id, name=row.name, job_cap=row.job_cap)
    submissions = []
    for trial in pending:
        try:
            sub = prepare_submission(session, tenant, JobSpec.model_validate(trial.spec), None, settings)
        except (RateLimited, TenantSuspended):
            break  # the job cap: it waits for a slot
        except DomainError as exc:  # its dataset or checkpoint went away since submission
            repo.start_trial(sweep_id, trial.number, None, {"code": exc.code, "message": exc.message})
            continue
        sub.row["sweep_id"] = sweep_id
        submissions.append((trial, sub))
    started = []
    for (trial, _), result in zip(submissions, insert_submissions(session, [s for _, s in submissions])):
        if isinstance(result, tuple):
            repo.start_trial(sweep_id, trial.number, result[0].id)
            started += train_tasks(result[0].id, result[0].queue, result[0].nnodes)  # one per node
    if started:
        on_commit(session, partial(send_train_tasks, settings, started))
    return promoted + len({job_id for job_id, _ in started})


def advance_after(settings: Settings, sweep_id: str) -> int:
    """``advance`` in a transaction of its own (after a trial's final status has committed)."""
    with transaction(settings) as session:
        return advance(session, sweep_id, settings)


def advance_running(settings: Settings) -> int:
    """``advance`` every running sweep, each in a transaction of its own (the reaper's pass)."""
    with transaction(settings) as session:
        ids = SweepRepository(session).running_ids()
    started = 0
    for sweep_id in ids:
        with transaction(settings) as session:
            started += advance(session, sweep_id, settings, skip_locked=True)
    return started


# -- reads ---------------------------------------------------------------------------------------
def get_sweep(session: Session, tenant: TenantRef, sweep_id: str) -> Sweep:
    sweep = SweepRepository(session).get(sweep_id, tenant.id)
    if sweep is None:
        raise NotFound(f"no sweep {sweep_id!r}", param="sweep_id")
    return sweep


def _locked(repo: SweepRepository, sweep_id: str) -> Sweep:
    """The sweep's row, locked and read as committed now (NotFound if it is gone)."""
    sweep = repo.lock(sweep_id)
    if sweep is None:
        raise NotFound(f"no sweep {sweep_id!r}", param="sweep_id")
    return sweep


def show_sweep(session: Session, tenant: TenantRef, sweep_id: str) -> schemas.SweepDetail:
    return sweep_detail(session, get_sweep(session, tenant, sweep_id))


def list_sweeps(
    session: Session, tenant: TenantRef, limit: int, after: str | None, status: str | None = None
) -> schemas.SweepList:
    rows = SweepRepository(session).page(tenant.id, limit, after, status)
    page = rows[:limit]
    more = len(rows) > limit
    trials = trial_views(session, page)
    data = [summary(sweep, trials[sweep.id]) for sweep in page]
    return schemas.SweepList(data=data, has_more=more, next_after=page[-1].id if more else None)


def trial_views(session: Session, sweeps: list[Sweep]) -> dict[str, list[schemas.SweepTrial]]:
    """Each sweep's trials as the API shows them, with their jobs and rung decisions (two
    queries for a page of sweeps)."""
    repo = SweepRepository(session)
    ids = [s.id for s in sweeps]
    rungs: dict[str, list[schemas.SweepRung]] = {}
    for r in repo.rungs(ids):  # by rung: each trial's ascending
        promoted = r.promoted_at is not None
        view = schemas.SweepRung(
            rung=r.rung, value=r.value, position=r.position, continued=r.go_on or promoted, promoted=promoted
        )
        rungs.setdefault(r.job_id, []).append(view)
    metric = {s.id: s.metric for s in sweeps}
    return {
        sweep_id: [trial_view(t, j, metric[sweep_id], rungs.get(t.job_id or "", [])) for t, j in pairs]
        for sweep_id, pairs in repo.trials(ids).items()
    }


def sweep_detail(session: Session, sweep: Sweep) -> schemas.SweepDetail:
    trials = trial_views(session, [sweep])[sweep.id]
    return schemas.SweepDetail(**summary(sweep, trials).model_dump(), trials=trials)


def sweep_payload(session: Session, sweep: Sweep) -> dict[str, Any]:
    """The sweep as GET /v1/sweeps/{id} shows it (the sweep.completed webhook's data)."""
    return sweep_detail(session, sweep).model_dump(mode="json")


def trial_view(trial: SweepTrial, job: Job | None, metric: str, rungs: list[schemas.SweepRung]) -> schemas.SweepTrial:
    status = job.status if job is not None else TrialStatus.NOT_STARTED if trial.error else TrialStatus.PENDING
    value = (job.summary or {}).get(metric) if job is not None else None
    return schemas.SweepTrial(
        number=trial.number,
        params=trial.params,
        job_id=trial.job_id,
        status=status,
        metric=value if isinstance(value, int | float) else None,
        step=job.progress_step if job else 0,
        rungs=rungs,
        error=trial.error,
    )


def summary(sweep: Sweep, trials: list[schemas.SweepTrial]) -> schemas.Sweep:
    counts: dict[str, int] = {}
    for t in trials:
        counts[t.status] = counts.get(t.status, 0) + 1
    succeeded = {str(t.number): t.metric for t in trials if t.status == JobStatus.SUCCEEDED}
    best = search.best(succeeded, sweep.mode)
    return schemas.Sweep(
        id=sweep.id,
        name=sweep.name,
        status=sweep.status,
        spec=sweep.request,
        metric=sweep.metric,
        mode=sweep.mode,
        created_at=sweep.created_at,
        finished_at=sweep.finished_at,
        counts=schemas.SweepCounts(total=len(trials), by_status=counts),
        best=trials[int(best)] if best is not None else None,
    )


# -- cancel --------------------------------------------------------------------------------------
def cancel_sweep(session: Session, tenant: TenantRef, sweep_id: str, bus: LiveBus) -> schemas.SweepDetail:
    """No trial starts any more; queued and paused trials are cancelled at once, running ones
    are ``cancelling`` until their workers stop. A cancelled sweep answers as it is; a completed
    one, 409.

    Locks: the sweep, then every unfinished trial's job (by id), then the status changes (each
    job's, then, by trigger, the tenant's): no job lock is waited for while holding the tenant's."""
    repo = SweepRepository(session)
    get_sweep(session, tenant, sweep_id)  # 404 for another tenant's
    sweep = _locked(repo, sweep_id)
    if sweep.status == SweepStatus.COMPLETED:
        raise Conflict(f"sweep {sweep_id} has already completed")
    if sweep.status == SweepStatus.RUNNING:
        repo.finish(sweep_id, SweepStatus.CANCELLED)
        unfinished = repo.unfinished_jobs(sweep_id, lock=True)
        idle = (JobStatus.QUEUED, JobStatus.PAUSED)  # on no worker: cancelled at once
        for job in sorted(unfinished, key=lambda j: j.status in idle):  # running ones first
            lifecycle.cancel(session, bus, job)
    return sweep_detail(session, _locked(repo, sweep_id))
