"""A worker's bounded local cache of store objects (MUONFORGE_CACHE_DIR, MUONFORGE_CACHE_BYTES).

``cache.open(key, size, sha256)`` is a context manager that yields a local file holding the
object's bytes; the file stays whole and in place while any context holds it, in any process of
the host.

Layout under the cache directory:

- ``objects/<sha256>``: one entry per content. An entry is named by the sha256 its bytes were
  verified against and appears only by the rename that ends the store's verified ``fetch`` (a
  temporary ``.<sha256>.<random>.part`` beside it, checked for size and sha256, flushed to disk,
  then renamed). So an entry's name is its verification record: a hit checks the file's size and
  never re-hashes it. Two keys with the same bytes share an entry; an object replaced in the store
  has another sha256, so it is another entry, fetched anew. A file whose size is not the expected
  one (truncated or grown behind the cache's back) is fetched again and replaced by a rename.
- ``locks/<sha256>.use``: the entry's pin. Each user holds a shared ``flock`` on it for as long as
  its context is open; eviction takes an exclusive lock without waiting and skips the entry when
  that fails, so an entry in use is never evicted. flock locks belong to an open file description,
  so they hold between processes and between contexts of one process alike, and vanish with a
  process that dies.
- ``locks/<sha256>.fetch``: held exclusively while the entry is downloaded. A second process that
  misses the same entry waits on it, then finds the entry whole: the object is downloaded once.
  Where it does not (the first download failed), it downloads it itself.
- ``derived/<name>/``: a directory of files this host made from others (a corpus's token arrays:
  the engine's token cache), named by what they were made from. ``cache.derived(name)`` pins it as
  an object's entry is pinned (``locks/<name>.use``) and hands out the directory as it is: its
  maker writes each file whole (a temporary file, then a rename) and the one that says the entry is
  complete last, so a reader that does not find that file makes the entry itself. It counts by its
  files' sizes, its last use is its modification time (set when it is opened and let go), and it is
  evicted like an object: renamed aside (``.<name>.<random>.gone``), then removed.

A lock file is only removed by a process that holds it exclusively; whoever locks one checks
afterwards that the path still names the file it locked, and starts again when not.

Eviction: least recently used first, by the entry's modification time, which every open sets to
now (so recency survives restarts). A miss first evicts down to ``max_bytes`` less the object's
size, then downloads; every context's exit evicts down to ``max_bytes``. Entries in use are
skipped, so the total may exceed ``max_bytes`` while they are held: an object larger than the
whole budget is fetched, used, and evicted once released. Temporary files of a download whose
process died, and lock files without an entry, go at the next eviction pass.

With a :class:`LocalStore` the cache hands out the store's own file, no copy (``direct``, the
default for that backend): the file's size is checked, its sha256 is not re-read (the store
wrote and hashed it on this host's filesystem). ``direct=False`` caches its copies like any store's.
Derived entries live in the cache directory with either store.
"""

from __future__ import annotations

import fcntl
import os
import re
import secrets
import shutil
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from app.storage.base import ArtifactStore, IntegrityError, ObjectNotFound, check_key
from app.storage.local import LocalStore

if TYPE_CHECKING:
    from app.settings import Settings

OBJECTS = "objects"
DERIVED = "derived"
LOCKS = "locks"
USE = "use"
FETCH = "fetch"
SHA256 = re.compile(r"[0-9a-f]{64}")
PART = re.compile(r"\.([0-9a-f]{64})\..*\.part")
NAME = re.compile(r"[0-9a-z][0-9a-z._-]{0,199}")
GONE = re.compile(r"\..*\.gone")


@dataclass(frozen=True)
class Entry:
    """One cache entry: an object (named by its sha256) or a derived directory (by its name), its
    size in bytes and last use (ns since the epoch)."""

    name: str
    path: Path
    size: int
    used_ns: int


