"""Uploaded models: a transformers model directory, checked, stored, listed, shown and deleted.

An upload is a tar (optionally gzipped) or zip archive of a model directory: ``config.json``,
safetensors weights (``model.safetensors``, or shards named by ``model.safetensors.index.json``)
and optional tokenizer and generation files. It is streamed to disk within
``MUONFORGE_MAX_MODEL_BYTES``, its members are checked one by one as they are read (a safe name, a
regular file, an allowed name, their count and declared sizes within the limits) and copied into
a directory of their own, never by the archive library's own extraction; then the config must name
a decoder family of contract.hf without remote code, and the weights' safetensors headers (read
alone, never the tensors) must hold exactly the tensors, with their shapes, of the model the
config builds (transformers on the meta device: no memory, no weights). Anything refused answers
422 and leaves nothing on disk.

The row and the directory are stored together as a dataset's row and file are
(app.services.datasets): the directory is written as ``<id>.part``, the row inserted under the
tenant's lock (the storage quota, shared with datasets, exact there), then the directory renamed
to ``<id>`` and removed again if the transaction does not commit. ``sweep_orphans`` removes what
a process that died midway left behind.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
import re
import shutil
import stat
import tarfile
import time
import zipfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import IO, Any, BinaryIO

from sqlalchemy.orm import Session

from app.db.base import new_id
from app.db.models import UploadedModel
from app.db.session import on_commit, on_rollback
from app.errors import NotFound, PayloadTooLarge, ValidationFailed
from app.repositories.models import ModelRepository
from app.repositories.tenants import TenantRepository
from app.schemas import api as schemas
from app.services.auth import TenantRef
from app.services.datasets import CHUNK, ORPHAN_AGE_SECONDS, fsync_directory, over_quota
from app.settings import Settings
from contract.hf import FAMILIES, Shape, normalized

log = logging.getLogger("muonforge.models")

MODELS = "models"  # under MUONFORGE_ARTIFACT_DIR: models/<tenant id>/<model id>/
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
JSON_LIMIT = 16 << 20  # bytes of config.json or the index read into memory
HEADER_LIMIT = 100_000_000  # the safetensors format's own bound on a header
# Sizes the config's model names for its training, not its shapes: left out of contract.hf's check.
NOT_SHAPES = ("vocab_size", "dtype", "torch_dtype", "attn_implementation", "_attn_implementation")
SHOWN = 5  # mismatched tensors named in a refusal
LONG_HEADER = 1 << 16  # bytes of a tar's extended (PAX) or long-name header: a model's file names are short


def allowed_names() -> str:
    return ", ".join([*sorted(NAMED), "model-NNNNN-of-NNNNN.safetensors"])


@dataclass(frozen=True)
class Member:
    """A regular file of the archive, once copied: its name in the model directory and its size."""

    parts: tuple[str, ...]  # its path in the archive, "." and empty parts left out
    temp: Path  # where it was copied
    size: int


def upload_model(session: Session, tenant: TenantRef, stream: BinaryIO, name: str, settings: Settings) -> UploadedModel:
    """Store an uploaded archive as a model of the tenant: written, checked, extracted, recorded.

    413 above ``MUONFORGE_MAX_MODEL_BYTES`` (``payload_too_large``) or above what the tenant's
    storage quota leaves (``storage_quota_exceeded``, counted on the extracted files); 422 for an
    archive, a config or weights refused (the message says which member and why, ``param`` is
    ``file``).
    """
    tenants = TenantRepository(session)
    quota = settings.tenant_storage_bytes
    used = tenants.stored_bytes(tenant.id)
    session.commit()  # no connection is held while the archive is read
    model_id = new_id("mdl")
    parent = settings.artifact_dir / MODELS / tenant.id
    archive, staging, target = parent / f"{model_id}.upload", parent / f"{model_id}.part", parent / model_id
    unpacked = parent / f"{model_id}.tar"  # a gzipped tar, decompressed (within its bound) before it is read
    parent.mkdir(parents=True, exist_ok=True)
    try:
        size, sha256 = write_archive(stream, archive, settings.max_model_bytes)
        if size == 0:
            raise ValidationFailed("the file is empty", param="file")
        staging.mkdir()
        readable = gunzipped(archive, unpacked, settings)
        files = extract(readable, staging, settings, room=max(quota - used, 0), quota=quota, used=used)
        archive.unlink()
        unpacked.unlink(missing_ok=True)
        config = check_config(staging / CONFIG)
        parameters = check_weights(staging, files, config)
        stored = sum((staging / f).stat().st_size for f in files)
        for f in files:
            _fsync(staging / f)
        fsync_directory(staging)
        tenants.lock([tenant.id])  # exact under concurrent uploads (datasets' too): held until the commit
        used = tenants.stored_bytes(tenant.id)
        if used + stored > quota:
            raise over_quota(quota, used)
        model = ModelRepository(session).add(
            UploadedModel(
                id=model_id,
                tenant_id=tenant.id,
                name=name[:200],
                model_type=config["model_type"],
                parameters=parameters,
                bytes=stored,
                sha256=sha256,
                config=config,
                files=sorted(files),
                path=str(Path(MODELS) / tenant.id / model_id),
            )
        )
        on_rollback(session, partial(shutil.rmtree, target, ignore_errors=True))
        os.utime(staging)  # its age counts from here: the sweep leaves it alone while this commits
        staging.replace(target)
        fsync_directory(parent)
    except BaseException:
        archive.unlink(missing_ok=True)
        unpacked.unlink(missing_ok=True)
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return model


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


def extract(archive: Path, staging: Path, settings: Settings, room: int, quota: int, used: int) -> list[str]:
    """Copy the archive's regular files into ``staging``; their names there.

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
            _copy(open_member, temp, size, raw)
            members.append(Member(parts, temp, size))
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, zlib.error, gzip.BadGzipFile) as exc:
        raise refused(f"the archive is damaged or truncated ({exc})") from None
    return _place(members, staging)


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


