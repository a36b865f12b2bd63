"""The job lifecycle walks contract.status.TRANSITIONS on real rows: every (source, target) pair a
rule names, taken by its use case (app.services.lifecycle) from a job brought to the source
state through the use cases, changes the row and records one status event; every other pair,
under any rule, the repository refuses before it touches the row."""

from __future__ import annotations

import secrets
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import select, update

from app.db.base import utcnow
from app.db.models import Job
from app.db.session import transaction
from app.messaging.live_bus import live_bus
from app.repositories.job_events import JobEventRepository
from app.repositories.jobs import JobRepository
from app.services import lifecycle
from app.services.auth import TenantRef, authenticate, create_api_key
from app.services.intake import insert_submissions
from app.services.submission import prepare_submission
from app.settings import Settings
from contract.spec import JobSpec
from contract.status import ALLOWED, FINISHED, TRANSITIONS, IllegalTransition, JobStatus
from tests.support.specs import tiny_spec

S = JobStatus
LEASE = timedelta(minutes=10)  # no reaper sees these leases lapse
NAMED = [(rule.name, s, t) for rule in TRANSITIONS for s in sorted(rule.sources) for t in sorted(rule.targets)]


@pytest.fixture(scope="module")
def tenant(settings) -> TenantRef:
    with transaction(settings) as session:
        key = create_api_key(session, f"lifecycle-{secrets.token_hex(4)}")
    with transaction(settings) as session:
        return authenticate(session, f"Bearer {key}")


def new_job(settings: Settings, tenant: TenantRef, **train: Any) -> str:
    """A job through the intake's stages: inserted queued, with its first status event."""
    with transaction(settings) as session:
        submission = prepare_submission(session, tenant, JobSpec.model_validate(tiny_spec(**train)), None, settings)
        [(job, created)] = insert_submissions(session, [submission])
    assert created and job.status == S.QUEUED
    return job.id


def drive(settings: Settings, tenant: TenantRef, source: JobStatus, **train: Any) -> tuple[str, int]:
    """A new job brought to ``source`` by the use cases, each in a transaction of its own as the
    service takes them: (job id, its attempt)."""
    job_id, bus = new_job(settings, tenant, **train), live_bus(settings)
    if source == S.QUEUED:
        return job_id, 0
    with transaction(settings) as session:
        attempt = lifecycle.claim(session, bus, job_id, "test-worker", LEASE).attempt
    with transaction(settings) as session:
        if source == S.CANCELLING:
            assert lifecycle.request_cancel(session, bus, job_id)
        elif source == S.PAUSED:
            assert lifecycle.pause(session, bus, job_id, attempt, 10, {})
        elif source in FINISHED:
            assert lifecycle.finish(session, bus, job_id, attempt, source, 10, {})
    with transaction(settings) as session:
        assert JobRepository(session).get(job_id).status == source
    return job_id, attempt


def apply(settings: Settings, tenant: TenantRef, rule: str, job_id: str, attempt: int, target: JobStatus) -> bool:
    """The use case of ``rule``, in a transaction of its own; whether it changed the job."""
    bus = live_bus(settings)
    with transaction(settings) as session:
        match rule:
            case "claim":
                return lifecycle.claim(session, bus, job_id, "test-worker", LEASE) is not None
            case "request_cancel":
                return lifecycle.request_cancel(session, bus, job_id) is not None
            case "cancel_waiting":
                return lifecycle.cancel_waiting(session, bus, job_id) is not None
            case "finish":
                return lifecycle.finish(session, bus, job_id, attempt, target, 20, {"loss": 1.0}) is not None
            case "pause":
                return lifecycle.pause(session, bus, job_id, attempt, 20, {"loss": 1.0}) is not None
            case "release":  # the reaper's case: the lease lapsed
                cause = "the worker stopped renewing its lease"
                return (
                    lifecycle.release(session, bus, job_id, attempt, cause, utcnow() + 2 * LEASE, lapsed=True)
                    is not None
                )
            case "promote":
                return lifecycle.promote(session, bus, job_id, tenant.id, cap=1000) == lifecycle.Promotion.PROMOTED
            case "unpromote":
                return lifecycle.unpromote(session, job_id)
            case "stop_waiting":
                return lifecycle.stop_waiting(session, bus, job_id, {"stopped_at": 10}) is not None
    raise AssertionError(f"no use case for the rule {rule}")


def events(settings: Settings, job_id: str) -> list[tuple[str, dict]]:
    with transaction(settings) as session:
        return [(e.kind, e.payload) for e in JobEventRepository(session).events(job_id)]


def row(settings: Settings, job_id: str) -> dict[str, Any]:
    with transaction(settings) as session:
        return dict(session.execute(select(Job.__table__).where(Job.id == job_id)).mappings().one())


