"""Checkpoints through an S3 bucket: the store is the only medium the API and two workers share.

The API (in this process) and each worker process have an artifact directory and a cache of their
own; the bucket is moto's server on 127.0.0.1 (or MUONFORGE_TEST_S3_URL's). A job trains on an
uploaded dataset, its checkpoints go up to the bucket while it trains, a worker killed mid-job is
followed by the other, which resumes from the bucket, and the checkpoints come back down through
the API (whole, verified, or by byte range) and as exports.
"""

from __future__ import annotations

import hashlib
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from app.api.ranges import byte_range
from app.db.models import Job
from app.db.session import transaction
from app.main import create_app
from app.messaging.live_bus import NoBus
from app.repositories.checkpoints import CheckpointRepository
from app.services import lifecycle
from app.services.job_journal import record_checkpoint
from app.settings import Settings
from app.storage import IntegrityError, LocalStore, ObjectNotFound, Staged, store_from
from app.storage.base import file_sha256, verified
from tests.engine.test_uploaded_models import save_upload
from tests.service.test_model_jobs import from_model
from tests.service.test_models import files_in, tar_of
from tests.support.api import events, job, new_key
from tests.support.net import wait_for
from tests.support.s3 import S3Server, s3_server  # noqa: F401
from tests.support.services import launch, service_env, stop, wait_worker
from tests.support.specs import tiny_spec
from worker.artifacts import checkpoint_key
from worker.sink import JobSink

pytestmark = pytest.mark.system
CORPUS = b"to be, or not to be, that is the question: whether 'tis nobler in the mind to suffer. " * 40
FINISHED = ("succeeded", "failed", "cancelled")


@dataclass
class WorkerProcess:
    """A worker process of a test, its own directory and its log."""

    proc: subprocess.Popen
    home: Path
    log_path: Path

    def kill(self) -> None:
        """SIGKILL: no cleanup; what it held on its own disk is out of everyone's reach."""
        self.proc.kill()
        self.proc.wait(10)


@dataclass
class Deployment:
    """An API and its workers that share a bucket and nothing else on disk."""

    settings: Settings  # the API's: the bucket, and its own artifact and cache directories
    client: TestClient
    root: Path
    env: dict[str, str]  # what a worker process reads, less its own directories
    server: S3Server
    workers: list[WorkerProcess]

    def start_worker(self, name: str, **env: str) -> WorkerProcess:
        """A worker process with an artifact directory and a cache of its own."""
        home = self.root / name
        own = {"MUONFORGE_ARTIFACT_DIR": str(home / "artifacts"), "MUONFORGE_CACHE_DIR": str(home / "cache")}
        log_path = home / "worker.log"
        home.mkdir(parents=True, exist_ok=True)
        proc = launch(["worker", "--queues", "default,cpu"], {**self.env, **own, **env}, log_path)
        wait_worker(proc, log_path)
        self.workers.append(WorkerProcess(proc, home, log_path))
        return self.workers[-1]

    def stop_workers(self) -> None:
        for worker in self.workers:
            stop(worker.proc)
        self.workers.clear()


@pytest.fixture(scope="module")
def deployment(settings, s3_server, tmp_path_factory) -> Iterator[Deployment]:  # noqa: F811
    """The API on a bucket of its own, in this process; workers are started by each test."""
    url, root = s3_server.scoped("checkpoints"), tmp_path_factory.mktemp("deployment")
    api = settings.model_copy(
        update={"artifact_url": url, "artifact_dir": root / "api" / "artifacts", "cache_dir": root / "api" / "cache"}
    )
    env = {**service_env(settings), **s3_server.env, "MUONFORGE_ARTIFACT_URL": url}
    with pytest.MonkeyPatch.context() as patch:
        for name, value in s3_server.env.items():
            patch.setenv(name, value)
        with TestClient(create_app(api)) as client:
            found = Deployment(api, client, root, env, s3_server, [])
            try:
                yield found
            finally:
                found.stop_workers()


@pytest.fixture
def auth(deployment) -> dict[str, str]:
    """Headers of a fresh tenant; the test's workers are stopped after it."""
    yield {"Authorization": f"Bearer {new_key(deployment.settings)}"}
    deployment.stop_workers()


def upload(client: TestClient, auth: dict[str, str]) -> str:
    r = client.post("/v1/datasets", files={"file": ("lines.txt", CORPUS)}, headers=auth)
    assert r.status_code == 201, r.text
    return r.json()["id"]


def corpus_spec(dataset_id: str, steps: int, **train: Any) -> dict:
    return tiny_spec(steps=steps, **train) | {"data": {"dataset_id": dataset_id}}


