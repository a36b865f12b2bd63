"""Dataset storage on real Postgres and Redis: a row and its file are committed together or not
at all, files no row names are swept, deletes, the per-tenant storage quota (exact under
concurrent uploads) and the bounded character vocabulary."""

from __future__ import annotations

import io
import os
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import psycopg
import pytest

from app.db.models import Dataset
from app.db.session import transaction
from app.errors import StorageQuotaExceeded
from app.repositories.tenants import DatasetRepository
from app.services.auth import authenticate
from app.services.datasets import CHUNK, ORPHAN_AGE_SECONDS, stage_upload, sweep_orphans
from app.services.intake import insert_submissions
from app.services.submission import prepare_submission
from app.storage import LocalStore
from contract.spec import JobSpec
from tests.support.api import new_key
from tests.support.net import wait_for
from tests.support.specs import tiny_spec
from worker.engine.facts import CHAR_VOCAB_MAX


def tenant_of(settings, key: str) -> str:
    with transaction(settings) as session:
        return authenticate(session, f"Bearer {key}").id


def files_of(settings, tenant_id: str) -> list[str]:
    directory = settings.artifact_dir / "datasets" / tenant_id
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


def upload(client, headers, body: bytes, name: str | None = None):
    data = {"name": name} if name else None
    return client.post("/v1/datasets", files={"file": ("corpus.txt", body)}, data=data, headers=headers)


def pg(database_url: str) -> psycopg.Connection:
    return psycopg.connect(database_url.replace("postgresql+psycopg://", "postgresql://"), autocommit=True)


@contextmanager
def settings_changed(settings, **values):
    before = {name: getattr(settings, name) for name in values}
    for name, value in values.items():
        setattr(settings, name, value)
    try:
        yield
    finally:
        for name, value in before.items():
            setattr(settings, name, value)


# -- a row and its file together ------------------------------------------------------------------
@pytest.fixture
def refusing_triggers(database_url):
    """Datasets named "fail-at-insert" are refused by their INSERT, those named "fail-at-commit"
    by the COMMIT (a deferred constraint trigger): the database fails the transaction after
    the upload's file is written."""
    with pg(database_url) as conn:
        conn.execute(
            "CREATE FUNCTION refuse_dataset() RETURNS trigger LANGUAGE plpgsql AS "
            "$$ BEGIN RAISE EXCEPTION 'dataset refused by the test trigger'; END $$"
        )
        conn.execute(
            "CREATE TRIGGER refuse_at_insert BEFORE INSERT ON datasets FOR EACH ROW "
            "WHEN (NEW.name = 'fail-at-insert') EXECUTE FUNCTION refuse_dataset()"
        )
        conn.execute(
            "CREATE CONSTRAINT TRIGGER refuse_at_commit AFTER INSERT ON datasets DEFERRABLE INITIALLY DEFERRED "
            "FOR EACH ROW WHEN (NEW.name = 'fail-at-commit') EXECUTE FUNCTION refuse_dataset()"
        )
    try:
        yield
    finally:
        with pg(database_url) as conn:
            conn.execute("DROP TRIGGER refuse_at_insert ON datasets")
            conn.execute("DROP TRIGGER refuse_at_commit ON datasets")
            conn.execute("DROP FUNCTION refuse_dataset()")


@pytest.mark.parametrize("name", ["fail-at-insert", "fail-at-commit"])
def test_a_transaction_that_fails_leaves_no_file(client, settings, refusing_triggers, name):
    key = new_key(settings)
    headers, tenant = {"Authorization": f"Bearer {key}"}, tenant_of(settings, key)
    with pytest.raises(Exception, match="dataset refused by the test trigger"):  # a 500 (TestClient re-raises it)
        upload(client, headers, b"some text\n" * 100, name=name)
    assert files_of(settings, tenant) == []
    assert client.get("/v1/datasets", headers=headers).json()["data"] == []
    ok = upload(client, headers, b"some text\n" * 100, name="fine")
    assert ok.status_code == 201, ok.text
    assert files_of(settings, tenant) == [f"{ok.json()['id']}.txt"]


def test_the_sweep_removes_old_files_that_no_row_names(client, settings, auth):
    kept = upload(client, auth, b"kept text\n" * 10).json()["id"]
    with transaction(settings) as session:
        tenant = DatasetRepository(session).get_any(kept).tenant_id
    directory = settings.artifact_dir / "datasets" / tenant
    old = time.time() - ORPHAN_AGE_SECONDS - 60
    orphans = ["ds_neverrecorded.txt", f"{kept}x.part", "ds_cutoff.part"]
    for name in orphans:
        (directory / name).write_text("left behind")
    (directory / "ds_young.txt").write_text("being committed")
    for name in [f"{kept}.txt", *orphans]:
        os.utime(directory / name, (old, old))
    with transaction(settings) as session:
        assert sweep_orphans(session, settings) == 3
    assert files_of(settings, tenant) == sorted([f"{kept}.txt", "ds_young.txt"])
    with transaction(settings) as session:
        assert sweep_orphans(session, settings, now=time.time() + ORPHAN_AGE_SECONDS + 60) == 1
    assert files_of(settings, tenant) == [f"{kept}.txt"]
    assert client.get(f"/v1/datasets/{kept}", headers=auth).status_code == 200


