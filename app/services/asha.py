"""ASHA in a sweep: a trial's decision at a rung, and the promotions of waiting trials.

The decision (``record_rung``) is made once, under the sweep's lock; ``rung_outcome`` says what it
means for the trial's attempt. In the promote form, waiting trials are promoted
(``promotion_candidates``, ``promote``) or, once the sweep has nothing left to run, their waits
end (``stop_waiting``). The rules themselves are pure functions (app.services.search). Services
never commit.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from sqlalchemy.orm import Session

from app.db.models import Sweep, SweepRung, Tenant
from app.db.session import on_commit
from app.errors import NotFound
from app.messaging.broker import send_train_tasks, train_tasks
from app.messaging.live_bus import live_bus
from app.repositories.jobs import JobRepository
from app.repositories.sweeps import SweepRepository
from app.services import lifecycle, search
from app.services.tenants import job_cap
from app.settings import Settings
from contract.status import JobStatus


def waits_at_rungs(asha: dict[str, Any] | None) -> bool:
    """Whether a sweep's ASHA is the promote form (trials wait at rungs; else they stop there).
    Sweeps stored before the promote form existed have no ``stop_once``: they stop."""
    return asha is not None and not asha.get("stop_once", True)


def record_rung(session: Session, sweep_id: str, job_id: str, rung: int, value: float) -> SweepRung:
    """The ASHA decision of trial ``job_id`` at ``rung`` (a step) with its metric ``value``:
    made once, under the sweep's lock, against the results recorded at the rung before it, and
    stored; a second call (a retry, a resumed or promoted attempt) returns the stored one."""
    repo = SweepRepository(session)
    sweep = repo.lock(sweep_id)
    if sweep is None or not sweep.asha:
        raise NotFound(f"no sweep {sweep_id!r} with ASHA")
    existing = repo.rung(job_id, rung)
    if existing is not None:
        return existing
    recorded = [*repo.rung_values(sweep_id, rung), value]
    eta, stop_once = sweep.asha["reduction_factor"], not waits_at_rungs(sweep.asha)
    go_on = search.asha_continues(recorded, value, eta, sweep.mode, stop_once)
    return repo.add_rung(sweep_id, job_id, rung, len(recorded), value, go_on)


def rung_outcome(decision: SweepRung, metric: str, asha: dict[str, Any]) -> tuple[JobStatus, str] | None:
    """None if the trial goes on past the rung (at once, or promoted), else the status its
    attempt ends with (``stopped_early``, or ``paused`` to wait for a promotion) and why."""
    if decision.go_on or decision.promoted_at is not None:
        return None
    eta, rung, value = asha["reduction_factor"], decision.rung, f"{metric} {decision.value:.4g}"
    if not waits_at_rungs(asha):
        keep = search.asha_keep(decision.position, eta)
        why = f"{value} was not in the top {keep} of the {decision.position} result(s) there"
        return JobStatus.STOPPED_EARLY, f"ASHA stopped it at rung {rung}: {why}"
    why = f"{value} was not among the best 1 in {eta} of the {decision.position} result(s) there so far"
    return JobStatus.PAUSED, f"it waits at rung {rung} for ASHA to promote it: {why}"


def waiting(session: Session, sweep: Sweep) -> tuple[set[str], list[SweepRung]]:
    """The sweep's paused trials' job ids and every rung decision of the sweep (by rung)."""
    repo = SweepRepository(session)
    paused = repo.paused_jobs(sweep.id)
    return paused, (repo.rungs([sweep.id]) if paused else [])


def waits(decision: SweepRung, paused: set[str]) -> bool:
    """Whether ``decision`` is the rung its (paused) trial waits at for a promotion."""
    return decision.job_id in paused and not decision.go_on and decision.promoted_at is None


def promotion_candidates(session: Session, sweep: Sweep, at_least_one: bool = False) -> list[SweepRung]:
    """The rung decisions of the sweep's waiting trials that ASHA promotes now: within their
    rung's top floor(n / reduction_factor) (at least 1 with ``at_least_one``), highest rung
    first, best first."""
    paused, rows = waiting(session, sweep)
    if not paused or sweep.asha is None:  # only ASHA pauses trials
        return []
    eta, chosen = sweep.asha["reduction_factor"], []
    for rung in sorted({r.rung for r in rows}, reverse=True):
        at = [r for r in rows if r.rung == rung]  # in the order they were recorded
        waiting_at = [i for i, r in enumerate(at) if waits(r, paused)]
        chosen += [at[i] for i in search.promotable([r.value for r in at], waiting_at, eta, sweep.mode, at_least_one)]
    return chosen


def promote(session: Session, sweep: Sweep, chosen: list[SweepRung], room: int, settings: Settings) -> int:
    """Promote up to ``room`` of the ``chosen`` waiting trials, in order: each goes back to the
    queue (its task sent after commit) to resume from its rung. Stops at the tenant's job cap.
    Returns how many it promoted."""
    repo, jobs = SweepRepository(session), JobRepository(session)
    locked = jobs.lock_paused([r.job_id for r in chosen])
    cap = job_cap(session.get_one(Tenant, sweep.tenant_id).job_cap, settings.tenant_job_cap)
    tasks, promoted = [], 0
    for row in chosen:
        if promoted == room:
            break
        job = locked.get(row.job_id)
        if job is None:
            continue
        outcome = lifecycle.promote(session, live_bus(settings), job.id, sweep.tenant_id, cap)
        if outcome == lifecycle.Promotion.NOT_WAITING:
            continue
        if outcome == lifecycle.Promotion.OVER_CAP:
            break
        repo.mark_promoted(row.id)
        tasks += train_tasks(job.id, job.queue, job.nnodes)
        promoted += 1
    if tasks:
        on_commit(session, partial(send_train_tasks, settings, tasks))
    return promoted


def stop_waiting(session: Session, sweep: Sweep, settings: Settings) -> None:
    """End the sweep's waiting trials, which will not be promoted: stopped_early at their rung."""
    jobs = JobRepository(session)
    paused, rows = waiting(session, sweep)
    where = {r.job_id: r for r in rows if waits(r, paused)}
    for job in jobs.lock_paused(sorted(paused)).values():
        row = where.get(job.id)
        reason = (
            f"ASHA did not promote it past rung {row.rung}: {sweep.metric} {row.value:.4g} was not among the best "
            f"of the results there when the sweep ran out of trials"
            if row is not None
            else "its sweep ended while it waited at a rung"
        )
        summary = dict(job.summary or {}, stopped_at=row.rung if row else job.progress_step, stop_reason=reason)
        lifecycle.stop_waiting(session, live_bus(settings), job.id, summary)