def keys(settings: Settings, job_id: str) -> dict[int, str]:
    """The store key each of the job's checkpoint rows records, by step."""
    with transaction(settings) as session:
        return {c.step: c.path for c in CheckpointRepository(session).checkpoints(job_id)}


def files_under(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file()) if path.exists() else []


def test_a_worker_killed_mid_job_is_followed_by_another_that_resumes_from_the_bucket(deployment, auth):
    client, store = deployment.client, store_from(deployment.settings)
    first = deployment.start_worker("first")
    dataset_id = upload(client, auth)
    created = client.post(
        "/v1/jobs", json=corpus_spec(dataset_id, 600, checkpoint_every=50, eval_every=100), headers=auth
    )
    job_id = created.json()["id"]

    def recorded() -> list[dict]:
        return client.get(f"/v1/jobs/{job_id}/checkpoints", headers=auth).json()["data"]

    wait_for(lambda: job(client, auth, job_id)["progress"]["step"] >= 120 and recorded(), timeout=120, interval=0.02)
    first.kill()
    killed_at = job(client, auth, job_id)["progress"]["step"]
    second = deployment.start_worker("second")
    done = wait_for(lambda: (j := job(client, auth, job_id))["status"] in FINISHED and j, timeout=180)
    assert done["status"] == "succeeded" and done["attempt"] == 2 and done["progress"]["step"] == 600

    resumed = [
        p["message"] for kind, p in events(deployment.settings, job_id) if kind == "log" and "resumed" in p["message"]
    ]
    assert len(resumed) == 1
    resumed_step = int(resumed[0].split("at step ")[1])
    assert resumed_step % 50 == 0 and 50 <= resumed_step <= killed_at
    assert f"checkpoint {resumed_step} restored from the store" in second.log_path.read_text()

    # Every checkpoint kept is in the bucket with the size and sha256 its row records.
    kept, stored = recorded(), keys(deployment.settings, job_id)
    assert {c["step"] for c in kept} >= {600, 550, 500}
    assert stored[600] == checkpoint_key(job_id, 600, attempt=2)  # the attempt that stored it
    for c in kept:
        key = stored[c["step"]]
        digest = hashlib.sha256(b"".join(store.open_range(key))).hexdigest()
        assert store.stat(key).size == c["bytes"] and digest == c["sha256"]
    listed = {o.key for o in store.list(f"jobs/{job_id}/checkpoints")}
    assert listed == set(stored.values())  # retention deleted the others from the bucket
    # Nothing but the bucket held the dataset or a checkpoint for the API; the workers' copies went
    # with the job's end (the second) or stayed on the killed worker's disk (the first).
    assert files_under(deployment.settings.artifact_dir / "jobs") == []
    assert files_under(deployment.settings.artifact_dir / "datasets") == []
    assert files_under(second.home / "artifacts" / "jobs" / job_id / "checkpoints") == []

    # Downloads come from the bucket through the API: whole and verified, or a byte range of it.
    whole = client.get(f"/v1/jobs/{job_id}/checkpoints/600", headers=auth)
    assert whole.status_code == 200 and whole.headers["accept-ranges"] == "bytes"
    assert hashlib.sha256(whole.content).hexdigest() == kept[0]["sha256"] == whole.headers["etag"].strip('"')
    part = client.get(f"/v1/jobs/{job_id}/checkpoints/600", headers={**auth, "Range": "bytes=100-"})
    assert part.status_code == 206 and part.content == whole.content[100:]
    assert part.headers["content-range"] == f"bytes 100-{len(whole.content) - 1}/{len(whole.content)}"
    stale = {**auth, "Range": "bytes=100-", "If-Range": '"' + "0" * 64 + '"'}
    assert client.get(f"/v1/jobs/{job_id}/checkpoints/600", headers=stale).content == whole.content
    beyond = client.get(f"/v1/jobs/{job_id}/checkpoints/600", headers={**auth, "Range": f"bytes={len(whole.content)}-"})
    assert beyond.status_code == 416 and beyond.headers["content-range"] == f"bytes */{len(whole.content)}"
    exported = client.get(f"/v1/jobs/{job_id}/checkpoints/600", params={"format": "safetensors"}, headers=auth)
    assert exported.status_code == 200 and exported.content[:8]  # through the API's cache of the bucket


