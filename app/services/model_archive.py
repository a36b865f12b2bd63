"""An uploaded model's archive, read member by member into a directory of its own.

A tar (optionally gzipped) or a zip: every member is checked as it is read (a safe name, a regular
file, an allowed name, their count and declared sizes within the limits) and copied by this code,
never by the archive library's own extraction (app.services.models stores what it gives).
"""

from __future__ import annotations

import gzip
import hashlib
import os
import re
import stat
import tarfile
import zipfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import IO, Any, BinaryIO

from app.errors import PayloadTooLarge, ValidationFailed
from app.services.datasets import CHUNK, over_quota
from app.settings import Settings

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
SHARD = re.compile(r"model-(\d{5})-of-(\d{5})\.safetensors")
# Data files of a tokenizer and of generation; none of them is code.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)
GENERATION_FILE = "generation_config.json"
NAMED = frozenset({CONFIG, WEIGHTS, INDEX, GENERATION_FILE, *TOKENIZER_FILES})
PICKLED = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")  # weights that would run code when loaded
LONG_HEADER = 1 << 16  # bytes of a tar's extended (PAX) or long-name header: a model's file names are short


def allowed_names() -> str:
    return ", ".join([*sorted(NAMED), "model-NNNNN-of-NNNNN.safetensors"])


@dataclass(frozen=True)
class Member:
    """A regular file of the archive, once copied: its path in the archive, where it was copied,
    its size and its SHA-256."""

    parts: tuple[str, ...]  # its path in the archive, "." and empty parts left out
    temp: Path  # where it was copied
    size: int
    sha256: str


def write_archive(stream: BinaryIO, path: Path, limit: int) -> tuple[int, str]:
    """Copy the upload to ``path``; its size and SHA-256. Reading stops once it passes ``limit``."""
    digest, size = hashlib.sha256(), 0
    with path.open("wb") as out:
        while chunk := stream.read(CHUNK):
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"the upload exceeds {limit:,} bytes", param="file")
            digest.update(chunk)
            out.write(chunk)
    return size, digest.hexdigest()


def refused(message: str) -> ValidationFailed:
    return ValidationFailed(message, param="file")


# -- the archive ----------------------------------------------------------------------------------
def gunzipped(archive: Path, unpacked: Path, settings: Settings) -> Path:
    """The archive, or for a gzipped one its tar written to ``unpacked``: decompressed on disk, and
    only up to the bytes its members may take (the model limit) plus their tar headers, so that a
    small gzip that inflates without end stops there, and the tar is then read with random access."""
    with archive.open("rb") as f:
        if f.read(2) != b"\x1f\x8b":
            return archive
    bound = settings.max_model_bytes + (settings.max_model_members + 8) * 4096  # headers, padding, end
    written = 0
    try:
        with gzip.open(archive, "rb") as source, unpacked.open("wb") as out:
            while chunk := source.read(CHUNK):
                written += len(chunk)
                if written > bound:
                    raise refused(
                        f"the archive unpacks to more than {bound:,} bytes "
                        "(MUONFORGE_MAX_MODEL_BYTES and its tar headers)"
                    )
                out.write(chunk)
    except (EOFError, zlib.error, gzip.BadGzipFile) as exc:
        raise refused(f"the archive is damaged or truncated ({exc})") from None
    return unpacked


def extract(archive: Path, staging: Path, settings: Settings, room: int, quota: int, used: int) -> dict[str, list[Any]]:
    """Copy the archive's regular files into ``staging``; their names there, each with its size and
    SHA-256 (hashed as it is copied: the files are not read again for it).

    Each member is checked before a byte of it is copied: its path (not absolute, no ``..``), its
    type (a regular file or a directory: no link, no device), its name (pickled weights refused as
    such, then the allowed set), the members' count and the sum of their declared sizes (within
    the model limit, then within what the quota leaves). A member is never copied past the size it
    declares. The files may sit at the archive's root or in one directory (``tar -C dir .``,
    ``zip -r m.zip dir``).
    """
    limit, cap = settings.max_model_bytes, settings.max_model_members
    members: list[Member] = []
    declared = 0
    try:
        for index, (raw, kind, size, open_member) in enumerate(_entries(archive)):
            if index >= cap:
                raise refused(f"the archive has more than {cap:,} members")
            parts = _safe_parts(raw)
            if kind == "link":
                raise refused(f"archive member {raw!r} is a link: only regular files are taken")
            if kind == "special":
                raise refused(
                    f"archive member {raw!r} is a device or another special file: only regular files are taken"
                )
            if kind == "dir" or not parts:
                continue
            _check_name(raw, parts[-1])
            declared += size
            if declared > limit:
                raise refused(
                    f"the archive's members declare more than {limit:,} bytes uncompressed (MUONFORGE_MAX_MODEL_BYTES)"
                )
            if declared > room:
                raise over_quota(quota, used)
            temp = staging / f".member-{index}"
            members.append(Member(parts, temp, size, _copy(open_member, temp, size, raw)))
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, zlib.error, gzip.BadGzipFile) as exc:
        raise refused(f"the archive is damaged or truncated ({exc})") from None
    return {name: [m.size, m.sha256] for name, m in zip(_place(members, staging), members, strict=True)}


Entry = tuple[str, str, int, Callable[[], IO[bytes]]]  # name, kind (file, dir, link, special), size, opener


