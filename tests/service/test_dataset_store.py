"""Datasets on an S3 artifact store (moto's server on 127.0.0.1, or MUONFORGE_TEST_S3_URL's): an
upload lands at its key with the sha256 its row records, a refused upload or a failed transaction
leaves no object, a delete removes the object, the sweep removes objects no row names, and a store
that cannot be reached answers 503."""

from __future__ import annotations

import hashlib
import io
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fastapi.testclient import TestClient

from app.db.models import Dataset
from app.db.session import transaction
from app.main import create_app
from app.services import datasets as service
from app.services.datasets import ORPHAN_AGE_SECONDS, sweep_orphans
from app.settings import Settings
from app.storage import STAGING, ArtifactStore, StoreUnavailable, store_from
from tests.service.test_datasets import refusing_triggers, tenant_of  # noqa: F401
from tests.support.api import new_key
from tests.support.s3 import S3Server, s3_server  # noqa: F401
from tests.support.specs import tiny_spec


@pytest.fixture(scope="module")
def s3_settings(settings: Settings, s3_server: S3Server) -> Iterator[Settings]:  # noqa: F811
    """The session's settings with the artifacts under a bucket prefix of this module's own, the
    AWS variables that reach it set for the module's tests."""
    with pytest.MonkeyPatch.context() as env:
        for name, value in s3_server.env.items():
            env.setenv(name, value)
        yield settings.model_copy(update={"artifact_url": s3_server.scoped("datasets")})


@pytest.fixture(scope="module")
def s3_client(s3_settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(s3_settings, reaper=False)) as c:
        yield c


@pytest.fixture
def store(s3_settings: Settings) -> ArtifactStore:
    return store_from(s3_settings)


@pytest.fixture
def tenant(s3_settings: Settings) -> tuple[dict[str, str], str]:
    """A fresh tenant's headers and id."""
    key = new_key(s3_settings)
    return {"Authorization": f"Bearer {key}"}, tenant_of(s3_settings, key)


def upload(client: TestClient, headers: dict[str, str], filename: str, body: bytes, name: str | None = None):
    data = {"name": name} if name else None
    return client.post("/v1/datasets", files={"file": (filename, body)}, data=data, headers=headers)


def keys(store: ArtifactStore, prefix: str) -> list[str]:
    return sorted(o.key for o in store.list(prefix))


def parquet_bytes() -> bytes:
    out = io.BytesIO()
    pq.write_table(pa.table({"text": ["one row", "another"], "n": [1, 2]}), out)
    return out.getvalue()


def test_an_upload_lands_at_its_key_with_its_recorded_sha256(s3_client, s3_settings, store, tenant, tmp_path):
    headers, tenant_id = tenant
    bodies = {
        "a.txt": "some text, ünïcode\n".encode() * 1000,
        "b.jsonl": b"".join(json.dumps({"text": f"row {i}"}).encode() + b"\n" for i in range(50)),
        "c.parquet": parquet_bytes(),
    }
    for filename, body in bodies.items():
        r = upload(s3_client, headers, filename, body)
        assert r.status_code == 201, r.text
        with transaction(s3_settings) as session:
            row = session.get(Dataset, r.json()["id"])
            assert row is not None
            path, size, sha256 = row.path, row.bytes, row.sha256
        assert path == f"datasets/{tenant_id}/{row.id}{Path(filename).suffix}"
        assert (size, sha256) == (len(body), hashlib.sha256(body).hexdigest())
        assert store.fetch(path, tmp_path / filename, size, sha256).read_bytes() == body
        assert not (s3_settings.artifact_dir / path).exists()  # in the bucket, not the artifact directory
    assert len(keys(store, f"datasets/{tenant_id}")) == 3
    assert keys(store, STAGING) == []
    table = r.json()["id"]  # the parquet dataset: its columns are known with no read of the object
    for column, status in (("text", 201), ("body", 422)):
        spec = tiny_spec() | {"data": {"dataset_id": table, "text_column": column}}
        created = s3_client.post("/v1/jobs", json=spec, headers=headers)
        assert created.status_code == status, created.text
    assert "its columns: text, n" in created.json()["error"]["message"]