# -- delete ---------------------------------------------------------------------------------------
def test_delete_a_dataset(client, settings):
    key = new_key(settings)
    headers, tenant = {"Authorization": f"Bearer {key}"}, tenant_of(settings, key)
    ds = upload(client, headers, b"to be or not to be\n" * 50).json()
    other = {"Authorization": f"Bearer {new_key(settings)}"}
    for who, dataset_id in ((other, ds["id"]), (headers, "ds_nope")):
        r = client.delete(f"/v1/datasets/{dataset_id}", headers=who)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", r.text
        assert r.json()["error"]["param"] == "dataset_id"
    assert files_of(settings, tenant) == [f"{ds['id']}.txt"]

    spec = tiny_spec() | {"data": {"dataset_id": ds["id"], "tokenizer": "char"}}
    job = client.post("/v1/jobs", json=spec, headers=headers).json()
    r = client.delete(f"/v1/datasets/{ds['id']}", headers=headers)
    assert r.status_code == 409, r.text
    assert r.json()["error"]["code"] == "dataset_in_use" and r.json()["error"]["param"] == "dataset_id"
    assert "1 queued, running or paused job" in r.json()["error"]["message"]
    assert client.get(f"/v1/datasets/{ds['id']}", headers=headers).status_code == 200

    assert client.post(f"/v1/jobs/{job['id']}/cancel", headers=headers).json()["status"] == "cancelled"
    r = client.delete(f"/v1/datasets/{ds['id']}", headers=headers)
    assert r.status_code == 204 and r.content == b""
    assert files_of(settings, tenant) == []
    assert client.get(f"/v1/datasets/{ds['id']}", headers=headers).status_code == 404
    assert client.get("/v1/datasets", headers=headers).json()["data"] == []
    assert client.delete(f"/v1/datasets/{ds['id']}", headers=headers).status_code == 404
    assert client.get(f"/v1/jobs/{job['id']}", headers=headers).json()["spec"]["data"]["dataset_id"] == ds["id"]
    r = client.post("/v1/jobs", json=spec, headers=headers)
    assert r.status_code == 422 and r.json()["error"]["param"] == "data.dataset_id"


def test_a_job_prepared_before_its_dataset_was_deleted_is_refused_at_insert(client, settings):
    key = new_key(settings)
    headers = {"Authorization": f"Bearer {key}"}
    ds = upload(client, headers, b"short lived\n" * 20).json()
    spec = JobSpec.model_validate(tiny_spec() | {"data": {"dataset_id": ds["id"]}})
    with transaction(settings) as session:
        submission = prepare_submission(session, authenticate(session, f"Bearer {key}"), spec, None, settings)
    assert client.delete(f"/v1/datasets/{ds['id']}", headers=headers).status_code == 204
    with transaction(settings) as session:
        [result] = insert_submissions(session, [submission])
    assert isinstance(result, Exception) and result.param == "data.dataset_id", result
    assert client.get("/v1/jobs", headers=headers).json()["data"] == []