def _entries(archive: Path) -> Iterator[Entry]:
    """The archive's members in order, read one at a time (a tar's next header only once the
    previous member is done with)."""
    with archive.open("rb") as f:
        magic = f.read(4)
    if magic[:2] == b"PK":
        yield from _zip_entries(archive)
        return
    _check_tar_headers(archive)
    with _open_tar(archive) as tar:
        while (info := tar.next()) is not None:
            if info.issym() or info.islnk():
                kind = "link"
            elif info.isdir():
                kind = "dir"
            elif info.isfile():
                kind = "file"
            else:
                kind = "special"
            yield info.name, kind, info.size, partial(_tar_open, tar, info)


def _check_tar_headers(archive: Path) -> None:
    """Refuse a tar whose long-name or extended (PAX) header is larger than LONG_HEADER: the tar
    library reads such a header into memory whole. Reads the 512-byte headers alone, from member to
    member; what it cannot parse is left to the library to refuse."""
    size, offset = archive.stat().st_size, 0
    with archive.open("rb") as f:
        while offset + 512 <= size:
            f.seek(offset)
            block = f.read(512)
            if block == bytes(512):
                return
            length = _tar_number(block[124:136])
            if length is None:
                return
            if block[156:157] in (b"x", b"g", b"L", b"K") and length > LONG_HEADER:
                raise refused(f"the archive has an extended header of {length:,} bytes (at most {LONG_HEADER:,})")
            offset += 512 + -(-length // 512) * 512


def _tar_number(field: bytes) -> int | None:
    """A tar header's number field: octal text, or base-256 (its first byte 0x80); None if neither."""
    if field[0] == 0x80:
        return int.from_bytes(field[1:], "big")
    try:
        return int(field.replace(b"\0", b" ").strip() or b"0", 8)
    except ValueError:
        return None


def _open_tar(archive: Path) -> tarfile.TarFile:
    try:
        return tarfile.open(archive, "r:")
    except tarfile.TarError:
        raise refused("the file is not a tar, tar.gz or zip archive") from None


def _tar_open(tar: tarfile.TarFile, info: tarfile.TarInfo) -> IO[bytes]:
    member = tar.extractfile(info)
    assert member is not None  # a regular file
    return member


def _zip_entries(archive: Path) -> Iterator[Entry]:
    with zipfile.ZipFile(archive) as zf:
        for info in zf.infolist():
            mode = info.external_attr >> 16  # the Unix mode, where the archiver recorded one
            if stat.S_ISLNK(mode):
                kind = "link"
            elif info.is_dir() or stat.S_ISDIR(mode):
                kind = "dir"
            elif stat.S_IFMT(mode) == 0 or stat.S_ISREG(mode):  # no file type recorded: a file
                kind = "file"
            else:
                kind = "special"
            yield info.filename, kind, info.file_size, partial(zf.open, info)


def _safe_parts(raw: str) -> tuple[str, ...]:
    if raw.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", raw):
        raise refused(f"archive member {raw!r} has an absolute path")
    if "\\" in raw:
        raise refused(f"archive member {raw!r} has a backslash in its path")
    parts = tuple(p for p in raw.split("/") if p not in ("", "."))
    if ".." in parts:
        raise refused(f"archive member {raw!r} has '..' in its path")
    return parts


def is_model_file(name: str) -> bool:
    """Whether a model directory's file of this name is one the service reads."""
    return name in NAMED or SHARD.fullmatch(name) is not None


def check_not_pickled(name: str, label: str) -> None:
    """Refuse a pickled weight file (``label`` names it in the message): loading one runs code."""
    if name.lower().endswith(PICKLED):
        raise refused(
            f"{label} is a pickled weight file: safetensors only (model.safetensors, or "
            "model-NNNNN-of-NNNNN.safetensors with model.safetensors.index.json)"
        )


def _check_name(raw: str, name: str) -> None:
    check_not_pickled(name, f"archive member {raw!r}")
    if not is_model_file(name):
        raise refused(
            f"archive member {raw!r} is not a file of a model directory; the files taken are {allowed_names()}"
        )


def _copy(open_member: Callable[[], IO[bytes]], temp: Path, size: int, raw: str) -> str:
    """Copy a member, never more than it declares (a member that holds more is refused); its SHA-256."""
    copied, digest = 0, hashlib.sha256()
    with open_member() as source, temp.open("wb") as out:
        while chunk := source.read(CHUNK):
            copied += len(chunk)
            if copied > size:
                raise refused(f"archive member {raw!r} holds more than the {size:,} bytes it declares")
            digest.update(chunk)
            out.write(chunk)
    if copied != size:
        raise refused(f"archive member {raw!r} holds {copied:,} bytes, not the {size:,} it declares")
    return digest.hexdigest()


def _place(members: list[Member], staging: Path) -> list[str]:
    """Rename the copied members to their names in the model directory; the names."""
    if not members:
        raise refused("the archive holds no files")
    depths = {len(m.parts) for m in members}
    tops = {m.parts[0] for m in members}
    if depths != {1} and not (depths == {2} and len(tops) == 1):
        nested = next(m for m in members if len(m.parts) > 1)
        raise refused(
            f"archive member {'/'.join(nested.parts)!r} is in a subdirectory: the files go at the archive's root "
            "or in one directory"
        )
    names: list[str] = []
    for m in members:
        name = m.parts[-1]
        if name in names:
            raise refused(f"the archive holds {name!r} twice")
        names.append(name)
        m.temp.replace(staging / name)
    return names


def fsync_file(path: Path) -> None:
    """The file's bytes on disk."""
    with path.open("rb") as f:
        os.fsync(f.fileno())
