"""A tenant's ``active_jobs``, kept by the triggers of migration 0005, on Postgres and on SQLite:
equal to a count of its active jobs after every transition the service makes, moved by every
status change exactly as membership in contract.status.ACTIVE changes (the one list the
triggers' literal must match), and back-filled by the migration."""

from __future__ import annotations

import secrets
from datetime import timedelta
from itertools import product

import pytest
from sqlalchemy import delete, func, insert, inspect, select, text, update

from app.db.base import utcnow
from app.db.migrate import downgrade, upgrade
from app.db.models import Dataset, Job, Tenant
from app.db.session import make_engine, transaction
from app.errors import RateLimited
from app.messaging.live_bus import live_bus
from app.repositories.jobs import JobRepository
from app.repositories.tenants import DatasetRepository, TenantRepository
from app.services import lifecycle
from app.services.auth import authenticate, create_api_key
from app.services.datasets import delete_dataset
from app.services.intake import insert_submissions
from app.services.jobs import cancel_job
from app.services.reaper import release
from app.services.submission import prepare_submission
from app.settings import Settings
from contract.spec import JobSpec
from contract.status import ACTIVE, JobStatus
from tests.support.services import PG_ADMIN, create_database, drop_database
from tests.support.specs import tiny_spec

LEASE = timedelta(minutes=10)  # no other test's reaper sees these leases expire


def sqlite_settings(tmp_path) -> Settings:
    return Settings(database_url=f"sqlite:///{tmp_path / 'muonforge.db'}", redis_url=None, artifact_dir=tmp_path)


@pytest.fixture(params=["postgresql", "sqlite"])
def db(request, tmp_path) -> Settings:
    """Settings on a migrated database: the suite's Postgres one, or a new SQLite file."""
    if request.param == "postgresql":
        return request.getfixturevalue("settings")
    settings = sqlite_settings(tmp_path)
    upgrade(settings)
    return settings


def new_tenant(settings: Settings):
    with transaction(settings) as session:
        key = create_api_key(session, f"active-{secrets.token_hex(4)}")
    with transaction(settings) as session:
        return authenticate(session, f"Bearer {key}")


def active_jobs(settings: Settings, tenant_id: str) -> int:
    """The tenant's counter, after checking that every tenant's equals a count of its active
    jobs (one statement: one snapshot, whatever other tests' workers do meanwhile)."""
    counted = select(func.count()).where(Job.tenant_id == Tenant.id, Job.status.in_(ACTIVE)).scalar_subquery()
    with transaction(settings) as session:
        rows = session.execute(select(Tenant.id, Tenant.active_jobs, counted)).all()
    assert [row for row in rows if row[1] != row[2]] == []
    return next(kept for tenant, kept, _ in rows if tenant == tenant_id)


def claim(settings: Settings, job_id: str) -> int:
    with transaction(settings) as session:
        return lifecycle.claim(session, live_bus(settings), job_id, "test-worker", LEASE).attempt


def finish(settings: Settings, job_id: str, attempt: int, status: JobStatus) -> None:
    with transaction(settings) as session:
        assert lifecycle.finish(session, live_bus(settings), job_id, attempt, status, 0, {})


def cancel(settings: Settings, tenant, job_id: str) -> str:
    with transaction(settings) as session:
        return cancel_job(session, tenant, job_id, live_bus(settings)).status


def reap(settings: Settings, job_id: str) -> str:
    """The reaper's release of the job's lease, as if the lease had expired."""
    with transaction(settings) as session:
        job = JobRepository(session).get(job_id)
    release(settings, job, utcnow() + 2 * LEASE)
    with transaction(settings) as session:
        return JobRepository(session).get(job_id).status


