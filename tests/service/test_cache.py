"""The worker cache over a LocalStore (copying) and over S3 (moto's server on 127.0.0.1, or
MUONFORGE_TEST_S3_URL's): hits and misses, least-recently-used eviction within the budget, entries
in use kept (held by another process), concurrent misses in two processes, objects changed in the
store, corrupted entries, an object larger than the budget, the local store's files handed out, and
derived entries (token arrays) in the same budget."""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from app.settings import Settings
from app.storage import (
    ArtifactCache,
    ArtifactStore,
    IntegrityError,
    LocalStore,
    ObjectNotFound,
    Staged,
    cache_from,
)
from app.storage.s3 import S3Store
from tests.support.s3 import S3Server, s3_server  # noqa: F401

KiB = 2**10
SIZE = 256 * KiB
ROOT = Path(__file__).resolve().parents[2]


class Counting:
    """A store that counts its fetches (and may wait before each); everything else passes through."""

    def __init__(self, store: ArtifactStore, delay: float = 0.0) -> None:
        self.store = store
        self.delay = delay
        self.fetches: list[str] = []

    def fetch(self, key: str, dest: Path, size: int, sha256: str) -> Path:
        self.fetches.append(key)
        time.sleep(self.delay)
        return self.store.fetch(key, dest, size, sha256)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


@dataclass
class Case:
    """A store under test, and how a process of its own reaches it (``spec``)."""

    store: ArtifactStore
    spec: dict[str, Any]

    def put(self, key: str, data: bytes) -> Staged:
        """``data`` written and committed at ``key``."""
        with self.store.writer() as out:
            out.write(data)
        assert out.staged is not None
        self.store.commit(out.staged.key, key)
        return out.staged


@pytest.fixture(params=["local", "s3"])
def case(request, tmp_path) -> Case:
    if request.param == "local":
        root = tmp_path / "artifacts"
        return Case(LocalStore(root), {"local": str(root)})
    server: S3Server = request.getfixturevalue("s3_server")
    store = S3Store.from_url(server.scoped("cache"), env=server.env)
    return Case(store, {"s3": f"s3://{store.bucket}/{store.prefix}", "env": server.env})


def store_of(spec: dict[str, Any]) -> ArtifactStore:
    """The store a case's ``spec`` names."""
    if "local" in spec:
        return LocalStore(Path(spec["local"]))
    return S3Store.from_url(spec["s3"], env=spec["env"])