def _check_name(raw: str, name: str) -> None:
    if name.lower().endswith(PICKLED):
        raise refused(
            f"archive member {raw!r} is a pickled weight file: safetensors only (model.safetensors, or "
            "model-NNNNN-of-NNNNN.safetensors with model.safetensors.index.json)"
        )
    if name not in NAMED and not SHARD.fullmatch(name):
        raise refused(
            f"archive member {raw!r} is not a file of a model directory; the files taken are {allowed_names()}"
        )


def _copy(open_member: Callable[[], IO[bytes]], temp: Path, size: int, raw: str) -> None:
    """Copy a member, never more than it declares (a member that holds more is refused)."""
    copied = 0
    with open_member() as source, temp.open("wb") as out:
        while chunk := source.read(CHUNK):
            copied += len(chunk)
            if copied > size:
                raise refused(f"archive member {raw!r} holds more than the {size:,} bytes it declares")
            out.write(chunk)
    if copied != size:
        raise refused(f"archive member {raw!r} holds {copied:,} bytes, not the {size:,} it declares")


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


def _fsync(path: Path) -> None:
    with path.open("rb") as f:
        os.fsync(f.fileno())


# -- the config -----------------------------------------------------------------------------------
def _read_json(path: Path, what: str) -> Any:
    if path.stat().st_size > JSON_LIMIT:
        raise refused(f"{what} is larger than {JSON_LIMIT:,} bytes")
    try:
        return json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError) as exc:
        raise refused(f"{what} is not JSON ({exc})") from None


def check_config(path: Path) -> dict[str, Any]:
    """config.json, checked: a decoder family of contract.hf, no code to load, valid sizes."""
    if not path.is_file():
        raise refused(f"the archive has no {CONFIG}")
    config = _read_json(path, CONFIG)
    if not isinstance(config, dict):
        raise refused(f"{CONFIG} is not a JSON object")
    for key in ("auto_map", "trust_remote_code"):
        if key in config:
            raise refused(f"{CONFIG} sets {key}: no code is loaded from an uploaded model")
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise refused(
            f"{CONFIG}'s model_type {model_type!r} is not a decoder family this service trains: "
            f"one of {', '.join(sorted(FAMILIES))}"
        )
    if "quantization_config" in config:
        raise refused(f"{CONFIG} sets quantization_config: quantized models are not taken")
    vocab = config.get("vocab_size")
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1:
        raise refused(f"{CONFIG}'s vocab_size must be a whole number >= 1 (got {vocab!r})")
    try:
        normalized({k: v for k, v in config.items() if k not in NOT_SHAPES})
    except ValueError as exc:
        raise refused(f"{CONFIG}: {exc}") from None
    return config


# -- the weights ----------------------------------------------------------------------------------
Tensors = dict[str, tuple[int, ...]]