def test_every_transition_of_the_service_keeps_active_jobs_exact(db):
    tenant = new_tenant(db)
    with transaction(db) as session:
        specs = [tiny_spec(max_restarts=0 if i == 4 else 3) for i in range(9)]
        subs = [prepare_submission(session, tenant, JobSpec.model_validate(s), None, db) for s in specs]
    for sub in subs:
        sub.cap = 7  # the writer's exact check: a batch of 9 at a cap of 7 admits 7
    with transaction(db) as session:
        results = insert_submissions(session, subs)
    assert [isinstance(r, RateLimited) for r in results] == [False] * 7 + [True] * 2
    assert active_jobs(db, tenant.id) == 7
    succeeded, failed, queued, cancelled, lost, requeued, deleted = (job.id for job, _ in results[:7])

    attempt = claim(db, succeeded)  # queued -> running: still active
    assert active_jobs(db, tenant.id) == 7
    finish(db, succeeded, attempt, JobStatus.SUCCEEDED)
    assert active_jobs(db, tenant.id) == 6
    finish(db, failed, claim(db, failed), JobStatus.FAILED)
    assert active_jobs(db, tenant.id) == 5

    assert cancel(db, tenant, queued) == JobStatus.CANCELLED  # queued -> cancelled
    assert active_jobs(db, tenant.id) == 4
    attempt = claim(db, cancelled)
    assert cancel(db, tenant, cancelled) == JobStatus.CANCELLING  # running -> cancelling: still active
    assert active_jobs(db, tenant.id) == 4
    finish(db, cancelled, attempt, JobStatus.CANCELLED)
    assert active_jobs(db, tenant.id) == 3

    claim(db, lost)  # max_restarts 0: a lost attempt fails the job
    assert reap(db, lost) == JobStatus.FAILED
    assert active_jobs(db, tenant.id) == 2
    claim(db, requeued)
    assert reap(db, requeued) == JobStatus.QUEUED  # running -> queued: still active
    assert active_jobs(db, tenant.id) == 2
    claim(db, requeued)
    with transaction(db) as session:
        seen = JobRepository(session).get(requeued)  # the reaper reads the expired lease: no cancel yet
    assert cancel(db, tenant, requeued) == JobStatus.CANCELLING  # then a cancel comes
    release(db, seen, utcnow() + 2 * LEASE)  # a lost attempt of a cancelling job: cancelled, not queued
    with transaction(db) as session:
        assert JobRepository(session).get(requeued).status == JobStatus.CANCELLED
    assert active_jobs(db, tenant.id) == 1

    with transaction(db) as session:  # a dataset's delete unlinks finished jobs: no status change
        dataset = DatasetRepository(session).add(
            Dataset(tenant_id=tenant.id, name="d", bytes=1, sha256="0" * 64, char_vocab=1, path="datasets/none.txt")
        )
        session.execute(update(Job).where(Job.id == failed).values(dataset_id=dataset.id))
    with transaction(db) as session:
        delete_dataset(session, tenant, dataset.id, db)
    assert active_jobs(db, tenant.id) == 1

    with transaction(db) as session:
        session.execute(delete(Job).where(Job.id == deleted))
    assert active_jobs(db, tenant.id) == 0
    with transaction(db) as session:  # a tenant's delete cascades to its jobs
        session.execute(insert(Job.__table__), job_row(tenant.id, JobStatus.QUEUED))
        session.execute(delete(Tenant).where(Tenant.id == tenant.id))
    with transaction(db) as session:
        assert session.scalar(select(func.count()).where(Job.tenant_id == tenant.id)) == 0


def job_row(tenant_id: str, status: str) -> dict:
    return dict(
        id=f"job_{secrets.token_hex(8)}",
        tenant_id=tenant_id,
        status=status,
        spec={},
        queue="cpu",
        attempt=0,
        max_restarts=3,
        cancel_requested=False,
        progress_step=0,
        total_steps=1,
        summary={},
        event_seq=0,
        created_at=utcnow(),
    )


