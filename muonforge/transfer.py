"""Files going up (dataset and model uploads) and down (checkpoint downloads and exports), with progress.

Progress is reported as ``progress(done_bytes, total_bytes_or_None)``; shared by Client and
AsyncClient.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import tarfile
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from contract.export import CONFIG_FILE, EXPORT_KEY

Progress = Callable[[int, "int | None"], None]
HEADER_LIMIT = 100_000_000  # bytes: the limit the safetensors format sets on a header
SAFE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,99}")  # an archive member: a file name, no path


class ProgressReader:
    """A binary file that reports the bytes read so far. httpx reads it in chunks and seeks it
    to the start before each send, so a retried upload counts from 0 again."""

    def __init__(self, file: BinaryIO, progress: Progress | None) -> None:
        self._file, self._progress = file, progress
        self.done = 0
        self.total = self._size() if self.seekable() else None

    def read(self, size: int = -1) -> bytes:
        chunk = self._file.read(size)
        self.done += len(chunk)
        if self._progress and chunk:
            self._progress(self.done, self.total)
        return chunk

    def seekable(self) -> bool:
        return bool(getattr(self._file, "seekable", lambda: False)())

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        if not self.seekable():
            raise io.UnsupportedOperation("the upload cannot be read again")
        self.done = self._file.seek(offset, whence)
        return self.done

    def tell(self) -> int:
        return self._file.tell()

    def _size(self) -> int:
        position = self._file.tell()
        size = self._file.seek(0, os.SEEK_END)
        self._file.seek(position)
        return size


@contextmanager
def open_upload(file: str | os.PathLike | BinaryIO, progress: Progress | None) -> Iterator[tuple[str, ProgressReader]]:
    """The file name and a counting reader of ``file``: a path (opened here) or a binary file."""
    if isinstance(file, (str, os.PathLike)):
        path = Path(file)
        with path.open("rb") as f:
            yield path.name, ProgressReader(f, progress)
    else:
        yield Path(str(getattr(file, "name", "dataset.txt"))).name, ProgressReader(file, progress)


@contextmanager
def open_model_upload(path: str | os.PathLike, progress: Progress | None) -> Iterator[tuple[str, ProgressReader]]:
    """The file name and a counting reader of a model to upload: an archive file as it is, or a
    model directory archived here, as a tar of its files (written to a temporary file and removed
    once sent; its subdirectories are left out: a model directory has none)."""
    path = Path(path)
    if not path.is_dir():
        with open_upload(path, progress) as upload:
            yield upload
        return
    with tempfile.TemporaryFile(prefix="muonforge-model-", suffix=".tar") as archive:
        write_model_tar(path, archive)
        archive.seek(0)
        yield f"{path.name}.tar", ProgressReader(archive, progress)


def model_files(directory: Path) -> list[Path]:
    """The files of a model directory that go up, by name (subdirectories are left out: a model
    directory has none)."""
    return sorted(file for file in directory.iterdir() if file.is_file())


def write_model_tar(directory: Path, out: BinaryIO) -> None:
    """A tar of the model directory's files, written to ``out``."""
    with tarfile.open(fileobj=out, mode="w") as tar:
        for file in model_files(directory):
            tar.add(file, arcname=file.name, recursive=False)


def model_in_parts(path: Path, part_size: int) -> Path | None:
    """The file a model goes up as in parts: the archive itself, or a directory's kept tar
    (:func:`model_archive`); None when its files fit in one part (one request)."""
    files = model_files(path) if path.is_dir() else [path]
    if sum(file.stat().st_size for file in files) <= part_size:
        return None
    return model_archive(path) if path.is_dir() else path


def model_archive(directory: Path) -> Path:
    """A tar of a model directory's files kept under the uploads' cache (``uploads_directory``)
    until its upload completes (the caller deletes it then), so an upload interrupted and started
    again sends the same file and resumes. It is named by the directory's path and its files'
    names, sizes and modification times: a directory changed since gets an archive of its own."""
    files = [(file.name, file.stat()) for file in model_files(directory)]
    identity = "\n".join([str(directory.resolve())] + [f"{n}\t{st.st_size}\t{st.st_mtime_ns}" for n, st in files])
    path = uploads_directory() / hashlib.sha256(identity.encode()).hexdigest()[:32] / f"{directory.name}.tar"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".part")
        with partial.open("wb") as out:
            write_model_tar(directory, out)
        partial.replace(path)  # whole, or not there
    return path


def uploads_directory() -> Path:
    """Where the clients keep what resumes uploads: ``$XDG_CACHE_HOME/muonforge/uploads``
    (``~/.cache`` by default)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "muonforge" / "uploads"


class Download:
    """A file written as it arrives, through ``<path>.part``: ``path`` appears only complete, and
    a retried download starts the part file again."""

    def __init__(self, path: str | os.PathLike, headers: Mapping[str, str], progress: Progress | None) -> None:
        self.path = Path(path)
        self._part = self.path.with_name(self.path.name + ".part")
        length = headers.get("content-length")
        self.total = int(length) if length and length.isdigit() else None
        self.done, self._progress = 0, progress

    def __enter__(self) -> Download:
        self._out = self._part.open("wb")
        if self._progress:
            self._progress(0, self.total)
        return self

    def write(self, chunk: bytes) -> None:
        self._out.write(chunk)
        self.done += len(chunk)
        if self._progress:
            self._progress(self.done, self.total)

    def __exit__(self, exc_type, *exc) -> None:
        self._out.close()
        if exc_type is None:
            self._part.replace(self.path)
        else:
            self._part.unlink(missing_ok=True)


def export_metadata(weights: Path) -> dict[str, str]:
    """The metadata of a safetensors file, read from its header: 8 bytes, the header's length
    (little-endian), then the header as JSON, whose ``__metadata__`` holds it. Read here rather
    than with the safetensors package, whose reader needs numpy or torch even for the header:
    the client installs neither."""
    with weights.open("rb") as file:
        prefix = file.read(8)
        length = int.from_bytes(prefix, "little") if len(prefix) == 8 else 0
        header = file.read(length) if length <= HEADER_LIMIT else b""
    if not 0 < length == len(header):
        raise ValueError(f"{weights}: not a safetensors file (no header, or one cut short or too long)")
    return json.loads(header).get("__metadata__") or {}


def write_export_config(weights: Path) -> Path:
    """Write the model's config held in an exported safetensors file's metadata beside it, as
    ``config.json``; returns its path. Reads the file's header only."""
    config = json.loads(export_metadata(weights)[EXPORT_KEY])
    path = weights.with_name(CONFIG_FILE)
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return path


