"""Resumable uploads in parts: sent in any order and in parallel, resumed, completed into a dataset or
a model; missing, corrupted and changed parts refused; expiry. On the local store and on an S3 bucket
(moto's server on 127.0.0.1, or MUONFORGE_TEST_S3_URL's)."""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
from fastapi.testclient import TestClient

from app.db.base import utcnow
from app.db.models import Upload
from app.db.session import transaction
from app.main import create_app
from app.repositories.uploads import UploadRepository
from app.services.reaper import sweep_once
from app.settings import Settings
from app.storage import ArtifactStore, store_from
from contract.status import UploadStatus
from tests.service.test_models import files_in, tar_of, tiny_llama
from tests.support.api import new_key
from tests.support.s3 import s3_server  # noqa: F401

CORPUS = "".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(3000)).encode()


@pytest.fixture(scope="module", params=["local", "s3"])
def api(request, settings, tmp_path_factory) -> Iterator[tuple[TestClient, Settings]]:
    """The API on the local store, then on a bucket of its own."""
    if request.param == "local":
        with TestClient(create_app(settings, reaper=False)) as client:
            yield client, settings
        return
    server = request.getfixturevalue("s3_server")
    root = tmp_path_factory.mktemp("uploads-s3")
    bucket = settings.model_copy(
        update={
            "artifact_url": server.scoped("uploads"),
            "artifact_dir": root / "artifacts",
            "cache_dir": root / "cache",
        }
    )
    with pytest.MonkeyPatch.context() as patch:
        for name, value in server.env.items():
            patch.setenv(name, value)
        with TestClient(create_app(bucket, reaper=False)) as client:
            yield client, bucket


@pytest.fixture
def auth(api) -> dict[str, str]:
    return {"Authorization": f"Bearer {new_key(api[1])}"}


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def cut(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


def create(client: TestClient, auth: dict[str, str], data: bytes, filename: str, purpose: str = "dataset") -> dict:
    r = client.post("/v1/uploads", json={"purpose": purpose, "filename": filename, "bytes": len(data)}, headers=auth)
    assert r.status_code == 201, r.text
    return r.json()


def put(client: TestClient, auth: dict[str, str], upload_id: str, number: int, data: bytes, **headers: str):
    return client.put(f"/v1/uploads/{upload_id}/parts/{number}", content=data, headers={**auth, **headers})


def complete(client: TestClient, auth: dict[str, str], upload_id: str, parts: list[bytes]):
    listed = [{"number": n, "sha256": sha(p)} for n, p in enumerate(parts, 1)]
    return client.post(f"/v1/uploads/{upload_id}/complete", json={"parts": listed}, headers=auth)


def part_objects(store: ArtifactStore, upload_id: str) -> list[str]:
    return [o.key for o in store.list(f"uploads/{upload_id}")]


def test_a_dataset_sent_in_parts_in_parallel_and_out_of_order_is_the_file(api, auth):
    client, settings = api
    parts = cut(CORPUS, 40_000)
    upload = create(client, auth, CORPUS, "corpus.txt")
    assert upload["status"] == UploadStatus.PENDING and upload["parts"] == [] and upload["expires_at"]
    numbered = list(enumerate(parts, 1))[::-1]
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda np: put(client, auth, upload["id"], *np), numbered))
    assert [a.status_code for a in answers] == [200] * len(parts)
    assert {a.json()["number"]: a.json()["sha256"] for a in answers} == {n: sha(p) for n, p in numbered}
    listed = client.get(f"/v1/uploads/{upload['id']}", headers=auth).json()
    assert [p["number"] for p in listed["parts"]] == list(range(1, len(parts) + 1))

    done = complete(client, auth, upload["id"], parts)
    assert done.status_code == 200, done.text
    assert done.json()["status"] == "completed" and done.json()["dataset_id"]
    dataset = client.get(f"/v1/datasets/{done.json()['dataset_id']}", headers=auth).json()
    assert (dataset["bytes"], dataset["sha256"], dataset["name"]) == (len(CORPUS), sha(CORPUS), "corpus.txt")
    assert part_objects(store_from(settings), upload["id"]) == []  # the parts are deleted once it is made
    again = complete(client, auth, upload["id"], parts)
    assert again.status_code == 409 and again.json()["error"]["code"] == "upload_not_pending"


def test_an_interrupted_upload_resumes_with_the_parts_it_lacks(api, auth):
    client, _ = api
    parts = cut(CORPUS, 50_000)
    upload = create(client, auth, CORPUS, "resumed.txt")
    for n in (1, 3):  # then the client stopped
        assert put(client, auth, upload["id"], n, parts[n - 1]).status_code == 200
    received = client.get(f"/v1/uploads/{upload['id']}", headers=auth).json()["parts"]
    have = {p["number"]: p["sha256"] for p in received}
    assert have == {1: sha(parts[0]), 3: sha(parts[2])}
    for n, part in enumerate(parts, 1):
        if have.get(n) != sha(part):
            assert put(client, auth, upload["id"], n, part).status_code == 200
    done = complete(client, auth, upload["id"], parts)
    assert done.status_code == 200 and done.json()["dataset_id"]


