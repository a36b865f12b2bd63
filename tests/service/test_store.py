"""The artifact store's contract, the same tests on the local directory and on S3 (moto's server on
127.0.0.1, or MUONFORGE_TEST_S3_URL's): staged writes committed, verified fetches, ranges, listing
and sweeps, deletes, and the S3 server down and back."""

from __future__ import annotations

import hashlib
import os
import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import obstore
import pytest

from app.settings import Settings
from app.storage import (
    STAGING,
    ArtifactStore,
    IntegrityError,
    LocalStore,
    ObjectNotFound,
    Staged,
    StoreUnavailable,
    s3,
    store_from,
    sweep_staging,
)
from app.storage.base import CHUNK_BYTES, check_key, check_range, chunk_bounds
from app.storage.s3 import S3Store, allow_http, parse_s3_url, retry_config, s3_config
from tests.support.s3 import EXTERNAL, S3Server, s3_server  # noqa: F401

MiB = 2**20
PART = 5 * MiB  # S3's smallest part: a 20 MiB object takes four
DOWN_WITHIN_S = 10.0


@dataclass
class Case:
    """A store under test and a way to change its objects behind its back."""

    store: ArtifactStore
    tamper: Callable[[str, bytes], None]


def local_case(root: Path) -> Case:
    """A LocalStore; tampering rewrites the file in place."""
    return Case(LocalStore(root), lambda key, data: (root / key).write_bytes(data))


def s3_store(server: S3Server, **kwargs) -> S3Store:
    """An S3Store under a prefix of its own, with short timeouts and few retries."""
    return S3Store.from_url(
        server.scoped("store"),
        env=server.env,
        part_size=PART,
        client_options={"connect_timeout": "1s", "timeout": "10s"},
        retry=retry_config(1, timedelta(seconds=2)),
        **kwargs,
    )


def s3_case(server: S3Server) -> Case:
    """An S3Store; tampering PUTs other bytes at the key with the raw client."""
    store = s3_store(server)
    return Case(store, lambda key, data: obstore.put(store.store, key, data))


@pytest.fixture(params=["local", "s3"])
def case(request, tmp_path) -> Case:
    if request.param == "local":
        return local_case(tmp_path / "artifacts")
    return s3_case(request.getfixturevalue("s3_server"))


def payload(size: int, seed: int = 0) -> bytes:
    """``size`` pseudo-random bytes, the same for the same seed."""
    return random.Random(seed).randbytes(size)


def chunks(data: bytes, size: int) -> Iterator[bytes]:
    """``data`` in pieces of ``size`` bytes."""
    for i in range(0, len(data), size):
        yield data[i : i + size]


def write(store: ArtifactStore, data: bytes, piece: int = 3 * MiB + 17) -> Staged:
    """``data`` written through a staging writer in odd-sized pieces."""
    with store.writer() as out:
        for block in chunks(data, piece):
            out.write(block)
    assert out.staged is not None
    return out.staged


def put(store: ArtifactStore, key: str, data: bytes) -> Staged:
    """``data`` staged and committed at ``key``."""
    staged = write(store, data)
    store.commit(staged.key, key)
    return staged


def read(store: ArtifactStore, key: str, start: int = 0, end: int | None = None) -> bytes:
    return b"".join(store.open_range(key, start, end))


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".part"))


def test_round_trip_of_a_multipart_object(case, tmp_path):
    """20 MiB in four parts: the writer's size and sha256 are the bytes', and a fetch gives them back."""
    data = payload(20 * MiB)
    staged = write(case.store, data)
    assert staged.key.startswith(f"{STAGING}/")
    assert (staged.size, staged.sha256) == (len(data), hashlib.sha256(data).hexdigest())
    if isinstance(case.store, S3Store):
        assert case.store.head(staged.key)["e_tag"].strip('"').endswith("-4")  # a multipart upload of four parts
    case.store.commit(staged.key, "datasets/t1/corpus.txt")
    dest = tmp_path / "cache" / "corpus.txt"
    assert case.store.fetch("datasets/t1/corpus.txt", dest, staged.size, staged.sha256) == dest
    assert dest.read_bytes() == data
    assert leftovers(dest.parent) == []


