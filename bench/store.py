"""The artifact store's checkpoint and cache paths, a bucket against the local store, side by side.

    .venv/bin/python bench/store.py [--part all|checkpoint|upload] [--mb 256] [--rounds 3]
        [--upload-mb 2048] [--url s3://bucket/prefix] [--json PATH]

The bucket is moto's S3 server on 127.0.0.1, started here (or, with ``--url``, the one the
``AWS_*`` variables reach, such as MinIO). Each round times, for each backend, in alternating
order:

- **save**: what a worker does with a checkpoint of ``--mb`` MB of fp32 tensors: the engine's
  durable write into the run's directory (``save_checkpoint``: temp file, fsync, rename), then the
  store's ``put_file`` (local: the file is hashed where it is; bucket: uploaded in parts straight to
  its attempt-unique key). "blocked" is the engine's write alone: the time training stops
  for, since the rest runs on the attempt's upload thread.
- **restore**: what an attempt resuming on a host does: a bucket's checkpoint is fetched
  (verified) into a fresh run directory, then loaded; the local store's own file is loaded.
- **cache hit**: a job opening a cached object and reading it whole: the worker cache's hit
  path in front of the bucket (flock pin, size check, touch, the entry's file read) against the
  local store's own file through the same cache (``direct``), HITS times each, in alternating
  pairs after the rounds (one read takes tens of ms: a few would be noise).

Ratios are bucket / local of the medians (targets: save and restore <= 1.2, cache hit <= 1.05).

``--part upload``: a file of ``--upload-mb`` MB sent through a real API process (one process, the
local store, a fresh database) by the Python client in 64 MiB parts, 4 at a time, over loopback:
MB/s of the parts (target >= 200), the completion's time (the dataset's checks and its write),
and the API's RSS growth over its idle value, sampled every 50 ms (target <= 64 MB).
"""

from __future__ import annotations

import argparse
import json
import platform
import secrets
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch
from stack import ROOT  # noqa: F401 - puts this checkout on sys.path, for tests.support

from app.storage import ArtifactCache, ArtifactStore, LocalStore
from app.storage.s3 import S3Store
from muonforge import api
from tests.support.s3 import BUCKET, MOTO_ENV, moto_server
from worker.engine.checkpoints import load_checkpoint, save_checkpoint

HITS = 60


def payload(mb: int) -> dict:
    """A checkpoint's payload of ``mb`` MB of fp32 weights in 16 tensors."""
    per = mb * 2**20 // 4 // 16
    generator = torch.Generator().manual_seed(0)
    return {"model": {f"w{i}": torch.randn(per, generator=generator) for i in range(16)}}


def save(store: ArtifactStore, run_dir: Path, state: dict, step: int) -> tuple[float, float, str, int, str]:
    """Seconds blocked (the engine's write) and in all (stored and committed); the key, size, sha256."""
    start = time.perf_counter()
    path, _ = save_checkpoint(run_dir / "checkpoints", step, state)
    blocked = time.perf_counter() - start
    local = isinstance(store, LocalStore)
    key = path.relative_to(store.root).as_posix() if local else f"bench/{secrets.token_hex(4)}/{path.name}"
    staged = store.put_file(path, key)
    return blocked, time.perf_counter() - start, key, staged.size, staged.sha256


def restore(store: ArtifactStore, key: str, size: int, sha256: str, host_dir: Path) -> float:
    """Seconds to have the checkpoint loaded on a host: fetched first from a bucket."""
    start = time.perf_counter()
    path = store.path(key) if isinstance(store, LocalStore) else store.fetch(key, host_dir / "step.pt", size, sha256)
    load_checkpoint(path)
    return time.perf_counter() - start


def read_whole(path: Path) -> int:
    total = 0
    with path.open("rb", buffering=0) as f:
        while chunk := f.read(8 * 2**20):
            total += len(chunk)
    return total


def hit(cache: ArtifactCache, key: str, size: int, sha256: str) -> float:
    """Seconds to open a cached object and read it whole."""
    start = time.perf_counter()
    with cache.open(key, size, sha256) as path:
        assert read_whole(path) == size
    return time.perf_counter() - start


def median(values: list[float]) -> float:
    return statistics.median(values)


def run(mb: int, rounds: int, bucket: S3Store, work: Path) -> dict:
    local = LocalStore(work / "artifacts")
    stores: dict[str, ArtifactStore] = {"local": local, "bucket": bucket}
    state = payload(mb)
    times: dict[str, dict[str, list[float]]] = {
        name: {"blocked": [], "save": [], "restore": [], "hit": []} for name in stores
    }
    caches = {
        "local": ArtifactCache(work / "cache-local", 10 * 2**30, local),
        "bucket": ArtifactCache(work / "cache-bucket", 10 * 2**30, bucket),
    }
    last: dict[str, tuple[str, int, str]] = {}
    for r in range(rounds):
        order = list(stores) if r % 2 == 0 else list(reversed(stores))
        for name in order:
            store = stores[name]
            run_dir = (local.root if name == "local" else work / "scratch") / "jobs" / f"r{r}"
            blocked, total, key, size, sha256 = save(store, run_dir, state, 100)
            host = Path(tempfile.mkdtemp(dir=work, prefix="host-"))
            restored = restore(store, key, size, sha256, host)
            hit(caches[name], key, size, sha256)  # the miss that fills the bucket's cache
            last[name] = (key, size, sha256)
            for label, value in (("blocked", blocked), ("save", total), ("restore", restored)):
                times[name][label].append(value)
            print(
                f"round {r} {name:6s}: blocked {blocked:.3f} s, saved {total:.3f} s ({mb / total:.0f} MB/s), "
                f"restored {restored:.3f} s",
                flush=True,
            )
    for i in range(HITS):  # a read of tens of ms: many, in alternating pairs
        for name in stores if i % 2 == 0 else reversed(stores):
            times[name]["hit"].append(hit(caches[name], *last[name]))
    result = {"mb": mb, "rounds": rounds, "host": platform.processor() or platform.machine()}
    for label in ("blocked", "save", "restore", "hit"):
        result[label] = {name: median(times[name][label]) for name in stores}
        result[label]["ratio"] = result[label]["bucket"] / result[label]["local"]
    return result