def check_weights(directory: Path, files: list[str], config: dict[str, Any]) -> int:
    """The weights' tensors against those the config builds; the model's parameter count."""
    found = weight_tensors(directory, files)
    layers = Shape.of(normalized({k: v for k, v in config.items() if k not in NOT_SHAPES})).layers
    if layers > len(found):  # every layer has tensors of its own: the build below is bounded by the file
        raise refused(f"the weights hold {len(found):,} tensors, fewer than the config's {layers:,} layers")
    expected, tied, parameters = expected_tensors(config)
    tied_names = {name for group in tied for name in group}
    missing = [n for n in expected if n not in found and n not in tied_names]
    missing += [sorted(group)[0] for group in tied if not group & found.keys()]
    unexpected = [n for n in found if n not in expected]
    mismatched = [
        f"{n} is {list(found[n])} in the weights, {list(shape)} by the config"
        for n, shape in expected.items()
        if n in found and found[n] != shape
    ]
    problems = []
    if mismatched:
        problems.append(
            "; ".join(mismatched[:SHOWN]) + (f" (and {len(mismatched) - SHOWN} more)" * (len(mismatched) > SHOWN))
        )
    for label, names in (("missing", missing), ("not in the model", unexpected)):
        if names:
            problems.append(
                f"{label}: "
                + ", ".join(sorted(names)[:SHOWN])
                + (f" (and {len(names) - SHOWN} more)" * (len(names) > SHOWN))
            )
    if problems:
        raise refused(f"the weights do not match {CONFIG}: " + "; ".join(problems))
    return parameters


def weight_tensors(directory: Path, files: list[str]) -> Tensors:
    """Every tensor's name and shape, from the safetensors headers (one file, or the index's shards)."""
    shards = sorted(f for f in files if SHARD.fullmatch(f))
    if WEIGHTS in files:
        if shards or INDEX in files:
            raise refused(f"the archive has both {WEIGHTS} and sharded weights: one or the other")
        return read_header(directory / WEIGHTS, WEIGHTS)
    if not shards:
        if INDEX in files:
            raise refused(f"{INDEX} names shards that the archive lacks")
        raise refused(f"the archive has no weights: {WEIGHTS}, or model-NNNNN-of-NNNNN.safetensors shards")
    if INDEX not in files:
        raise refused(f"sharded weights need {INDEX}")
    totals = {int(SHARD.fullmatch(s)[2]) for s in shards}  # type: ignore[index]
    numbers = sorted(int(SHARD.fullmatch(s)[1]) for s in shards)  # type: ignore[index]
    if len(totals) != 1 or numbers != list(range(1, totals.pop() + 1)):
        raise refused(f"the shards {', '.join(shards)} are not a complete set")
    index = _read_json(directory / INDEX, INDEX)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise refused(f"{INDEX} has no weight_map of tensor names to shard files")
    if set(weight_map.values()) != set(shards):
        raise refused(
            f"{INDEX} names the shards {', '.join(sorted(set(weight_map.values())))}, "
            f"the archive holds {', '.join(shards)}"
        )
    found: Tensors = {}
    for shard in shards:
        for name, shape in read_header(directory / shard, shard).items():
            if name in found:
                raise refused(f"tensor {name} is in two shards")
            if weight_map.get(name) != shard:
                raise refused(f"tensor {name} is in {shard}, {INDEX} says {weight_map.get(name)!r}")
            found[name] = shape
    if absent := sorted(set(weight_map) - found.keys()):
        raise refused(f"{INDEX} names tensors that no shard holds: {', '.join(absent[:SHOWN])}")
    return found