def test_a_reused_buffer_is_stored_as_it_was_at_each_write(case):
    """A caller that reads into one buffer and writes it again and again (readinto) gets each
    write's bytes stored, not the buffer's last contents."""
    buffer, written = bytearray(MiB), bytearray()
    with case.store.writer() as out:
        for i in range(12):  # past two parts
            buffer[:] = bytes([i]) * MiB
            out.write(buffer if i % 2 else memoryview(buffer))
            written += buffer
    assert out.staged is not None and out.staged.sha256 == hashlib.sha256(written).hexdigest()
    case.store.commit(out.staged.key, "k")
    assert read(case.store, "k") == written


def test_an_empty_object(case, tmp_path):
    staged = put(case.store, "empty", b"")
    assert (staged.size, staged.sha256) == (0, hashlib.sha256(b"").hexdigest())
    assert case.store.fetch("empty", tmp_path / "e", 0, staged.sha256).read_bytes() == b""
    assert read(case.store, "empty") == b""


def test_a_staged_object_is_invisible_at_its_final_key_until_commit(case):
    staged = write(case.store, b"weights")
    assert case.store.stat("checkpoints/j1/step-10.pt") is None
    assert list(case.store.list("checkpoints")) == []
    case.store.commit(staged.key, "checkpoints/j1/step-10.pt")
    found = case.store.stat("checkpoints/j1/step-10.pt")
    assert found is not None and found.size == len(b"weights")
    assert case.store.stat(staged.key) is None
    case.store.commit(staged.key, "checkpoints/j1/step-10.pt")  # a repeated commit succeeds
    with pytest.raises(ObjectNotFound):
        case.store.commit(f"{STAGING}/never-written", "checkpoints/j1/step-20.pt")


def test_an_object_over_the_servers_copy_limit_is_committed_through_the_client(s3_server):  # noqa: F811
    store = s3_store(s3_server, copy_limit=6 * MiB)  # S3's CopyObject stops at 5 GiB
    data = payload(12 * MiB + 3)
    staged = write(store, data)
    store.commit(staged.key, "datasets/t1/big.txt")
    assert read(store, "datasets/t1/big.txt") == data
    assert store.head("datasets/t1/big.txt")["e_tag"].strip('"').endswith("-3")  # uploaded again, in parts
    assert store.stat(staged.key) is None
    store.commit(staged.key, "datasets/t1/big.txt")  # a repeated commit succeeds
    small = write(store, b"small")
    store.commit(small.key, "datasets/t1/small.txt")  # under the limit: the server copies it
    assert read(store, "datasets/t1/small.txt") == b"small"


def test_a_commit_replaces_the_object_at_its_final_key(case):
    put(case.store, "k", b"old")
    put(case.store, "k", b"new bytes")
    assert read(case.store, "k") == b"new bytes"


def test_put_file_stores_a_file_at_its_key_with_no_staging_copy(case, tmp_path):
    data = payload(12 * MiB + 5)  # past one part
    outside = tmp_path / "step.pt"
    outside.write_bytes(data)
    staged = case.store.put_file(outside, "checkpoints/j1/step_00000010.2.pt")
    assert staged == Staged("checkpoints/j1/step_00000010.2.pt", len(data), hashlib.sha256(data).hexdigest())
    assert read(case.store, staged.key) == data
    assert [o.key for o in case.store.list("")] == [staged.key]  # nothing left under a staging key
    if isinstance(case.store, S3Store):
        assert case.store.head(staged.key)["e_tag"].strip('"').endswith("-3")  # uploaded in parts
    else:  # a file under the root is stored where it is
        inside = case.store.path("checkpoints/j1/step_00000020.pt")
        inside.write_bytes(b"in place")
        assert case.store.put_file(inside, "checkpoints/j1/step_00000020.pt").size == 8 and inside.is_file()


def test_a_write_that_fails_leaves_nothing(case):
    with pytest.raises(RuntimeError), case.store.writer() as out:
        out.write(payload(12 * MiB))  # past two parts: a multipart upload is under way
        raise RuntimeError("the client went away")
    assert out.staged is None
    assert case.store.stat(out.key) is None
    assert list(case.store.list(STAGING)) == []