def tree_rss(pid: int) -> int:
    """Resident bytes of a process and its children (from /proc)."""
    total = 0
    for p in [pid, *children(pid)]:
        try:
            status = Path(f"/proc/{p}/status").read_text()
        except OSError:
            continue
        total += int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:"))) * 1024
    return total


def children(pid: int) -> list[int]:
    try:
        direct = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []
    return direct + [g for c in direct for g in children(c)]


def upload(mb: int, work: Path) -> dict:
    """MB/s of a file's parts through the API, the completion's seconds and the API's RSS growth."""
    from muonforge import Client
    from tests.support.stack import Stack

    path = work / "corpus.txt"
    line = b"the quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs.\n"
    block = line * (2**20 // len(line))
    with path.open("wb") as f:
        for _ in range(mb):
            f.write(block)
    size = path.stat().st_size
    env = {"MUONFORGE_UPLOAD_LIMIT_BYTES": str(size), "MUONFORGE_TENANT_STORAGE_BYTES": str(4 * size)}
    with Stack("store_upload", "redis://127.0.0.1:6379/11", env) as stack:
        url = stack.start_api(processes=1)
        key = stack.api_key("bench")
        assert stack.api is not None
        pid = stack.api.pid
        time.sleep(1.0)
        idle = tree_rss(pid)
        peak, stop = [idle], threading.Event()

        def sample() -> None:
            while not stop.wait(0.05):
                peak.append(tree_rss(pid))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        with Client(url, key, timeout=600) as client:
            start = time.perf_counter()
            created = client._call(api.create_upload("dataset", path.name, size, None))
            from muonforge.transfer import SharedProgress, parts_of

            shared = SharedProgress(None, size)
            parts = parts_of(size)
            with ThreadPoolExecutor(4) as pool:
                digests = list(pool.map(lambda p: client._send_part(created["id"], path, p, shared), parts))
            sent = time.perf_counter()
            done = client._call(api.complete_upload(created["id"], list(enumerate(digests, 1)), size))
            completed = time.perf_counter()
        stop.set()
        sampler.join()
        assert done["status"] == "completed"
    return {
        "mb": size / 1e6,
        "parts": len(parts),
        "parts_mb_s": size / 1e6 / (sent - start),
        "complete_s": completed - sent,
        "whole_mb_s": size / 1e6 / (completed - start),
        "rss_idle_mb": idle / 1e6,
        "rss_growth_mb": (max(peak) - idle) / 1e6,
    }


def checkpoints(args: argparse.Namespace) -> dict:
    """The checkpoint and cache paths, a bucket against the local store; prints the table."""
    server = None
    if args.url:
        bucket = S3Store.from_url(args.url)
    else:
        server, endpoint = moto_server()
        httpx.put(f"{endpoint}/{BUCKET}", timeout=10).raise_for_status()
        bucket = S3Store.from_url(f"s3://{BUCKET}/bench", env={**MOTO_ENV, "AWS_ENDPOINT_URL": endpoint})
    try:
        with tempfile.TemporaryDirectory(prefix="store-bench-") as work:
            result = run(args.mb, args.rounds, bucket, Path(work))
    finally:
        if server is not None:
            server.stop()
    for label, what in (
        ("blocked", "training blocked"),
        ("save", "save"),
        ("restore", "restore"),
        ("hit", "cache hit"),
    ):
        row = result[label]
        print(f"{what:17s} local {row['local']:.3f} s  bucket {row['bucket']:.3f} s  bucket/local {row['ratio']:.3f}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["all", "checkpoint", "upload"], default="all")
    parser.add_argument("--upload-mb", type=int, default=2048)
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--url", help="s3://bucket/prefix of a running server (default: moto's, started here)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results = {}
    if args.part in ("all", "checkpoint"):
        results["checkpoint"] = checkpoints(args)
    if args.part in ("all", "upload"):
        with tempfile.TemporaryDirectory(prefix="store-upload-") as work:
            up = results["upload"] = upload(args.upload_mb, Path(work))
        print(
            f"upload of {up['mb']:,.0f} MB in {up['parts']} parts through the API: parts {up['parts_mb_s']:.0f} MB/s, "
            f"completion {up['complete_s']:.1f} s (whole {up['whole_mb_s']:.0f} MB/s); API RSS "
            f"{up['rss_idle_mb']:.0f} MB idle, +{up['rss_growth_mb']:.1f} MB at most"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
