"""Job intake on real Postgres and Redis: batched inserts (JobWriter), task publishing in
batches (TaskPublisher), the API key cache and the per-tenant admission estimate."""

from __future__ import annotations

import base64
import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis
from sqlalchemy import text, update
from sqlalchemy.exc import IntegrityError

from app.db.base import utcnow
from app.db.models import ApiKey
from app.db.session import transaction
from app.errors import Conflict, Unauthorized
from app.messaging.live_bus import NoBus
from app.repositories.tenants import TenantRepository
from app.services import lifecycle
from app.services.admission import Admission
from app.services.auth import KeyCache, authenticate, hash_key
from app.services.intake import JobWriter, TaskPublisher, insert_submissions
from app.services.submission import prepare_submission
from contract.spec import JobSpec
from tests.support.api import new_key
from tests.support.net import wait_for
from tests.support.specs import tiny_spec

QUEUE = "intake-test"  # no worker listens here


def queued_job_ids(redis_url: str) -> list[str]:
    messages = redis.Redis.from_url(redis_url).lrange(QUEUE, 0, -1)
    return [json.loads(base64.b64decode(json.loads(m)["body"]))[0][0] for m in messages]


@pytest.fixture
def broker(redis_url):
    redis.Redis.from_url(redis_url).delete(QUEUE)
    yield redis_url
    redis.Redis.from_url(redis_url).delete(QUEUE)


def prepared(settings, key: str, idempotency_key: str | None = None, **train):
    """A prepared job (row not inserted) of the tenant of ``key``, on the test queue."""
    with transaction(settings) as session:
        tenant = authenticate(session, f"Bearer {key}")
        new = prepare_submission(session, tenant, JobSpec.model_validate(tiny_spec(**train)), idempotency_key, settings)
    new.row["queue"] = QUEUE
    return new


def test_concurrent_submissions_with_one_idempotency_key_make_one_job(client, auth):
    headers = {**auth, "Idempotency-Key": "same-key"}
    with ThreadPoolExecutor(12) as pool:
        responses = list(pool.map(lambda _: client.post("/v1/jobs", json=tiny_spec(), headers=headers), range(12)))
    assert sorted(r.status_code for r in responses) == [200] * 11 + [201]
    assert len({r.json()["id"] for r in responses}) == 1
    jobs = client.get("/v1/jobs", headers=auth).json()["data"]
    assert [j["id"] for j in jobs] == [responses[0].json()["id"]]
    client.post(f"/v1/jobs/{jobs[0]['id']}/cancel", headers=auth)


def test_one_batch_with_a_repeated_key_inserts_once_and_answers_the_rest(settings):
    key = new_key(settings)
    first, replay, other_body = (prepared(settings, key, "k", steps=s) for s in (20, 20, 21))
    plain = prepared(settings, key)
    with transaction(settings) as session:
        results = insert_submissions(session, [first, replay, other_body, plain])
    (job, created), (same, replayed), conflict, (plain_job, plain_created) = results
    assert created and not replayed and same.id == job.id == first.row["id"]
    assert isinstance(conflict, Conflict) and conflict.param == "Idempotency-Key"
    assert plain_created and plain_job.id == plain.row["id"]


def test_writer_isolates_a_failing_job_and_sends_tasks_only_for_committed_ones(settings, broker):
    key = new_key(settings)
    good = [prepared(settings, key) for _ in range(3)]
    bad = prepared(settings, key)
    bad.row["tenant_id"] = "ten_does_not_exist"  # a foreign-key violation fails the whole batch
    publisher = TaskPublisher(settings)
    writer = JobWriter(settings, publisher)
    futures = [writer.submit(new) for new in [good[0], bad, good[1], good[2]]]  # one batch: the thread is not started
    publisher.start()
    writer.start()
    results = [f.exception(timeout=30) or f.result() for f in futures]
    writer.stop()
    publisher.stop()
    assert isinstance(results[1], IntegrityError)
    assert [r[0].id for i, r in enumerate(results) if i != 1] == [g.row["id"] for g in good]
    assert all(r[1] for i, r in enumerate(results) if i != 1)
    assert sorted(queued_job_ids(broker)) == sorted(g.row["id"] for g in good)