def test_fetch_refuses_an_object_changed_behind_the_stores_back(case, tmp_path):
    data = payload(MiB + 5)
    staged = put(case.store, "datasets/t1/d.txt", data)
    dest = tmp_path / "d.txt"
    dest.write_bytes(b"what was cached")
    case.tamper("datasets/t1/d.txt", bytes([data[0] ^ 1]) + data[1:])  # same size, other bytes
    with pytest.raises(IntegrityError, match="sha256"):
        case.store.fetch("datasets/t1/d.txt", dest, staged.size, staged.sha256)
    case.tamper("datasets/t1/d.txt", data + b"!")
    with pytest.raises(IntegrityError, match="bytes"):
        case.store.fetch("datasets/t1/d.txt", dest, staged.size, staged.sha256)
    case.tamper("datasets/t1/d.txt", data[:-1])
    with pytest.raises(IntegrityError, match="bytes"):
        case.store.fetch("datasets/t1/d.txt", dest, staged.size, staged.sha256)
    assert dest.read_bytes() == b"what was cached"
    assert leftovers(tmp_path) == []


def test_fetch_of_a_missing_object(case, tmp_path):
    with pytest.raises(ObjectNotFound):
        case.store.fetch("nothing/here", tmp_path / "x", 1, "0" * 64)
    assert not (tmp_path / "x").exists()


def test_range_reads(case, monkeypatch):
    monkeypatch.setattr(s3, "SPAN_BYTES", 5 * MiB)  # S3: several GETs, their spans across the chunks
    data = payload(CHUNK_BYTES + 4 * MiB)
    put(case.store, "jobs/j1/model.safetensors", data)
    size = len(data)
    spans = [
        (0, None),
        (5, 10),
        (CHUNK_BYTES - 3, CHUNK_BYTES + 3),
        (5 * MiB - 3, 10 * MiB + 3),
        (size - 4, size + 100),
        (size, None),
        (7, 7),
    ]
    for start, end in spans:
        assert read(case.store, "jobs/j1/model.safetensors", start, end) == data[start:end], (start, end)
    with pytest.raises(ValueError):
        case.store.open_range("jobs/j1/model.safetensors", 10, 5)
    with pytest.raises(ObjectNotFound):
        case.store.open_range("jobs/j1/missing", 0, 10)  # at once, before any byte is read


def test_a_range_read_never_mixes_two_objects(s3_server, monkeypatch):  # noqa: F811
    """An object replaced between two requests of a read: IntegrityError, not the new bytes after the old."""
    monkeypatch.setattr(s3, "SPAN_BYTES", CHUNK_BYTES)  # one GET per chunk
    case = s3_case(s3_server)
    data = payload(CHUNK_BYTES + MiB)
    put(case.store, "big", data)
    stream = case.store.open_range("big")
    assert next(stream) == data[:CHUNK_BYTES]
    case.tamper("big", payload(len(data), seed=1))
    with pytest.raises(IntegrityError, match="changed"):
        next(stream)


def test_delete_is_idempotent(case):
    put(case.store, "models/t1/m/config.json", b"{}")
    case.store.delete("models/t1/m/config.json")
    case.store.delete("models/t1/m/config.json")
    case.store.delete("never/was")
    assert case.store.stat("models/t1/m/config.json") is None


def test_list_gives_sizes_and_times_by_folder(case):
    before = datetime.now(UTC) - timedelta(seconds=5)
    put(case.store, "datasets/a/one", b"1")
    put(case.store, "datasets/a/two", b"22")
    put(case.store, "datasets/ab/three", b"333")
    listed = {o.key: o for o in case.store.list("datasets/a")}
    assert {k: o.size for k, o in listed.items()} == {"datasets/a/one": 1, "datasets/a/two": 2}
    assert all(before <= o.modified <= datetime.now(UTC) + timedelta(seconds=5) for o in listed.values())
    assert {o.key for o in case.store.list("datasets/")} == {"datasets/a/one", "datasets/a/two", "datasets/ab/three"}
    assert list(case.store.list("nothing")) == []


def test_sweep_deletes_only_staging_objects_older_than_the_age(case):
    put(case.store, "datasets/kept", b"committed")
    orphans = [write(case.store, b"orphan %d" % i).key for i in range(3)]
    assert sweep_staging(case.store, timedelta(hours=1)) == []
    later = datetime.now(UTC) + timedelta(hours=2)
    assert sorted(sweep_staging(case.store, timedelta(hours=1), now=later)) == sorted(orphans)
    assert list(case.store.list(STAGING)) == []
    assert case.store.stat("datasets/kept") is not None