def test_a_trial_paused_at_a_rung_leaves_the_cap_and_its_promotion_takes_a_place_again(db):
    tenant = new_tenant(db)
    with transaction(db) as session:
        subs = [prepare_submission(session, tenant, JobSpec.model_validate(tiny_spec()), None, db) for _ in range(3)]
        waits, cancelling, idle = (job.id for job, _ in insert_submissions(session, subs))
    assert active_jobs(db, tenant.id) == 3

    attempt, bus = claim(db, waits), live_bus(db)
    with transaction(db) as session:
        assert lifecycle.pause(session, bus, waits, attempt, 10, {}).status == JobStatus.PAUSED  # running -> paused
    assert active_jobs(db, tenant.id) == 2
    with transaction(db) as session:
        repo = JobRepository(session)
        assert lifecycle.pause(session, bus, waits, attempt, 10, {}) is None  # a stale attempt changes nothing
        restarts = repo.get(waits).max_restarts
        promoted = lifecycle.promote(session, bus, waits, tenant.id, cap=100)  # paused -> queued: active again
        assert promoted == lifecycle.Promotion.PROMOTED
    assert active_jobs(db, tenant.id) == 3
    with transaction(db) as session:  # the promoted attempt is no restart after a lost worker
        assert JobRepository(session).fresh(waits).max_restarts == restarts + 1
        assert lifecycle.unpromote(session, waits)  # over the cap: undone in the same transaction
    assert active_jobs(db, tenant.id) == 2
    with transaction(db) as session:
        assert JobRepository(session).fresh(waits).max_restarts == restarts
    with transaction(db) as session:
        assert lifecycle.stop_waiting(session, bus, waits, {"stopped_at": 10})  # paused -> stopped_early
        assert JobRepository(session).get(waits).status == JobStatus.STOPPED_EARLY
    assert active_jobs(db, tenant.id) == 2

    attempt = claim(db, cancelling)
    assert cancel(db, tenant, cancelling) == JobStatus.CANCELLING
    with transaction(db) as session:  # a cancel came before the rung: cancelled, not paused
        assert lifecycle.pause(session, bus, cancelling, attempt, 0, {}).status == JobStatus.CANCELLED
    assert active_jobs(db, tenant.id) == 1

    attempt = claim(db, idle)
    with transaction(db) as session:
        lifecycle.pause(session, bus, idle, attempt, 0, {})
    assert cancel(db, tenant, idle) == JobStatus.CANCELLED  # paused -> cancelled at once
    assert active_jobs(db, tenant.id) == 0


def test_every_status_change_moves_the_counter_as_membership_in_active_changes(db):
    """Every (from, to) pair of statuses, also those the service never makes, and a job moved to
    another tenant: the triggers' list of statuses is contract.status.ACTIVE, nothing else."""
    one, other = new_tenant(db).id, new_tenant(db).id
    with transaction(db) as session:
        tenants = TenantRepository(session)
        for old, new in product(JobStatus, repeat=2):
            row = job_row(one, old)
            session.execute(insert(Job.__table__), row)
            assert tenants.active_jobs(one) == (old in ACTIVE), f"insert {old}"
            session.execute(update(Job).where(Job.id == row["id"]).values(status=new))
            assert tenants.active_jobs(one) == (new in ACTIVE), f"{old} -> {new}"
            session.execute(update(Job).where(Job.id == row["id"]).values(tenant_id=other))
            assert (tenants.active_jobs(one), tenants.active_jobs(other)) == (0, new in ACTIVE), f"moved {new}"
            session.execute(delete(Job).where(Job.id == row["id"]))
            assert (tenants.active_jobs(one), tenants.active_jobs(other)) == (0, 0), f"delete {new}"


def database(dialect: str, tmp_path):
    """(settings, drop) for a new, empty database."""
    if dialect == "sqlite":
        return sqlite_settings(tmp_path), lambda: None
    name = create_database()
    base = PG_ADMIN.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://")
    return Settings(database_url=f"{base}/{name}"), lambda: drop_database(name)


TRIGGERS = {
    "postgresql": "SELECT tgname FROM pg_trigger WHERE NOT tgisinternal",
    "sqlite": "SELECT name FROM sqlite_master WHERE type = 'trigger'",
}


