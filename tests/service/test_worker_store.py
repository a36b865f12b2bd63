"""A worker reads a job's dataset from an S3 bucket through its own cache, with no shared file.

The bucket is moto's server on 127.0.0.1 (or MUONFORGE_TEST_S3_URL's); the worker process is
started with MUONFORGE_ARTIFACT_URL and a cache directory of its own. The datasets' bytes go into
the bucket through the store and their rows into the database, so the API's artifact directory
never holds them.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from app.db.base import new_id
from app.db.models import Dataset
from app.db.session import is_transient, transaction
from app.repositories.tenants import DatasetRepository, TenantRepository
from app.services.leases import DatasetObject
from app.settings import Settings
from app.storage import ArtifactCache, ArtifactStore, StoreUnavailable, store_from
from app.storage.s3 import S3Store
from contract.spec import JobSpec
from tests.support.api import bearer, job, new_key
from tests.support.net import wait_for
from tests.support.s3 import S3Server, s3_server  # noqa: F401
from tests.support.services import launch, service_env, stop, wait_worker
from tests.support.specs import tiny_spec
from worker.artifacts import DATASET_CHANGED, DATASET_MISSING, dataset_file, read_as_stored, token_entries

pytestmark = pytest.mark.system
CORPUS = b"the quick brown fox jumps over the lazy dog. " * 60


@dataclass
class StoreWorker:
    """The worker process of this module: its bucket's store and its cache directory."""

    store: ArtifactStore
    cache_dir: Path


@pytest.fixture(scope="module")
def store_worker(settings, s3_server, tmp_path_factory) -> Iterator[StoreWorker]:  # noqa: F811
    """A worker that reads datasets from a bucket of its own, through its own cache directory."""
    url = s3_server.scoped("worker-store")
    cache_dir = tmp_path_factory.mktemp("worker-cache")
    log_path = tmp_path_factory.mktemp("store-worker") / "worker.log"
    env = {
        **service_env(settings),
        **s3_server.env,
        "MUONFORGE_ARTIFACT_URL": url,
        "MUONFORGE_CACHE_DIR": str(cache_dir),
    }
    proc = launch(["worker", "--queues", "default,cpu"], env, log_path)
    try:
        wait_worker(proc, log_path)
        yield StoreWorker(S3Store.from_url(url, env=s3_server.env), cache_dir)
    finally:
        stop(proc)


@pytest.fixture
def tenant(settings) -> tuple[str, dict[str, str]]:
    """A fresh tenant: its id and the headers of its API key."""
    name = f"tenant-{secrets.token_hex(4)}"
    key = new_key(settings, name)
    with transaction(settings) as session:
        return TenantRepository(session).get_or_create(name).id, bearer(key)


def put(store: ArtifactStore, key: str, data: bytes) -> None:
    """``data`` at ``key``, through a staged write and its commit."""
    with store.writer() as w:
        w.write(data)
    assert w.staged is not None
    store.commit(w.staged.key, key)


def add_dataset(settings: Settings, tenant_id: str, data: bytes, suffix: str = ".txt") -> Dataset:
    """A dataset row of ``data`` (its size and sha256), keyed as the API keys an upload's file."""
    dataset_id = new_id("ds")
    row = Dataset(
        id=dataset_id,
        tenant_id=tenant_id,
        name="corpus",
        bytes=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
        char_vocab=len(set(data.decode())),
        path=f"datasets/{tenant_id}/{dataset_id}{suffix}",
    )
    with transaction(settings) as session:
        DatasetRepository(session).add(row)
    return row


def run_on(client: Any, auth: dict[str, str], dataset_id: str, status: str) -> dict:
    """Submit a small job on the dataset and wait until it ends with ``status``."""
    spec = tiny_spec(steps=20) | {"data": {"dataset_id": dataset_id}}
    r = client.post("/v1/jobs", json=spec, headers=auth)
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    finished = ("succeeded", "failed", "cancelled")
    wait_for(lambda: job(client, auth, job_id)["status"] in finished, timeout=60)
    done = job(client, auth, job_id)
    assert done["status"] == status, done
    return done


def test_a_job_trains_on_a_dataset_read_from_the_bucket_into_the_workers_cache(client, settings, tenant, store_worker):
    tenant_id, auth = tenant
    dataset = add_dataset(settings, tenant_id, CORPUS)
    put(store_worker.store, dataset.path, CORPUS)
    done = run_on(client, auth, dataset.id, "succeeded")
    assert done["progress"]["step"] == 20 and done["error"] is None
    entry = store_worker.cache_dir / "objects" / dataset.sha256
    assert entry.read_bytes() == CORPUS
    assert not (settings.artifact_dir / dataset.path).exists()  # the bucket was the only copy
    (tokens,) = (store_worker.cache_dir / "derived").iterdir()  # its token array: in the same cache
    assert tokens.name.startswith(dataset.sha256[:16]) and (tokens / "meta.json").is_file()
    assert (tokens / "tokens.bin").stat().st_size > 0