def test_the_store_down_for_30_s_while_checkpoints_go_up_loses_nothing(deployment, auth):
    """The bucket stops answering while the job trains: its checkpoints wait and are tried again
    (the trainer goes on, then waits for them); once the bucket is back they are stored, and the
    job ends in its first attempt with every metric and checkpoint."""
    if deployment.server.moto is None:
        pytest.skip("stops the S3 server: moto's only")
    client = deployment.client
    worker = deployment.start_worker("patient", MUONFORGE_OUTAGE_PATIENCE_SECONDS="120")
    spec = tiny_spec(steps=1000, checkpoint_every=20, eval_every=100, keep_checkpoints=2)
    job_id = client.post("/v1/jobs", json=spec, headers=auth).json()["id"]
    wait_for(lambda: job(client, auth, job_id)["progress"]["step"] >= 40, timeout=120, interval=0.02)
    deployment.server.stop()
    try:
        time.sleep(30)
        assert job(client, auth, job_id)["status"] == "running"
    finally:
        deployment.server.start()
    done = wait_for(lambda: (j := job(client, auth, job_id))["status"] in FINISHED and j, timeout=180)
    assert done["status"] == "succeeded" and done["attempt"] == 1, done
    assert "storing checkpoint" in worker.log_path.read_text()  # it was tried again
    history = client.get(f"/v1/jobs/{job_id}/metrics", params={"names": "loss", "max_points": 1000}, headers=auth)
    series = {s["name"]: s["points"] for s in history.json()["series"]}
    assert [p[0] for p in series["loss"]] == list(range(1000))
    recorded = [p["step"] for kind, p in events(deployment.settings, job_id) if kind == "checkpoint"]
    assert recorded == list(range(20, 1001, 20))  # each stored once, in order
    store = store_from(deployment.settings)
    kept = client.get(f"/v1/jobs/{job_id}/checkpoints", headers=auth).json()["data"]
    assert {c["step"] for c in kept} >= {1000, 980}
    stored = keys(deployment.settings, job_id)
    assert all(store.stat(stored[c["step"]]).size == c["bytes"] for c in kept)


def test_a_checkpoint_changed_in_the_bucket_is_refused_at_read(deployment, auth):
    client, store = deployment.client, store_from(deployment.settings)
    deployment.start_worker("reader")
    job_id = client.post("/v1/jobs", json=tiny_spec(steps=20), headers=auth).json()["id"]
    done = wait_for(lambda: (j := job(client, auth, job_id))["status"] in FINISHED and j, timeout=120)
    assert done["status"] == "succeeded"
    key = keys(deployment.settings, job_id)[20]
    original = b"".join(store.open_range(key))
    with store.writer() as w:
        w.write(bytes([original[0] ^ 1]) + original[1:])  # the same size, another first byte
    store.commit(w.staged.key, key)

    exported = client.get(f"/v1/jobs/{job_id}/checkpoints/20", params={"format": "safetensors"}, headers=auth)
    assert exported.status_code == 502 and exported.json()["error"]["code"] == "artifact_changed"
    with pytest.raises(IntegrityError):  # the whole file is cut short before its last chunk (a server
        client.get(f"/v1/jobs/{job_id}/checkpoints/20", headers=auth)  # closes the connection there)
    spec = tiny_spec(steps=10) | {"init_from": {"job_id": job_id, "step": 20}}
    warm = client.post("/v1/jobs", json=spec, headers=auth).json()["id"]
    failed = wait_for(lambda: (j := job(client, auth, warm))["status"] in FINISHED and j, timeout=120)
    assert failed["status"] == "failed" and failed["error"]["code"] == "init_checkpoint_changed"

    store.delete(key)
    gone = client.get(f"/v1/jobs/{job_id}/checkpoints/20", headers=auth)
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "step"


def test_a_file_in_the_local_stores_directory_is_staged_where_it_is(tmp_path):
    store = LocalStore(tmp_path / "root")
    inside = tmp_path / "root" / "jobs" / "j" / "step.pt"
    inside.parent.mkdir(parents=True)
    inside.write_bytes(b"weights")
    staged = store.stage_file(inside)
    assert (staged.key, staged.size) == ("jobs/j/step.pt", 7)
    assert staged.sha256 == hashlib.sha256(b"weights").hexdigest()
    store.commit(staged.key, staged.key)  # committing it where it is changes nothing
    assert inside.read_bytes() == b"weights"
    outside = tmp_path / "elsewhere.pt"
    outside.write_bytes(b"other")
    copied = store.stage_file(outside)
    assert copied.key.startswith("staging/") and store.path(copied.key).read_bytes() == b"other"
    with pytest.raises(ObjectNotFound):
        store.open_range("jobs/j/none.pt")