def extract_export(archive: Path, directory: Path) -> list[Path]:
    """Write the files of a transformers export's tar archive (``format=hf``) into ``directory``;
    returns them.

    Every member must be a plain file whose name is a file name alone (letters, digits, ``.``, ``_``
    and ``-``, no path, not hidden): anything else (a directory, a link, a device, ``../x``, an
    absolute path) is refused with ValueError before any file is written. Each file is written
    through ``<name>.part``, so it appears only complete.
    """
    written = []
    with tarfile.open(archive, mode="r:") as tar:
        members = tar.getmembers()
        for member in members:
            if not member.isfile() or not SAFE_NAME.fullmatch(member.name):
                raise ValueError(f"{archive}: member {member.name!r} is not a plain file with a safe name")
        directory.mkdir(parents=True, exist_ok=True)
        for member in members:
            source = tar.extractfile(member)
            assert source is not None  # a regular file's member always has its data
            path = directory / member.name
            part = path.with_name(path.name + ".part")
            with source, part.open("wb") as out:
                shutil.copyfileobj(source, out)
            part.replace(path)
            written.append(path)
    return written


# -- resumable uploads in parts -----------------------------------------------------------------
PART_BYTES = 64 * 2**20  # the server's largest part: files larger than one go up in parts
READ_BYTES = 2**20


@dataclass(frozen=True)
class Part:
    """A part of a file: its number (from 1), where it starts and its length."""

    number: int
    offset: int
    length: int


def parts_of(size: int, part_size: int = PART_BYTES) -> list[Part]:
    """A file of ``size`` bytes cut into parts of ``part_size`` (the last one shorter)."""
    return [Part(n, offset, min(part_size, size - offset)) for n, offset in enumerate(range(0, size, part_size), 1)]


def part_chunks(path: Path, part: Part, digest: hashlib._Hash, sent: Callable[[int], None]) -> Iterator[bytes]:
    """The part's bytes read from the file in chunks, each added to ``digest`` and counted by ``sent``."""
    with path.open("rb") as f:
        f.seek(part.offset)
        left = part.length
        while left and (chunk := f.read(min(READ_BYTES, left))):
            left -= len(chunk)
            digest.update(chunk)
            sent(len(chunk))
            yield chunk


def part_sha256(path: Path, part: Part) -> str:
    """The sha256 of the part's bytes in the file."""
    digest = hashlib.sha256()
    for _ in part_chunks(path, part, digest, lambda n: None):
        pass
    return digest.hexdigest()


class UploadState:
    """Where an interrupted upload of a file is remembered, so that the next upload of the same file
    (the same path, size and modification time, to the same server, for the same purpose) resumes
    it: a small JSON file under ``$XDG_CACHE_HOME/muonforge/uploads`` (``~/.cache`` by default)."""

    def __init__(self, server: str, path: Path, purpose: str) -> None:
        st = path.stat()
        identity = f"{server}\n{path.resolve()}\n{st.st_size}\n{st.st_mtime_ns}\n{purpose}"
        self.file = uploads_directory() / f"{hashlib.sha256(identity.encode()).hexdigest()[:32]}.json"

    def upload_id(self) -> str | None:
        try:
            return str(json.loads(self.file.read_text())["upload_id"])
        except (OSError, ValueError, KeyError):
            return None

    def remember(self, upload_id: str) -> None:
        self.file.parent.mkdir(parents=True, exist_ok=True)
        self.file.write_text(json.dumps({"upload_id": upload_id}))

    def forget(self) -> None:
        self.file.unlink(missing_ok=True)


class SharedProgress:
    """``progress(done, total)`` for parts sent from several threads: their bytes added up."""

    def __init__(self, progress: Progress | None, total: int) -> None:
        self._progress, self.total, self.done = progress, total, 0
        self._lock = threading.Lock()

    def add(self, nbytes: int) -> None:
        with self._lock:
            self.done += nbytes
            if self._progress is not None:
                self._progress(self.done, self.total)

    def counter(self) -> PartProgress:
        """A part's share, to take back if the part is sent again."""
        return PartProgress(self)


class PartProgress:
    """The bytes of one send of a part, counted into the shared progress."""

    def __init__(self, shared: SharedProgress) -> None:
        self.shared, self.sent = shared, 0

    def add(self, nbytes: int) -> None:
        self.sent += nbytes
        self.shared.add(nbytes)

    def undo(self) -> None:
        """Take this send's bytes back (the part goes again)."""
        self.shared.add(-self.sent)
        self.sent = 0