def test_a_dataset_missing_from_the_bucket_fails_the_job_with_dataset_missing(client, settings, tenant, store_worker):
    tenant_id, auth = tenant
    dataset = add_dataset(settings, tenant_id, CORPUS + b"gone")
    done = run_on(client, auth, dataset.id, "failed")
    assert done["error"] == {"code": "dataset_missing", "message": DATASET_MISSING.format(dataset_id=dataset.id)}
    assert done["attempt"] == 1


def test_a_dataset_changed_in_the_bucket_fails_the_job_naming_it(client, settings, tenant, store_worker):
    tenant_id, auth = tenant
    dataset = add_dataset(settings, tenant_id, CORPUS + b"one")
    put(store_worker.store, dataset.path, CORPUS + b"two")  # the same key and size, other bytes
    done = run_on(client, auth, dataset.id, "failed")
    assert done["error"] == {"code": "dataset_changed", "message": DATASET_CHANGED.format(dataset_id=dataset.id)}
    assert dataset.id in done["error"]["message"]
    assert not (store_worker.cache_dir / "objects" / dataset.sha256).exists()  # nothing unverified cached


def s3_settings(settings: Settings, server: S3Server, tmp_path: Path, monkeypatch, **more: Any) -> Settings:
    """This process's settings with a bucket of its own and a cache under ``tmp_path``."""
    for name, value in server.env.items():
        monkeypatch.setenv(name, value)
    update = {"artifact_url": server.scoped("attempt"), "cache_dir": tmp_path / "cache", **more}
    return settings.model_copy(update=update)


def test_a_cached_corpus_is_read_in_its_keys_format_and_its_entry_is_held_while_open(
    settings,
    s3_server,  # noqa: F811
    tmp_path,
    monkeypatch,
):
    local = s3_settings(settings, s3_server, tmp_path, monkeypatch, cache_bytes=0)
    store = S3Store.from_url(local.artifact_url or "", env=s3_server.env)
    data = b'{"text": "one document"}\n'
    put(store, "datasets/t/ds_1.jsonl", data)
    dataset = DatasetObject("ds_1", "datasets/t/ds_1.jsonl", len(data), hashlib.sha256(data).hexdigest())
    entry = local.cache_dir / "objects" / dataset.sha256
    with dataset_file(local, dataset) as corpus:
        assert corpus == entry and corpus.read_bytes() == data
        assert ArtifactCache(local.cache_dir, 0, store).trim() == []  # in use: never evicted
    assert not entry.exists()  # released, it goes (a budget of 0)
    spec = JobSpec.model_validate(tiny_spec() | {"data": {"dataset_id": "ds_1"}})
    assert read_as_stored(spec, dataset).data.format == "jsonl"  # the entry's name has no suffix: the key's
    given = spec.model_copy(update={"data": spec.data.model_copy(update={"format": "text"})})
    assert read_as_stored(given, dataset).data.format == "text" and read_as_stored(spec, None) is spec


def test_a_runs_token_entries_are_held_until_it_ends(settings, tmp_path):
    local = settings.model_copy(update={"cache_dir": tmp_path / "cache", "cache_bytes": 0})
    cache = ArtifactCache(local.cache_dir, 0, store_from(local))
    with token_entries(local) as tokens:
        entry = tokens("0123456789abcdef-01234567-char")
        (entry / "tokens.bin").write_bytes(b"tokens")
        assert tokens("0123456789abcdef-01234567-char") == entry  # a second use of the same entry
        assert cache.trim() == [] and entry.is_dir()  # in use: never evicted
    assert not entry.exists()  # released, it goes (a budget of 0)


def test_a_store_out_of_reach_past_the_patience_is_an_outage_the_attempt_hands_back(
    settings,
    s3_server,  # noqa: F811
    tmp_path,
    monkeypatch,
):
    local = s3_settings(settings, s3_server, tmp_path, monkeypatch, outage_patience_seconds=0.5)

    def unavailable(*args: Any, **kwargs: Any) -> Any:
        raise StoreUnavailable("connection refused")

    monkeypatch.setattr(ArtifactCache, "open", unavailable)
    dataset = DatasetObject("ds_2", "datasets/t/ds_2.txt", 3, "0" * 64)
    with pytest.raises(StoreUnavailable) as raised, dataset_file(local, dataset):
        pass
    assert is_transient(raised.value)  # run_attempt's "handed_back": the lease lapses, the job is queued again