def read_header(path: Path, what: str) -> Tensors:
    """A safetensors file's tensors (name and shape) from its header alone: 8 bytes of header
    length (little-endian), then the JSON header; each tensor's bytes must lie in the file."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if length < 2 or length > HEADER_LIMIT or 8 + length > size:
            raise refused(f"{what} is not a safetensors file (no valid header)")
        raw = f.read(length)
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise refused(f"{what} is not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise refused(f"{what} is not a safetensors file (its header is not an object)")
    data = size - 8 - length
    tensors: Tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        shape = entry.get("shape") if isinstance(entry, dict) else None
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if (
            not isinstance(shape, list)
            or not all(isinstance(n, int) and n >= 0 for n in shape)
            or not isinstance(entry.get("dtype"), str)
            or not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(n, int) for n in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= data
        ):
            raise refused(f"{what}: tensor {name!r} has an invalid header entry")
        tensors[name] = tuple(shape)
    return tensors


def expected_tensors(config: dict[str, Any]) -> tuple[Tensors, list[set[str]], int]:
    """The tensors (names and shapes) of the model the config builds, the groups of names that
    share one tensor (a tied lm_head: the weights may hold any one of them), and its parameters.

    transformers builds the model on the meta device: no memory is allocated and nothing is
    initialized. torch and transformers are imported here, when a model is uploaded.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in config.items() if k != "model_type"}
    try:
        hf_config = AutoConfig.for_model(config["model_type"], **fields)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config)
    except Exception as exc:  # transformers' own checks of the config, whatever they raise
        raise refused(f"{CONFIG} does not build a {config['model_type']} model: {exc}") from None
    names: dict[int, list[str]] = {}
    expected: Tensors = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        names.setdefault(id(tensor), []).append(name)
        expected[name] = tuple(tensor.shape)
    tied = [set(group) for group in names.values() if len(group) > 1]
    return expected, tied, sum(p.numel() for p in model.parameters())


# -- reads and deletes ----------------------------------------------------------------------------
def get_model(session: Session, tenant: TenantRef, model_id: str) -> UploadedModel:
    model = ModelRepository(session).get(model_id, tenant.id)
    if model is None:
        raise NotFound(f"no model {model_id!r}", param="model_id")
    return model


def view(model: UploadedModel) -> schemas.Model:
    """The Model a list shows."""
    return schemas.Model(**_fields(model))


def detail(model: UploadedModel) -> schemas.ModelDetail:
    """The Model with its sizes and config.json."""
    s = Shape.of(normalized({k: v for k, v in model.config.items() if k not in NOT_SHAPES}))
    sizes = schemas.ModelSizes(
        layers=s.layers,
        heads=s.heads,
        kv_heads=s.kv_heads,
        head_dim=s.head_dim,
        width=s.width,
        ffn=s.ffn,
        positions=s.positions,
        vocab=model.config["vocab_size"],
        tied_embeddings=s.tied,
    )
    return schemas.ModelDetail(**_fields(model), sizes=sizes, config=model.config)


def _fields(model: UploadedModel) -> dict[str, Any]:
    return {
        "id": model.id,
        "name": model.name,
        "model_type": model.model_type,
        "parameters": model.parameters,
        "bytes": model.bytes,
        "sha256": model.sha256,
        "files": list(model.files),
        "tokenizer_files": [f for f in model.files if f in TOKENIZER_FILES],
        "created_at": model.created_at,
    }


def show_model(session: Session, tenant: TenantRef, model_id: str) -> schemas.ModelDetail:
    return detail(get_model(session, tenant, model_id))


def list_models(session: Session, tenant: TenantRef, limit: int, after: str | None) -> schemas.ModelList:
    rows = ModelRepository(session).page(tenant.id, limit, after)
    page = rows[:limit]
    return schemas.ModelList(
        data=[view(m) for m in page],
        has_more=len(rows) > limit,
        next_after=page[-1].id if len(rows) > limit else None,
    )


def delete_model(session: Session, tenant: TenantRef, model_id: str, settings: Settings) -> None:
    """Delete the model's row, then (once committed) its directory."""
    model = get_model(session, tenant, model_id)
    ModelRepository(session).delete(model)
    on_commit(session, partial(shutil.rmtree, settings.artifact_dir / model.path, ignore_errors=True))


def sweep_orphans(session: Session, settings: Settings, now: float | None = None) -> int:
    """Remove what no row names under the models directory, once older than ORPHAN_AGE_SECONDS;
    returns how many entries went: archives and directories of uploads cut off (``.upload``,
    ``.tar``, ``.part``), and directories whose row was never committed or whose delete committed before
    its directory went."""
    root = settings.artifact_dir / MODELS
    if not root.is_dir():
        return 0
    cutoff = (time.time() if now is None else now) - ORPHAN_AGE_SECONDS
    repo, removed = ModelRepository(session), 0
    for directory in (d for d in root.iterdir() if d.is_dir()):
        old = [e for e in directory.iterdir() if _mtime(e) < cutoff]
        known = repo.existing_ids({e.name for e in old if "." not in e.name})
        for entry in old:
            if entry.name in known:
                continue
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            removed += 1
    if removed:
        log.info("removed %d model upload(s) that no model names", removed)
    return removed


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:  # removed meanwhile (another process's sweep)
        return float("inf")