def test_every_rule_names_a_use_case():
    assert {rule.name for rule in TRANSITIONS} <= {
        name for name in dir(lifecycle) if callable(getattr(lifecycle, name))
    }


@pytest.mark.parametrize(("rule", "source", "target"), NAMED, ids=[f"{r}:{s}->{t}" for r, s, t in NAMED])
def test_each_use_case_takes_each_pair_its_rule_names(settings, tenant, rule, source, target):
    # release decides its target on the row (app.services.lifecycle.after_lost_attempt): the
    # restarts left and whether a cancel was asked, set here for the pair wanted.
    restarts = {"max_restarts": 0} if rule == "release" and target == S.FAILED else {}
    job_id, attempt = drive(settings, tenant, source, **restarts)
    if rule == "release":
        with transaction(settings) as session:
            wanted = target == S.CANCELLED
            session.execute(update(Job).where(Job.id == job_id).values(cancel_requested=wanted))
    before = events(settings, job_id)

    assert apply(settings, tenant, rule, job_id, attempt, target)

    after = row(settings, job_id)
    assert after["status"] == target
    recorded = events(settings, job_id)[len(before) :]
    if rule == "unpromote":  # it undoes a promotion in the transaction that made it, before any event
        assert recorded == []
    else:
        assert [(kind, payload["status"]) for kind, payload in recorded] == [("status", target)]
    assert (after["finished_at"] is not None) == (target in FINISHED)
    if source in (S.RUNNING, S.CANCELLING) and target not in (S.RUNNING, S.CANCELLING):
        assert after["lease_owner"] is None and after["lease_expires_at"] is None  # off its worker
    if rule == "claim":
        assert after["attempt"] == attempt + 1 and after["lease_owner"] == "test-worker"


def test_a_stale_attempt_or_a_moved_job_changes_nothing(settings, tenant):
    """The compare-and-set misses, and no event is recorded: an attempt number that is not the
    job's, or a job no longer in the rule's source states."""
    job_id, attempt = drive(settings, tenant, S.RUNNING)
    before, bus = row(settings, job_id), live_bus(settings)
    with transaction(settings) as session:
        assert lifecycle.finish(session, bus, job_id, attempt + 1, S.SUCCEEDED, 20, {}) is None
        assert lifecycle.pause(session, bus, job_id, attempt - 1, 20, {}) is None
        assert lifecycle.release(session, bus, job_id, attempt + 1, "lost", utcnow() + 2 * LEASE) is None
        assert lifecycle.release(session, bus, job_id, attempt, "lost", utcnow(), lapsed=True) is None  # a live lease
        assert lifecycle.claim(session, bus, job_id, "another-worker", LEASE) is None
        assert lifecycle.cancel_waiting(session, bus, job_id) is None
        assert lifecycle.stop_waiting(session, bus, job_id, {}) is None
        assert lifecycle.promote(session, bus, job_id, tenant.id, cap=1000) == lifecycle.Promotion.NOT_WAITING
    assert row(settings, job_id) == before


def test_a_promotion_past_the_job_cap_is_undone_without_an_event(settings, tenant):
    job_id, _ = drive(settings, tenant, S.PAUSED)
    before, history = row(settings, job_id), events(settings, job_id)
    with transaction(settings) as session:
        outcome = lifecycle.promote(session, live_bus(settings), job_id, tenant.id, cap=0)
    assert outcome == lifecycle.Promotion.OVER_CAP
    after = row(settings, job_id)
    assert after["status"] == S.PAUSED and after["max_restarts"] == before["max_restarts"]
    assert events(settings, job_id) == history


@pytest.mark.parametrize("source", list(JobStatus))
def test_the_repository_refuses_every_pair_no_rule_names(settings, tenant, source):
    """From a job in ``source``: every target a rule does not take it to, under every rule (and
    an allowed pair under a rule that does not name it), is IllegalTransition before any SQL."""
    job_id, _ = drive(settings, tenant, source)
    before = row(settings, job_id)
    refused = 0
    with transaction(settings) as session:
        repo = JobRepository(session)
        for target in JobStatus:
            for rule in TRANSITIONS:
                if source in rule.sources and target in rule.targets:
                    assert target in ALLOWED[source]
                    continue
                with pytest.raises(IllegalTransition):
                    repo.change_status(job_id, rule.name, target, sources=[source])
                refused += 1
            if target not in ALLOWED[source]:
                assert not any(source in rule.sources and target in rule.targets for rule in TRANSITIONS)
        with pytest.raises(IllegalTransition):
            repo.change_status(job_id, "resurrect", S.QUEUED, sources=[source])
    assert refused > 0
    assert row(settings, job_id) == before