def test_a_whole_read_holds_its_last_chunk_back_until_it_is_verified():
    chunks = [b"abc", b"def", b"gh"]
    good = hashlib.sha256(b"abcdefgh").hexdigest()
    assert list(verified("k", chunks, 8, good)) == chunks
    sent = []
    with pytest.raises(IntegrityError, match="sha256"):
        sent.extend(verified("k", chunks, 8, "0" * 64))
    assert sent == [b"abc", b"def"]  # never the whole
    with pytest.raises(IntegrityError, match="bytes stored"):
        list(verified("k", chunks, 9, good))
    assert list(verified("k", chunks, 8, None)) == chunks  # a row without a digest: the size alone


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        (None, None),
        ("bytes=0-9", (0, 10)),
        ("bytes=10-", (10, 100)),
        ("bytes=-30", (70, 100)),
        ("bytes=-300", (0, 100)),
        ("bytes=90-500", (90, 100)),
        ("bytes=100-", (100, 100)),  # past the end: 416
        ("bytes=-0", (100, 100)),
        ("bytes=9-3", None),  # invalid: the whole object
        ("bytes=0-1,5-6", None),  # several ranges: the whole object
        ("items=0-1", None),
        ("bytes=-", None),
    ],
)
def test_a_range_header_is_read_as_rfc_9110_asks(header, expected):
    assert byte_range(header, 100) == expected


def test_an_uploaded_model_reaches_a_worker_through_the_bucket(deployment, auth, tmp_path):
    """A model uploaded to the API goes to the bucket file by file (the API keeps no copy); a worker
    with nothing of it on disk trains from it through its cache, and the model's delete empties
    the bucket of it."""
    client, store = deployment.client, store_from(deployment.settings)
    worker = deployment.start_worker("modeller")
    save_upload(tmp_path, "llama")
    uploaded = client.post("/v1/models", files={"file": ("llama.tar", tar_of(files_in(tmp_path)))}, headers=auth)
    assert uploaded.status_code == 201, uploaded.text
    model = uploaded.json()
    objects = {o.key.rsplit("/", 1)[1]: o for o in store.list("models") if f"/{model['id']}/" in o.key}
    assert set(objects) == set(model["files"])
    assert files_under(deployment.settings.artifact_dir / "models") == []  # the bucket is the only copy
    assert all(
        hashlib.sha256(b"".join(store.open_range(o.key))).hexdigest() == file_sha256(tmp_path / name)
        for name, o in objects.items()
    )

    spec = from_model(model["id"])
    job_id = client.post("/v1/jobs", json=spec, headers=auth).json()["id"]
    done = wait_for(lambda: (j := job(client, auth, job_id))["status"] in FINISHED and j, timeout=180)
    assert done["status"] == "succeeded", done
    cached = {p.name for p in (worker.home / "cache" / "objects").iterdir()}
    assert {file_sha256(tmp_path / name) for name in objects} <= cached  # each file came through the cache
    assert client.delete(f"/v1/models/{model['id']}", headers=auth).status_code == 204
    assert not [o for o in store.list("models") if f"/{model['id']}/" in o.key]


def test_an_attempt_deletes_the_checkpoints_earlier_attempts_stored_and_never_recorded(deployment, auth):
    """An attempt killed between its commit and its row leaves an object no row names: the next
    attempt deletes it from the bucket as it starts, and keeps the recorded ones."""
    client, settings = deployment.client, deployment.settings
    store = store_from(settings)
    job_id = client.post("/v1/jobs", json=tiny_spec(), headers=auth).json()["id"]
    with transaction(settings) as session:
        first = lifecycle.claim(session, NoBus(), job_id, "test", timedelta(minutes=1)).attempt
    put_object(store, checkpoint_key(job_id, 10, first), b"recorded")
    put_object(store, checkpoint_key(job_id, 20, first), b"never recorded")
    with transaction(settings) as session:
        staged = Staged("x", 8, hashlib.sha256(b"recorded").hexdigest())
        record_checkpoint(session, NoBus(), job_id, first, 10, staged, checkpoint_key(job_id, 10, first), {}, 10)
        session.get(Job, job_id).attempt += 1  # the attempt that holds the job now
    sink = JobSink(settings, job_id, first + 1, 10, {})
    try:
        sink.adopt_checkpoints()
    finally:
        sink.close()
    assert [o.key for o in store.list(f"jobs/{job_id}")] == [checkpoint_key(job_id, 10, first)]
    client.post(f"/v1/jobs/{job_id}/cancel", headers=auth)


def put_object(store: Any, key: str, data: bytes) -> None:
    with store.writer() as w:
        w.write(data)
    store.commit(w.staged.key, key)