class ArtifactCache:
    """Store objects as local files under ``directory``, at most ``max_bytes`` of them not in use."""

    def __init__(self, directory: Path, max_bytes: int, store: ArtifactStore, *, direct: bool | None = None) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        local = store if isinstance(store, LocalStore) else None
        if direct and local is None:
            raise ValueError(f"direct use needs a LocalStore, got {store!r}")
        self.directory = directory
        self.max_bytes = max_bytes
        self.store = store
        self.local = local if direct is not False else None
        self.objects = directory / OBJECTS
        self.made = directory / DERIVED
        self.locks = directory / LOCKS

    def __repr__(self) -> str:
        return f"ArtifactCache({str(self.directory)!r}, {self.max_bytes}, {self.store!r})"

    @contextmanager
    def open(self, key: str, size: int, sha256: str | None) -> Iterator[Path]:
        """A local file of ``key``'s bytes (``size`` bytes, ``sha256``), kept while the context is open.

        A miss downloads through the store's verified fetch: its errors (ObjectNotFound,
        IntegrityError, StoreUnavailable) pass through, and nothing is cached then. ``sha256``
        None (a row recorded before digests were kept) opens the local store's own file only.
        """
        check_request(key, size, sha256)
        if self.local is not None:
            yield store_file(self.local, key, size)
            return
        if sha256 is None:
            raise IntegrityError(f"{key}: no sha256 recorded to verify a copy against")
        self.objects.mkdir(parents=True, exist_ok=True)
        self.locks.mkdir(parents=True, exist_ok=True)
        path = self.objects / sha256
        try:
            with flocked(self.lock_path(sha256, USE), fcntl.LOCK_SH):
                if not whole(path, size):
                    self.fill(key, path, size, sha256)
                touch(path)
                yield path
        finally:
            self.trim()

    def fill(self, key: str, path: Path, size: int, sha256: str) -> None:
        """Download ``key`` into the entry at ``path`` unless another process did while this one waited."""
        with flocked(self.lock_path(sha256, FETCH), fcntl.LOCK_EX, remove=True):
            if whole(path, size):
                return
            self.trim(reserve=size)
            self.store.fetch(key, path, size, sha256)

    @contextmanager
    def derived(self, name: str) -> Iterator[Path]:
        """The directory of the derived entry ``name`` (made if absent), kept while the context is open.

        What is in it is whatever its makers left: files written whole, the entry complete once the
        file its maker writes last is there. Trimmed to ``max_bytes`` on the way out, as ``open``.
        """
        if not NAME.fullmatch(name) or SHA256.fullmatch(name):
            raise ValueError(f"a derived entry's name is lowercase letters, digits, '.', '_' and '-', got {name!r}")
        self.made.mkdir(parents=True, exist_ok=True)
        self.locks.mkdir(parents=True, exist_ok=True)
        path = self.made / name
        try:
            with flocked(self.lock_path(name, USE), fcntl.LOCK_SH):
                path.mkdir(exist_ok=True)
                touch(path)
                try:
                    yield path
                finally:
                    touch(path)  # used until now; and a file written in it set a coarser clock's time
        finally:
            self.trim()

    def discard(self, prefix: str) -> list[str]:
        """Evict the derived entries whose name starts with ``prefix`` and that no one holds; their names."""
        gone = [e.name for e in self.entries() if e.path.parent == self.made and e.name.startswith(prefix)]
        return [name for name in gone if self.evict(self.made / name)]

    def entries(self) -> list[Entry]:
        """The cache's entries, objects and derived directories, least recently used first."""
        found = []
        for item in scan(self.objects):
            if SHA256.fullmatch(item.name):
                try:
                    st = item.stat()
                except FileNotFoundError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    found.append(Entry(item.name, Path(item.path), st.st_size, st.st_mtime_ns))
        for item in scan(self.made):
            if NAME.fullmatch(item.name) and item.is_dir(follow_symlinks=False):
                try:
                    used = item.stat().st_mtime_ns
                except FileNotFoundError:
                    continue
                found.append(Entry(item.name, Path(item.path), tree_size(Path(item.path)), used))
        return sorted(found, key=lambda e: (e.used_ns, e.name))

    def usage(self) -> int:
        """Bytes the cached objects take (those in use included)."""
        return sum(e.size for e in self.entries())

    def trim(self, reserve: int = 0) -> list[str]:
        """Evict least recently used entries not in use until they total at most ``max_bytes -
        reserve``; then remove what dead downloads and evictions left. Returns the evicted entries'
        names (an object's is its sha256)."""
        entries = self.entries()
        goal, total, evicted = self.max_bytes - reserve, sum(e.size for e in entries), []
        for entry in entries:
            if total <= goal:
                break
            if self.evict(entry.path):
                total -= entry.size
                evicted.append(entry.name)
        self.sweep()
        return evicted

    def evict(self, path: Path) -> bool:
        """Remove the entry at ``path`` (an object's file or a derived directory) unless it is in
        use; whether it was removed."""
        lock = self.lock_path(path.name, USE)
        fd = try_lock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if fd is None:
            return False
        try:
            if path.parent == self.made:
                aside = path.with_name(f".{path.name}.{secrets.token_hex(4)}.gone")
                with suppress(FileNotFoundError):
                    path.rename(aside)
                    shutil.rmtree(aside, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        finally:
            unlock(fd, lock, remove=True)
        return True

    def sweep(self) -> None:
        """Remove the temporary files of downloads whose process died, what an eviction that died
        left of a derived entry, and pins of absent entries."""
        present = set()
        for item in scan(self.objects):
            part = PART.fullmatch(item.name)
            if part and self.unused(part.group(1), FETCH):
                Path(item.path).unlink(missing_ok=True)
            elif SHA256.fullmatch(item.name):
                present.add(item.name)
        for item in scan(self.made):
            if GONE.fullmatch(item.name):
                shutil.rmtree(item.path, ignore_errors=True)
            else:
                present.add(item.name)
        for item in scan(self.locks):
            name, _, kind = item.name.rpartition(".")
            if kind == FETCH or (kind == USE and name not in present):
                self.unused(name, kind)

    def unused(self, name: str, kind: str) -> bool:
        """Remove the lock file of ``kind`` when no one holds it and, for a pin, its entry is absent;
        whether no one held it."""
        path = self.lock_path(name, kind)
        fd = try_lock(path, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if fd is None:
            return False
        absent = not (self.objects / name).exists() and not (self.made / name).exists()
        unlock(fd, path, remove=kind == FETCH or absent)
        return True

    def lock_path(self, name: str, kind: str) -> Path:
        """The lock file of ``kind`` (use or fetch) of an entry."""
        return self.locks / f"{name}.{kind}"


def cache_from(settings: Settings, store: ArtifactStore) -> ArtifactCache:
    """The cache the settings name (MUONFORGE_CACHE_DIR, MUONFORGE_CACHE_BYTES) in front of ``store``."""
    return ArtifactCache(settings.cache_dir, settings.cache_bytes, store)


def check_request(key: str, size: int, sha256: str | None) -> None:
    """ValueError unless ``key`` is a valid key, ``size`` a byte count and ``sha256`` lowercase hex
    (or None)."""
    check_key(key)
    if size < 0:
        raise ValueError(f"{key}: size must be >= 0, got {size}")
    if sha256 is not None and not SHA256.fullmatch(sha256):
        raise ValueError(f"{key}: sha256 must be 64 lowercase hex digits, got {sha256!r}")


def store_file(store: LocalStore, key: str, size: int) -> Path:
    """The local store's own file of ``key``, when it has ``size`` bytes."""
    path = store.path(key)
    try:
        st = path.stat()
    except (FileNotFoundError, NotADirectoryError):
        raise ObjectNotFound(key) from None
    if not stat.S_ISREG(st.st_mode):
        raise ObjectNotFound(key)
    if st.st_size != size:
        raise IntegrityError(f"{key}: {st.st_size} bytes stored, {size} recorded")
    return path


def tree_size(directory: Path) -> int:
    """Bytes the files under ``directory`` hold (those removed meanwhile not counted)."""
    total = 0
    for root, _, files in os.walk(directory):
        for name in files:
            with suppress(FileNotFoundError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def whole(path: Path, size: int) -> bool:
    """Whether the entry at ``path`` is there with ``size`` bytes."""
    try:
        return path.stat().st_size == size
    except FileNotFoundError:
        return False


def touch(path: Path) -> None:
    """Mark the entry used now (its modification time, to the nanosecond)."""
    now = time.time_ns()
    os.utime(path, ns=(now, now))


def scan(directory: Path) -> list[os.DirEntry[str]]:
    """The directory's entries; none when it is absent."""
    try:
        with os.scandir(directory) as items:
            return list(items)
    except FileNotFoundError:
        return []


@contextmanager
def flocked(path: Path, operation: int, *, remove: bool = False) -> Iterator[None]:
    """Hold ``operation`` (LOCK_SH or LOCK_EX) on the lock file at ``path``, waiting for it;
    ``remove`` (exclusive only): delete the file before letting go."""
    fd = try_lock(path, operation)
    if fd is None:
        raise BlockingIOError(f"{path} is locked")
    try:
        yield
    finally:
        unlock(fd, path, remove=remove)


def try_lock(path: Path, operation: int) -> int | None:
    """A descriptor of the file at ``path`` (created if absent) locked with ``operation``; None when
    ``operation`` has LOCK_NB and another holds it. Retries when the file was removed meanwhile."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, operation)
        except BlockingIOError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        if same_file(fd, path):
            return fd
        os.close(fd)


def same_file(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the open file ``fd``."""
    try:
        named = path.stat()
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


def unlock(fd: int, path: Path, *, remove: bool = False) -> None:
    """Let go of a lock from :func:`try_lock`, first deleting its file when ``remove``."""
    try:
        if remove:
            path.unlink(missing_ok=True)
    finally:
        os.close(fd)