def test_publisher_sends_every_task_once_in_batches(settings, broker):
    publisher = TaskPublisher(settings)
    ids = [f"job_{i:03d}" for i in range(300)]
    publisher.submit((job_id, QUEUE) for job_id in ids)  # queued before the thread starts: a few large batches
    publisher.start()
    publisher.stop()
    assert sorted(queued_job_ids(broker)) == ids


def test_key_cache_expires_and_is_bounded():
    cache = KeyCache(ttl=0.2, size=2)
    cache.put("a", "A")
    cache.put("b", "B")
    assert cache.get("a") == "A"  # now the most recently used
    cache.put("c", "C")  # evicts the least recently used: b
    assert (cache.get("a"), cache.get("b"), cache.get("c")) == ("A", None, "C")
    time.sleep(0.25)
    assert cache.get("a") is None and cache.get("c") is None
    off = KeyCache(ttl=0)
    off.put("a", "A")
    assert off.get("a") is None


def test_a_revoked_key_works_until_the_cache_entry_expires(settings):
    key = new_key(settings)
    cache = KeyCache(ttl=0.5)
    with transaction(settings) as session:
        tenant = authenticate(session, f"Bearer {key}", cache)
        with pytest.raises(Unauthorized):
            authenticate(session, "Bearer mf_unknown", cache)
        session.execute(update(ApiKey).where(ApiKey.key_hash == hash_key(key)).values(revoked_at=utcnow()))
    assert cache.get(hash_key("mf_unknown")) is None  # failures are never remembered
    with transaction(settings) as session:
        assert authenticate(session, f"Bearer {key}", cache) == tenant  # from the cache
        time.sleep(0.6)
        with pytest.raises(Unauthorized):
            authenticate(session, f"Bearer {key}", cache)


class Counter:
    """An exact count of active jobs, and how often it was asked."""

    def __init__(self, active: int) -> None:
        self.active, self.calls = active, 0

    def __call__(self) -> int:
        self.calls += 1
        return self.active


def test_admission_counts_once_while_far_below_the_cap():
    admission, count = Admission(refresh_seconds=60), Counter(active=10)
    assert all(admission.admit("t", 100, count) for _ in range(40))  # estimate 10 + 40 = half the cap
    assert count.calls == 1
    assert admission.admit("t", 100, count)  # beyond half the cap: count again
    assert count.calls == 2


def test_admission_counts_exactly_near_the_cap_and_before_refusing():
    admission, count = Admission(refresh_seconds=60), Counter(active=0)
    assert admission.admit("t", 2, count) and admission.admit("t", 2, count)
    count.active = 2
    assert not admission.admit("t", 2, count)
    calls = count.calls
    count.active = 0  # the tenant's jobs finished: the next submission is counted, not refused
    assert admission.admit("t", 2, count)
    assert count.calls == calls + 1


def test_admission_refreshes_its_count():
    admission, count = Admission(refresh_seconds=0.05), Counter(active=0)
    assert admission.admit("t", 100, count) and admission.admit("t", 100, count)
    assert count.calls == 1
    time.sleep(0.06)
    assert admission.admit("t", 100, count)
    assert count.calls == 2


def test_a_replayed_key_does_not_wait_for_its_job_while_holding_the_tenant_lock(settings):
    """A batch holds its tenants' locks; a job's status change locks the job, then (its trigger)
    the tenant. Were the batch to INSERT a key that job holds, the unique index would make it
    wait for that change, which waits for the batch: a deadlock. The key's holder is read first."""
    key = new_key(settings)
    first, again = prepared(settings, key, "k"), prepared(settings, key, "k")
    with transaction(settings) as session:
        [(job, created)] = insert_submissions(session, [first])
    assert created
    tenant_id = job.tenant_id
    with transaction(settings) as batch:
        TenantRepository(batch).lock([tenant_id])  # as insert_submissions does, before the cancel waits
        with ThreadPoolExecutor(1) as pool, transaction(settings) as cancel:
            pid = cancel.scalar(text("SELECT pg_backend_pid()"))
            cancelled = pool.submit(lifecycle.cancel_waiting, cancel, NoBus(), job.id)
            waiting = text("SELECT count(*) FROM pg_locks WHERE pid = :pid AND NOT granted")
            wait_for(lambda: batch.scalar(waiting, {"pid": pid}) > 0, timeout=10)
            [(replayed, created)] = insert_submissions(batch, [again])
            batch.commit()
            assert cancelled.result(timeout=10)
    assert replayed.id == job.id and not created