def payload(size: int = SIZE, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(size)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def cached(cache: ArtifactCache) -> list[str]:
    """The cached entries' names (an object's sha256), least recently used first."""
    return [e.name for e in cache.entries()]


def use(cache: ArtifactCache, key: str, staged: Staged) -> bytes:
    """The bytes ``cache.open`` gives for ``key``."""
    with cache.open(key, staged.size, staged.sha256) as path:
        return path.read_bytes()


def hold(argv: list[str]) -> None:
    """A process of its own: open one object through a cache, print what it read and how many
    fetches it made, and keep the object open until a line arrives on stdin.

    ``argv``: a JSON object with the store's spec, the cache directory, its budget, the key, size
    and sha256, and the delay before each fetch. It says when it is ready, then starts on the
    first line of stdin.
    """
    job = json.loads(argv[0])
    store = Counting(store_of(job["store"]), job["delay"])
    cache = ArtifactCache(Path(job["directory"]), job["max_bytes"], store)
    print(json.dumps({"ready": True}), flush=True)
    sys.stdin.readline()
    with cache.open(job["key"], job["size"], job["sha256"]) as path:
        print(json.dumps({"sha256": sha(path.read_bytes()), "fetches": len(store.fetches)}), flush=True)
        sys.stdin.readline()
    print(json.dumps({"released": True}), flush=True)


class Holder:
    """:func:`hold` in a child process."""

    def __init__(self, case: Case, directory: Path, max_bytes: int, key: str, staged: Staged, delay: float = 0.0):
        job = {"store": case.spec, "directory": str(directory), "max_bytes": max_bytes, "key": key}
        job |= {"size": staged.size, "sha256": staged.sha256, "delay": delay}
        code = "import sys; from tests.service.test_cache import hold; hold(sys.argv[1:])"
        self.process = subprocess.Popen(
            [sys.executable, "-c", code, json.dumps(job)],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.answer() == {"ready": True}

    def send(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write("\n")
        self.process.stdin.flush()

    def answer(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        assert line, f"the child exited with {self.process.wait()}"
        return json.loads(line)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)


def test_a_hit_does_not_call_the_store(case, tmp_path):
    data = payload()
    staged = case.put("datasets/t1/a.txt", data)
    store = Counting(case.store)
    cache = ArtifactCache(tmp_path / "cache", 10 * SIZE, store)
    assert use(cache, "datasets/t1/a.txt", staged) == data
    assert use(cache, "datasets/t1/a.txt", staged) == data
    assert store.fetches == ["datasets/t1/a.txt"]
    with cache.open("datasets/t1/a.txt", staged.size, staged.sha256) as path:
        assert path == tmp_path / "cache" / "objects" / staged.sha256
    assert cache.usage() == SIZE
    assert sorted(p.name for p in (tmp_path / "cache" / "objects").iterdir()) == [staged.sha256]


def test_least_recently_used_entries_are_evicted_within_the_budget(case, tmp_path):
    """a, b, c fill the budget; a used again; d evicts b, the least recently used. The order is
    the files' own, so a new cache on the same directory (a restart) keeps it."""
    objects = {name: case.put(name, payload(seed=i)) for i, name in enumerate("abcde")}
    store = Counting(case.store)
    cache = ArtifactCache(tmp_path / "cache", 3 * SIZE, store)
    for name in "abca":
        use(cache, name, objects[name])
    assert store.fetches == ["a", "b", "c"]
    use(cache, "d", objects["d"])
    assert cached(cache) == [objects[n].sha256 for n in "cad"]
    restarted = ArtifactCache(tmp_path / "cache", 3 * SIZE, store)
    use(restarted, "c", objects["c"])
    use(restarted, "e", objects["e"])
    assert cached(restarted) == [objects[n].sha256 for n in "dce"]
    assert restarted.usage() == 3 * SIZE
    assert store.fetches == ["a", "b", "c", "d", "e"]


def test_an_entry_in_use_in_another_process_is_never_evicted(case, tmp_path):
    objects = {name: case.put(name, payload(seed=i)) for i, name in enumerate("abcd")}
    directory = tmp_path / "cache"
    holder = Holder(case, directory, 2 * SIZE, "a", objects["a"])
    try:
        holder.send()
        assert holder.answer() == {"sha256": objects["a"].sha256, "fetches": 1}
        cache = ArtifactCache(directory, 2 * SIZE, Counting(case.store))
        use(cache, "b", objects["b"])
        use(cache, "c", objects["c"])  # a is the least recently used, but in use: b goes
        assert cached(cache) == [objects[n].sha256 for n in "ac"]
        assert sha((directory / "objects" / objects["a"].sha256).read_bytes()) == objects["a"].sha256
        with cache.open("c", SIZE, objects["c"].sha256), cache.open("d", SIZE, objects["d"].sha256):
            assert cached(cache) == [objects[n].sha256 for n in "acd"]  # all in use: over the budget
            holder.send()
            assert holder.answer() == {"released": True}
            assert holder.process.wait(10) == 0
            assert cached(cache) == [objects[n].sha256 for n in "cd"]  # the holder evicted a on release
        assert cached(cache) == [objects[n].sha256 for n in "cd"]
    finally:
        holder.close()


def test_two_processes_missing_the_same_key_download_it_once(case, tmp_path):
    data = payload(4 * SIZE)
    staged = case.put("datasets/t1/big.txt", data)
    holders = [Holder(case, tmp_path / "cache", 10 * SIZE, "datasets/t1/big.txt", staged, 0.5) for _ in range(2)]
    try:
        for holder in holders:
            holder.send()
        answers = [holder.answer() for holder in holders]
        assert [a["sha256"] for a in answers] == [staged.sha256] * 2
        assert sum(a["fetches"] for a in answers) == 1
        for holder in holders:
            holder.send()
            assert holder.answer() == {"released": True}
    finally:
        for holder in holders:
            holder.close()
    assert sorted(p.name for p in (tmp_path / "cache" / "objects").iterdir()) == [staged.sha256]
    assert list((tmp_path / "cache" / "locks").glob("*.fetch")) == []


def test_an_object_changed_in_the_store_is_fetched_anew(case, tmp_path):
    old, new = payload(seed=1), payload(seed=2)
    first = case.put("k", old)
    store = Counting(case.store)
    cache = ArtifactCache(tmp_path / "cache", 10 * SIZE, store)
    assert use(cache, "k", first) == old
    second = case.put("k", new)
    assert use(cache, "k", second) == new
    assert store.fetches == ["k", "k"]
    case.put("k", old)
    with pytest.raises(IntegrityError):  # the store holds other bytes than the row records
        use(cache, "k", Staged("k", len(new) + 1, sha(new + b"!")))
    assert sorted(cached(cache)) == sorted([first.sha256, second.sha256])


def test_a_corrupted_entry_is_fetched_again(case, tmp_path):
    data = payload()
    staged = case.put("k", data)
    store = Counting(case.store)
    cache = ArtifactCache(tmp_path / "cache", 10 * SIZE, store)
    with cache.open("k", staged.size, staged.sha256) as path:
        pass
    with path.open("ab") as file:
        file.write(b"appended")
    assert use(cache, "k", staged) == data
    path.write_bytes(data[:100])
    assert use(cache, "k", staged) == data
    assert store.fetches == ["k", "k", "k"]


def test_an_object_larger_than_the_budget_is_used_then_evicted(case, tmp_path):
    data = payload(3 * SIZE)
    staged = case.put("big", data)
    small = case.put("small", payload(seed=5))
    cache = ArtifactCache(tmp_path / "cache", SIZE, Counting(case.store))
    use(cache, "small", small)
    with cache.open("big", staged.size, staged.sha256) as path:
        assert cached(cache) == [staged.sha256]  # room made before the download
        assert path.read_bytes() == data
    assert not path.exists()
    assert cache.usage() == 0


def test_a_failed_fetch_leaves_nothing(case, tmp_path):
    cache = ArtifactCache(tmp_path / "cache", 10 * SIZE, Counting(case.store))
    with pytest.raises(ObjectNotFound), cache.open("missing", 3, sha(b"abc")):
        pass
    staged = case.put("k", b"abc")
    with pytest.raises(IntegrityError), cache.open("k", staged.size, sha(b"abd")):
        pass
    assert list((tmp_path / "cache" / "objects").iterdir()) == []
    assert list((tmp_path / "cache" / "locks").iterdir()) == []


def test_leftovers_of_a_dead_download_are_swept(tmp_path):
    cache = ArtifactCache(tmp_path / "cache", SIZE, LocalStore(tmp_path / "artifacts"), direct=False)
    cache.objects.mkdir(parents=True)
    cache.locks.mkdir()
    part = cache.objects / f".{'a' * 64}.0123456789ab.part"
    part.write_bytes(b"half")
    (cache.locks / f"{'a' * 64}.fetch").touch()
    (cache.locks / f"{'b' * 64}.use").touch()
    cache.trim()
    assert list(cache.objects.iterdir()) == []
    assert list(cache.locks.iterdir()) == []


def make(cache: ArtifactCache, name: str, size: int) -> Path:
    """The derived entry ``name`` with one file of ``size`` bytes, made and let go."""
    with cache.derived(name) as entry:
        (entry / "tokens.bin").write_bytes(payload(size))
    return entry


def test_derived_entries_share_the_budget_and_are_kept_while_held(tmp_path):
    """An object and derived directories are evicted least recently used first by one budget; a
    held directory is never evicted, a released one is, and one opened again is whole."""
    store = LocalStore(tmp_path / "artifacts")
    cache = ArtifactCache(tmp_path / "cache", 3 * SIZE, store, direct=False)
    a = Case(store, {}).put("a", payload(seed=1))
    use(cache, "a", a)
    with cache.derived("0123-bpe512") as held:
        (held / "tokens.bin").write_bytes(payload(2 * SIZE))
        make(cache, "4567-char", SIZE)
        assert cached(cache) == ["0123-bpe512", "4567-char"]  # the object went: least recently used
        make(cache, "89ab-byte", SIZE)
        assert cached(cache) == ["0123-bpe512", "89ab-byte"]  # held: over the budget, not evicted
        assert (held / "tokens.bin").stat().st_size == 2 * SIZE
    assert cache.usage() == 3 * SIZE
    with cache.derived("89ab-byte") as again:
        assert (again / "tokens.bin").read_bytes() == payload(SIZE)
    make(cache, "cdef-char", SIZE)
    assert cached(cache) == ["89ab-byte", "cdef-char"]
    assert sorted(p.name for p in cache.made.iterdir()) == ["89ab-byte", "cdef-char"]
    assert sorted(p.name for p in cache.locks.iterdir()) == ["89ab-byte.use", "cdef-char.use"]


def test_discard_evicts_the_derived_entries_of_a_prefix_unless_held(tmp_path):
    cache = ArtifactCache(tmp_path / "cache", 10 * SIZE, LocalStore(tmp_path / "artifacts"))
    for name in ("aaaa-1-char", "aaaa-2-bpe512", "bbbb-1-char"):
        make(cache, name, SIZE)
    with cache.derived("aaaa-2-bpe512"):
        assert cache.discard("aaaa") == ["aaaa-1-char"]
    assert cache.discard("aaaa") == ["aaaa-2-bpe512"]
    assert cached(cache) == ["bbbb-1-char"]
    (cache.made / ".aaaa-1-char.0123abcd.gone").mkdir()  # an eviction that died half way
    cache.trim()
    assert sorted(p.name for p in cache.made.iterdir()) == ["bbbb-1-char"]
    for name in ("../x", "A-char", "a/b", "", "a" * 64, ".gone"):
        with pytest.raises(ValueError), cache.derived(name):
            pass


def test_requests_are_checked(tmp_path):
    cache = ArtifactCache(tmp_path / "cache", SIZE, LocalStore(tmp_path / "artifacts"), direct=False)
    for key, size, digest in [("../x", 1, "a" * 64), ("k", -1, "a" * 64), ("k", 1, "A" * 64), ("k", 1, "../x")]:
        with pytest.raises(ValueError), cache.open(key, size, digest):
            pass
    with pytest.raises(ValueError):
        ArtifactCache(tmp_path / "cache", -1, LocalStore(tmp_path))
    with pytest.raises(ValueError):
        ArtifactCache(tmp_path / "cache", 0, Counting(LocalStore(tmp_path)), direct=True)


def test_the_local_store_hands_out_its_own_files(tmp_path):
    store = LocalStore(tmp_path / "artifacts")
    staged = Case(store, {}).put("datasets/t1/a.txt", b"corpus")
    cache = ArtifactCache(tmp_path / "cache", 0, store)
    with cache.open("datasets/t1/a.txt", staged.size, staged.sha256) as path:
        assert path == store.path("datasets/t1/a.txt")
    assert not (tmp_path / "cache").exists()
    with pytest.raises(IntegrityError), cache.open("datasets/t1/a.txt", staged.size + 1, staged.sha256):
        pass
    with pytest.raises(ObjectNotFound), cache.open("datasets/t1/b.txt", 1, staged.sha256):
        pass


def test_cache_from_settings(tmp_path, monkeypatch):
    monkeypatch.setenv("MUONFORGE_CACHE_DIR", str(tmp_path / "c"))
    monkeypatch.setenv("MUONFORGE_CACHE_BYTES", "1234")
    store = LocalStore(tmp_path / "artifacts")
    cache = cache_from(Settings(), store)
    assert (cache.directory, cache.max_bytes, cache.store) == (tmp_path / "c", 1234, store)
    monkeypatch.delenv("MUONFORGE_CACHE_DIR")
    monkeypatch.delenv("MUONFORGE_CACHE_BYTES")
    assert (Settings().cache_dir, Settings().cache_bytes) == (Path("var/cache").resolve(), 50 * 2**30)
    monkeypatch.setenv("MUONFORGE_CACHE_BYTES", "-1")
    with pytest.raises(ValueError):
        Settings()