def test_a_missing_or_corrupted_part_is_refused_at_complete_and_can_be_sent_again(api, auth):
    client, settings = api
    parts = cut(CORPUS, 60_000)
    upload = create(client, auth, CORPUS, "fixed.txt")
    for n, part in enumerate(parts[:-1], 1):
        put(client, auth, upload["id"], n, part)
    missing = complete(client, auth, upload["id"], parts)
    assert missing.status_code == 409 and missing.json()["error"]["code"] == "upload_parts_mismatch"
    assert f"part(s) {len(parts)} not received" in missing.json()["error"]["message"]

    flipped = bytes([parts[-1][0] ^ 1]) + parts[-1][1:]  # corrupted on the way: the server has other bytes
    put(client, auth, upload["id"], len(parts), flipped)
    corrupted = complete(client, auth, upload["id"], parts)
    assert corrupted.status_code == 409 and f"part(s) {len(parts)}: the sha256" in corrupted.json()["error"]["message"]

    digest = "sha-256=:" + base64.b64encode(hashlib.sha256(parts[-1]).digest()).decode() + ":"
    refused = put(client, auth, upload["id"], len(parts), flipped, **{"Repr-Digest": digest})
    assert refused.status_code == 422 and refused.json()["error"]["param"] == "body"
    resent = put(client, auth, upload["id"], len(parts), parts[-1], **{"Repr-Digest": digest})
    assert resent.status_code == 200
    done = complete(client, auth, upload["id"], parts)
    assert done.status_code == 200, done.text
    assert client.get(f"/v1/datasets/{done.json()['dataset_id']}", headers=auth).json()["sha256"] == sha(CORPUS)
    assert part_objects(store_from(settings), upload["id"]) == []  # the replaced part's object too


def test_a_part_changed_in_the_store_is_refused_at_complete_and_the_upload_stays_pending(api, auth):
    client, settings = api
    parts = cut(CORPUS, 70_000)
    upload = create(client, auth, CORPUS, "changed.txt")
    for n, part in enumerate(parts, 1):
        put(client, auth, upload["id"], n, part)
    store = store_from(settings)
    key = next(k for k in part_objects(store, upload["id"]) if k.split("/")[-1].startswith("00001."))
    with store.writer() as w:
        w.write(b"X" + parts[0][1:])  # the same size, another first byte, behind the service's back
    store.commit(w.staged.key, key)
    refused = complete(client, auth, upload["id"], parts)
    assert refused.status_code == 409 and refused.json()["error"]["message"] == (
        "part 1 changed in the service's storage since it was received; send it again"
    )
    assert client.get(f"/v1/uploads/{upload['id']}", headers=auth).json()["status"] == "pending"
    assert client.get("/v1/datasets", headers=auth).json()["data"] == []
    put(client, auth, upload["id"], 1, parts[0])
    assert complete(client, auth, upload["id"], parts).status_code == 200


def test_a_model_archive_goes_up_in_parts(api, auth, tmp_path):
    client, _ = api
    tiny_llama(tmp_path)
    archive = tar_of(files_in(tmp_path))
    parts = cut(archive, 5 * 2**20 + 7)
    upload = create(client, auth, archive, "llama.tar", purpose="model")
    for n, part in reversed(list(enumerate(parts, 1))):
        assert put(client, auth, upload["id"], n, part).status_code == 200
    done = complete(client, auth, upload["id"], parts)
    assert done.status_code == 200, done.text
    model = client.get(f"/v1/models/{done.json()['model_id']}", headers=auth).json()
    assert model["name"] == "llama.tar" and "config.json" in model["files"]


def test_limits_expiry_and_cancel(api, auth):
    client, settings = api
    too_big = client.post(
        "/v1/uploads",
        json={"purpose": "dataset", "filename": "big.txt", "bytes": settings.upload_limit_bytes + 1},
        headers=auth,
    )
    assert too_big.status_code == 413 and too_big.json()["error"]["code"] == "payload_too_large"
    upload = create(client, auth, b"0123456789", "small.txt")
    over = put(client, auth, upload["id"], 1, b"0123456789ab")
    assert over.status_code == 413 and over.json()["error"]["message"].endswith("created for 10 bytes")
    assert put(client, auth, upload["id"], 0, b"x").status_code == 422
    assert put(client, auth, upload["id"], 1, b"").status_code == 422

    assert put(client, auth, upload["id"], 1, b"01234").status_code == 200
    with transaction(settings) as session:
        row = session.get(Upload, upload["id"])
        row.expires_at = utcnow() - timedelta(seconds=1)
    gone = put(client, auth, upload["id"], 2, b"56789")
    assert gone.status_code == 410 and gone.json()["error"]["code"] == "upload_expired"
    store = store_from(settings)
    assert len(part_objects(store, upload["id"])) == 1
    sweep_once(settings)  # the reaper's sweep
    assert client.get(f"/v1/uploads/{upload['id']}", headers=auth).json()["status"] == "expired"
    assert part_objects(store, upload["id"]) == []

    cancelled = create(client, auth, b"abc", "c.txt")
    put(client, auth, cancelled["id"], 1, b"abc")
    answer = client.post(f"/v1/uploads/{cancelled['id']}/cancel", headers=auth)
    assert answer.status_code == 200 and answer.json()["status"] == "cancelled"
    assert part_objects(store, cancelled["id"]) == []
    other = {"Authorization": f"Bearer {new_key(settings)}"}
    assert client.get(f"/v1/uploads/{upload['id']}", headers=other).status_code == 404
    with transaction(settings) as session:
        assert UploadRepository(session).get(upload["id"], "nobody") is None