@pytest.mark.parametrize("dialect", ["postgresql", "sqlite"])
def test_the_migration_back_fills_the_counter_and_downgrades(dialect, tmp_path):
    settings, drop = database(dialect, tmp_path)
    engine = None
    try:
        upgrade(settings, "0004")
        engine = make_engine(settings.sqlalchemy_url)
        statuses = {"ten_a": list(JobStatus) * 2, "ten_b": [JobStatus.SUCCEEDED], "ten_c": []}
        total = sum(map(len, statuses.values()))
        with engine.begin() as conn:
            for tenant, held in statuses.items():
                conn.execute(
                    text("INSERT INTO tenants (id, name, created_at) VALUES (:id, :id, :at)"),
                    {"id": tenant, "at": utcnow()},
                )
                for status in held:
                    conn.execute(insert(Job.__table__), job_row(tenant, status))

        def state() -> tuple[dict[str, int], set[str], int]:
            with engine.connect() as conn:
                kept = {}
                if "active_jobs" in {c["name"] for c in inspect(conn).get_columns("tenants")}:
                    kept = dict(conn.execute(text("SELECT id, active_jobs FROM tenants")).all())
                triggers = {row[0] for row in conn.execute(text(TRIGGERS[dialect]))}
                return kept, triggers, conn.scalar(select(func.count()).select_from(Job))

        upgrade(settings)
        names = {"jobs_active_insert", "jobs_active_update", "jobs_active_delete"}
        assert state() == ({"ten_a": 6, "ten_b": 0, "ten_c": 0}, names, total)
        downgrade(settings, "0004")
        assert state() == ({}, set(), total)  # the jobs stay
        if dialect == "postgresql":
            with engine.connect() as conn:
                assert conn.scalar(text("SELECT count(*) FROM pg_proc WHERE proname = 'jobs_active_count'")) == 0
        with engine.begin() as conn:  # changed while the counter is gone: the next upgrade counts again
            conn.execute(update(Job).where(Job.tenant_id == "ten_b").values(status=JobStatus.QUEUED))
        upgrade(settings)
        assert state() == ({"ten_a": 6, "ten_b": 1, "ten_c": 0}, names, total)
    finally:
        if engine is not None:
            engine.dispose()
        drop()


@pytest.mark.parametrize("dialect", ["postgresql", "sqlite"])
def test_stale_queued_jobs_are_sent_again_once_and_one_locked_elsewhere_is_skipped(dialect, tmp_path):
    """The reaper's re-send of queued jobs whose task was lost: each once per stale period; on
    Postgres a job whose row another transaction holds is skipped, not waited for (two reapers
    split the work instead of locking rows in crossing orders). On a database of its own: the
    reaper of another test's API would send these jobs first."""
    db, drop = database(dialect, tmp_path)
    try:
        upgrade(db)
        check_stale_queued(db)
    finally:
        drop()


def check_stale_queued(db: Settings) -> None:
    tenant, long_ago = new_tenant(db).id, utcnow() - timedelta(days=2)
    rows = [job_row(tenant, JobStatus.QUEUED) | {"enqueued_at": long_ago} for _ in range(3)]
    ids, held = {r["id"] for r in rows}, rows[0]["id"]
    with transaction(db) as session:
        session.execute(insert(Job.__table__), rows)
    before = utcnow() - timedelta(days=1)  # stale: sent more than a day ago

    def stale() -> set[str]:
        with transaction(db) as session:
            if db.sqlalchemy_url.startswith("postgresql"):
                session.execute(text("SET LOCAL lock_timeout = '5s'"))  # a wait fails instead of hanging
            return {job.id for job in JobRepository(session).stale_queued(before)} & ids

    if db.sqlalchemy_url.startswith("postgresql"):
        with transaction(db) as other:
            other.execute(select(Job.id).where(Job.id == held).with_for_update())
            assert stale() == ids - {held}
        assert stale() == {held}
    else:
        assert stale() == ids
    assert stale() == set()  # sent: not stale again until requeue_after has passed