def test_keys_are_checked(case):
    for key in ["", "/abs", "a//b", "a/../b", "..", "./a", "a/", "a\\b"]:
        with pytest.raises(ValueError):
            case.store.stat(key)
        with pytest.raises(ValueError):
            case.store.delete(key)


@contextmanager
def stopped(server: S3Server) -> Iterator[None]:
    """The moto server stopped for the duration, started again after."""
    server.stop()
    try:
        yield
    finally:
        server.start()


def timed(call: Callable[[], object]) -> float:
    """Seconds ``call`` took to raise StoreUnavailable."""
    started = time.monotonic()
    with pytest.raises(StoreUnavailable):
        call()
    return time.monotonic() - started


@pytest.mark.skipif(bool(EXTERNAL), reason="stops the server: moto's on loopback only")
def test_the_s3_server_down_is_store_unavailable_and_back_it_works(s3_server, tmp_path):  # noqa: F811
    store = s3_store(s3_server)
    staged = put(store, "datasets/d", b"before the outage")

    def big_write():
        with store.writer() as out:
            out.write(payload(11 * MiB))

    with stopped(s3_server):
        waits = [
            timed(lambda: store.stat("datasets/d")),
            timed(lambda: store.fetch("datasets/d", tmp_path / "d", staged.size, staged.sha256)),
            timed(lambda: list(store.open_range("datasets/d"))),
            timed(lambda: put(store, "datasets/e", b"during")),
            timed(big_write),
            timed(lambda: store.commit(staged.key, "datasets/f")),
            timed(lambda: store.delete("datasets/d")),
            timed(lambda: list(store.list("datasets"))),
        ]
    assert max(waits) < DOWN_WITHIN_S, waits
    assert not (tmp_path / "d").exists()
    assert store.fetch("datasets/d", tmp_path / "d", staged.size, staged.sha256).read_bytes() == b"before the outage"
    put(store, "datasets/g", b"after")
    assert read(store, "datasets/g") == b"after"


def test_store_from_settings(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    local = store_from(Settings(artifact_dir=tmp_path))
    assert isinstance(local, LocalStore) and local.root == tmp_path
    assert isinstance(store_from(Settings(artifact_dir=tmp_path, artifact_url="")), LocalStore)
    s3 = store_from(Settings(artifact_url="s3://bucket/some/prefix"))
    assert isinstance(s3, S3Store) and (s3.bucket, s3.prefix) == ("bucket", "some/prefix")


def test_s3_urls_and_environment():
    assert parse_s3_url("s3://b") == ("b", "")
    assert parse_s3_url("s3://b/p/q/") == ("b", "p/q")
    for bad in ["http://b/p", "s3:///p", "s3://b/p?x=1", "s3://b/../p"]:
        with pytest.raises(ValueError):
            parse_s3_url(bad)
    env = {"AWS_ENDPOINT_URL": "http://minio:9000", "AWS_DEFAULT_REGION": "eu-west-1", "AWS_ACCESS_KEY_ID": "k"}
    assert s3_config(env) == {"endpoint": "http://minio:9000", "region": "eu-west-1", "access_key_id": "k"}
    assert s3_config({**env, "AWS_ENDPOINT_URL_S3": "https://s3.example", "AWS_REGION": "us-east-2"})["endpoint"] == (
        "https://s3.example"
    )
    assert allow_http({}, "http://minio:9000") and not allow_http({}, "https://s3.example")
    assert allow_http({"AWS_ALLOW_HTTP": "true"}, None) and not allow_http({}, None)
    with pytest.raises(ValueError, match="part_size"):
        S3Store("b", part_size=MiB)


def test_key_and_range_helpers():
    assert check_key("a/b.c") == "a/b.c"
    assert check_range(0, None, 10) == (0, 10)
    assert check_range(12, 20, 10) == (10, 10)
    assert list(chunk_bounds(0, 10, 4)) == [(0, 4), (4, 8), (8, 10)]
    assert list(chunk_bounds(3, 3, 4)) == []


def test_local_store_keeps_files_under_its_root(tmp_path):
    store = LocalStore(tmp_path / "root")
    put(store, "datasets/t1/x.txt", b"x")
    assert (tmp_path / "root" / "datasets" / "t1" / "x.txt").read_bytes() == b"x"
    assert not any((tmp_path / "root" / STAGING).iterdir())
    assert os.listdir(tmp_path) == ["root"]
