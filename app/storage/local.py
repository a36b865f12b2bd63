"""The local-directory backend: artifacts as files under one root (MUONFORGE_ARTIFACT_DIR)."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import BinaryIO

from app.storage.base import (
    CHUNK_BYTES,
    ObjectInfo,
    ObjectNotFound,
    Staged,
    StagingWriter,
    check_key,
    check_prefix,
    check_range,
    copy_file,
    download_verified,
    file_sha256,
    staging_key,
)


class FileSink:
    """A staging file: written through, flushed to disk on finish, removed on abort."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.file: BinaryIO = path.open("wb")

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.file.write(data)

    def finish(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()

    def abort(self, exc: BaseException) -> None:
        self.file.close()
        self.path.unlink(missing_ok=True)


class LocalStore:
    """Artifacts as files under ``root``: the embedded default, and one shared volume's layout."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def __repr__(self) -> str:
        return f"LocalStore({str(self.root)!r})"

    def path(self, key: str) -> Path:
        """The file of ``key``."""
        return self.root / check_key(key)

    def writer(self) -> StagingWriter:
        """A writer to a new staging file."""
        key = staging_key()
        return StagingWriter(key, FileSink(self.path(key)))

    def stage_file(self, path: Path) -> Staged:
        """A file under ``root`` as it is (its key: its path there), hashed; any other copied in."""
        try:
            key = path.resolve().relative_to(self.root.resolve()).as_posix()
        except ValueError:
            return copy_file(self.writer(), path)
        return Staged(check_key(key), path.stat().st_size, file_sha256(path))

    def commit(self, staged: str, final: str) -> None:
        """Rename the staging file onto the final key's file (atomic on one filesystem)."""
        source, target = self.path(staged), self.path(final)
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.replace(source, target)
        except FileNotFoundError:
            if not target.is_file():
                raise ObjectNotFound(staged) from None
            return
        sync_directory(target.parent)

    def put_file(self, path: Path, key: str) -> Staged:
        """The file at ``path`` staged (in place when it is under ``root``) and committed to ``key``."""
        staged = self.stage_file(path)
        if staged.key != check_key(key):
            self.commit(staged.key, key)
        return Staged(key, staged.size, staged.sha256)

    def fetch(self, key: str, dest: Path, size: int, sha256: str) -> Path:
        """Copy the file to ``dest``, verified."""
        return download_verified(key, self.open_range(key), dest, size, sha256)

    def open_range(self, key: str, start: int = 0, end: int | None = None) -> Iterator[bytes]:
        """The bytes ``[start, end)`` of the file, from a handle opened now."""
        try:
            file = self.path(key).open("rb")
        except (FileNotFoundError, IsADirectoryError):
            raise ObjectNotFound(key) from None
        lo, hi = check_range(start, end, os.fstat(file.fileno()).st_size)
        return read_file(file, lo, hi)

    def stat(self, key: str) -> ObjectInfo | None:
        """The file's size and modification time, or None."""
        try:
            st = self.path(key).stat()
        except FileNotFoundError:
            return None
        return info(key, st) if stat.S_ISREG(st.st_mode) else None

    def delete(self, key: str) -> None:
        """Remove the file, if there."""
        self.path(key).unlink(missing_ok=True)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every file under ``root/prefix``."""
        base = self.root / check_prefix(prefix)
        for directory, _, files in os.walk(base):
            for name in files:
                path = Path(directory, name)
                try:
                    st = path.stat()
                except FileNotFoundError:
                    continue
                yield info(path.relative_to(self.root).as_posix(), st)


def info(key: str, st: os.stat_result) -> ObjectInfo:
    """An ObjectInfo from a file's stat."""
    return ObjectInfo(key, st.st_size, datetime.fromtimestamp(st.st_mtime, UTC))


def read_file(file: BinaryIO, start: int, end: int) -> Iterator[bytes]:
    """The bytes ``[start, end)`` of an open file in chunks; closes it."""
    with file:
        file.seek(start)
        left = end - start
        while left > 0 and (chunk := file.read(min(CHUNK_BYTES, left))):
            left -= len(chunk)
            yield chunk


def sync_directory(path: Path) -> None:
    """Flush a directory's entries (a rename in it) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