def test_delete_is_in_the_schema(client):
    operation = client.get("/openapi.json").json()["paths"]["/v1/datasets/{dataset_id}"]["delete"]
    assert {"204", "404", "409"} <= set(operation["responses"])
    assert operation["responses"]["409"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorBody")


# -- the storage quota ----------------------------------------------------------------------------
def test_uploads_over_the_tenant_storage_quota_are_refused(client, settings):
    key = new_key(settings)
    headers, tenant = {"Authorization": f"Bearer {key}"}, tenant_of(settings, key)
    with settings_changed(settings, tenant_storage_bytes=1500):
        first = upload(client, headers, b"a" * 600).json()
        assert upload(client, headers, b"b" * 600).status_code == 201
        r = upload(client, headers, b"c" * 600)
        assert r.status_code == 413, r.text
        error = r.json()["error"]
        assert (error["code"], error["param"]) == ("storage_quota_exceeded", "file")
        assert "1,500 bytes" in error["message"] and "1,200 bytes in use" in error["message"]
        assert upload(client, headers, b"d" * 300).status_code == 201  # exactly the quota
        assert len(files_of(settings, tenant)) == 3
        assert client.delete(f"/v1/datasets/{first['id']}", headers=headers).status_code == 204
        assert upload(client, headers, b"e" * 600).status_code == 201
    with settings_changed(settings, tenant_storage_bytes=0):
        r = upload(client, headers, b"x")
        assert r.status_code == 413 and r.json()["error"]["code"] == "storage_quota_exceeded"
    assert not any(name.endswith(".part") for name in files_of(settings, tenant))
    assert len(files_of(settings, tenant)) == 3


def test_concurrent_uploads_cannot_both_pass_the_quota(client, settings, database_url):
    """Both uploads see an empty quota when they start; the tenant's row, held here until both
    wait for it, decides: the first to get it stores its file, the second is refused."""
    key = new_key(settings)
    headers, tenant = {"Authorization": f"Bearer {key}"}, tenant_of(settings, key)
    waiting = "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
    pool = ThreadPoolExecutor(2)
    try:
        with (
            settings_changed(settings, tenant_storage_bytes=1500),
            pg(database_url) as holder,
            pg(database_url) as probe,
        ):
            with holder.transaction():
                holder.execute("SELECT id FROM tenants WHERE id = %s FOR UPDATE", (tenant,))
                futures = [pool.submit(upload, client, headers, bytes([97 + i]) * 1000) for i in range(2)]
                # (asked on a connection of its own: pg_stat_activity is read once per transaction)
                wait_for(lambda: probe.execute(waiting).fetchone()[0] >= 2, timeout=30)
            # The lock is released: the uploads go on, one at a time.
            statuses = sorted(f.result(timeout=60).status_code for f in futures)
    finally:
        pool.shutdown(wait=True)
    assert statuses == [201, 413]
    assert [f.result().json()["error"]["code"] for f in futures if f.result().status_code == 413] == [
        "storage_quota_exceeded"
    ]
    assert len(files_of(settings, tenant)) == 1


def test_reading_stops_once_past_the_limit_or_the_quota(tmp_path):
    class Counting(io.RawIOBase):
        def __init__(self, chunks: int) -> None:
            self.left, self.read_bytes = chunks, 0

        def read(self, size: int = -1) -> bytes:
            if self.left == 0:
                return b""
            self.left -= 1
            self.read_bytes += CHUNK
            return b"a" * CHUNK

    stream = Counting(chunks=10)
    with pytest.raises(StorageQuotaExceeded, match="1,572,864 bytes"):
        stage_upload(stream, LocalStore(tmp_path), limit=100 * CHUNK, quota=CHUNK + CHUNK // 2, used=0)
    assert stream.read_bytes == 2 * CHUNK
    stream = Counting(chunks=10)
    with pytest.raises(Exception, match=f"the upload exceeds {3 * CHUNK:,} bytes"):
        stage_upload(stream, LocalStore(tmp_path), limit=3 * CHUNK, quota=100 * CHUNK, used=0)
    assert stream.read_bytes == 4 * CHUNK


# -- the character vocabulary ---------------------------------------------------------------------
def test_the_character_vocabulary_is_counted_up_to_the_char_tokenizers_range(client, settings, auth):
    wide = "".join(chr(c) for c in range(0x10000, 0x10000 + 70_000)).encode()  # 70,000 distinct characters
    r = upload(client, auth, wide)
    assert r.status_code == 201, r.text
    ds = r.json()
    assert ds["char_tokenizer"] is False
    with transaction(settings) as session:
        assert session.get(Dataset, ds["id"]).char_vocab == CHAR_VOCAB_MAX + 1
    spec = tiny_spec() | {"data": {"dataset_id": ds["id"], "tokenizer": "char"}}
    r = client.post("/v1/jobs", json=spec, headers=auth)
    assert r.status_code == 422 and r.json()["error"]["param"] == "data.tokenizer"
    assert "more than 65,536 distinct characters" in r.json()["error"]["message"]
    spec["data"]["tokenizer"] = "byte"
    job = client.post("/v1/jobs", json=spec, headers=auth)
    assert job.status_code == 201, job.text
    client.post(f"/v1/jobs/{job.json()['id']}/cancel", headers=auth)

    narrow = upload(client, auth, "".join(chr(c) for c in range(0x20, 0x20 + 1000)).encode()).json()
    assert narrow["char_tokenizer"] is True
    with transaction(settings) as session:
        assert session.get(Dataset, narrow["id"]).char_vocab == 1000


def test_an_upload_counts_distinct_characters_exactly_up_to_the_range(tmp_path):
    store = LocalStore(tmp_path)
    exact = "".join(chr(c) for c in range(0x10000, 0x10000 + CHAR_VOCAB_MAX)).encode()
    assert stage_upload(io.BytesIO(exact * 2), store, 1 << 30, 1 << 30, 0)[1] == CHAR_VOCAB_MAX
    over = exact + "€".encode()
    staged, char_vocab, _ = stage_upload(io.BytesIO(over), store, 1 << 30, 1 << 30, 0)
    assert char_vocab == CHAR_VOCAB_MAX + 1
    assert (tmp_path / staged.key).read_bytes() == over