def test_a_refused_upload_leaves_nothing_in_the_bucket(s3_client, store, tenant):
    headers, tenant_id = tenant
    r = upload(s3_client, headers, "chat.jsonl", b'{"text": "a"}\n{"text": "b"}\nnot json\n')
    assert r.status_code == 422 and r.json()["error"]["message"].startswith("line 3: "), r.text
    r = upload(s3_client, headers, "bad.parquet", b"PAR1 not really a parquet file")
    assert r.status_code == 422 and "not a readable parquet file" in r.json()["error"]["message"], r.text
    assert keys(store, f"datasets/{tenant_id}") == []
    assert keys(store, STAGING) == []
    assert s3_client.get("/v1/datasets", headers=headers).json()["data"] == []


@pytest.mark.usefixtures("refusing_triggers")
@pytest.mark.parametrize("name", ["fail-at-insert", "fail-at-commit"])
def test_a_transaction_that_fails_leaves_no_object(s3_client, store, tenant, name):
    headers, tenant_id = tenant
    with pytest.raises(Exception, match="dataset refused by the test trigger"):  # a 500 (TestClient re-raises it)
        upload(s3_client, headers, "corpus.txt", b"some text\n" * 100, name=name)
    assert keys(store, f"datasets/{tenant_id}") == []
    assert keys(store, STAGING) == []
    assert s3_client.get("/v1/datasets", headers=headers).json()["data"] == []


def test_a_delete_removes_the_object(s3_client, store, tenant):
    headers, tenant_id = tenant
    ds = upload(s3_client, headers, "corpus.txt", b"to be deleted\n" * 20).json()
    assert keys(store, f"datasets/{tenant_id}") == [f"datasets/{tenant_id}/{ds['id']}.txt"]
    assert s3_client.delete(f"/v1/datasets/{ds['id']}", headers=headers).status_code == 204
    assert keys(store, f"datasets/{tenant_id}") == []


def test_the_sweep_removes_old_objects_that_no_row_names(s3_client, s3_settings, store, tenant):
    headers, tenant_id = tenant
    kept = upload(s3_client, headers, "corpus.txt", b"kept text\n" * 10).json()["id"]
    for key in (f"datasets/{tenant_id}/ds_neverrecorded.txt", None):  # an orphan, and a write never committed
        with store.writer() as writer:
            writer.write(b"left behind")
        assert writer.staged is not None
        if key is not None:
            store.commit(writer.staged.key, key)
    assert len(keys(store, STAGING)) == 1
    with transaction(s3_settings) as session:
        assert sweep_orphans(session, s3_settings) == 0  # all young
    assert len(keys(store, f"datasets/{tenant_id}")) == 2 and len(keys(store, STAGING)) == 1
    with transaction(s3_settings) as session:
        assert sweep_orphans(session, s3_settings, now=time.time() + ORPHAN_AGE_SECONDS + 60) == 1
    assert keys(store, f"datasets/{tenant_id}") == [f"datasets/{tenant_id}/{kept}.txt"]
    assert keys(store, STAGING) == []
    assert s3_client.get(f"/v1/datasets/{kept}", headers=headers).status_code == 200


def test_a_store_that_cannot_be_reached_answers_503(s3_client, tenant, monkeypatch):
    class Down:
        def writer(self):
            raise StoreUnavailable("write staging/x: connection refused")

    monkeypatch.setattr(service, "store_from", lambda settings: Down())
    headers, _ = tenant
    r = upload(s3_client, headers, "corpus.txt", b"some text\n")
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "service_unavailable" and r.headers["Retry-After"] == "30"
    assert s3_client.get("/v1/datasets", headers=headers).json()["data"] == []
