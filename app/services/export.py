"""A checkpoint's weights for use without the service: a safetensors file, or a transformers model
directory as a tar archive (``GET …/checkpoints/{step}?format=safetensors | hf``).

The safetensors file holds the model's tensors only, with the model's config as JSON metadata, for
loading without this service (``worker.engine.export`` builds the model from it; docs/engine.md,
"Exported weights"). The hf archive holds what ``transformers`` loads by itself: config.json,
model.safetensors, generation_config.json and the tokenizer's files (app/services/hf_export.py
maps the model).

torch and safetensors are imported when an export is asked for, not when the API starts.
"""

from __future__ import annotations

import json
import os
import shutil
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.services import hf_export
from contract.export import CONFIG_FILE, EXPORT_FILE, EXPORT_KEY, GENERATION_FILE

if TYPE_CHECKING:
    from torch import Tensor

CHUNK_BYTES = 1 << 20


def export_config(payload: dict[str, Any]) -> dict[str, Any]:
    """The model's config from a checkpoint's payload: the engine's model config and the tokenizer.

    The model config is the spec's model section, the vocabulary size and the engine's fixed ratios;
    the tokenizer is ``{"kind": "byte" | "char", "chars"}``, null for the synthetic task's token ids.
    """
    return {**payload["config"]["model"], "tokenizer": payload["tokenizer"]}


def own_tensors(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """The tensors as safetensors takes them: contiguous, and none sharing memory with another.

    A tensor that shares its storage with one before it (an output head tied to the token
    embedding) is a copy of its own, so the file loads into the model as it is (strictly).
    """
    out, seen = {}, set()
    for name, tensor in tensors.items():
        storage = tensor.untyped_storage().data_ptr()
        out[name] = tensor.detach().clone() if storage in seen else tensor.detach().contiguous()
        seen.add(storage)
    return out


def _load(checkpoint: Path) -> dict[str, Any]:
    import torch

    return torch.load(checkpoint, map_location="cpu", weights_only=True, mmap=True)


def to_safetensors(checkpoint: Path, directory: Path) -> Path:
    """Write the weights of ``checkpoint`` to a new safetensors file in ``directory``; returns it."""
    from safetensors.torch import save_file

    payload = _load(checkpoint)
    metadata = {"format": "pt", EXPORT_KEY: json.dumps(export_config(payload), sort_keys=True)}
    directory.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix="export-", suffix=".safetensors", dir=directory)
    os.close(fd)
    try:
        save_file(own_tensors(payload["model"]), name, metadata=metadata)
    except BaseException:
        Path(name).unlink(missing_ok=True)
        raise
    return Path(name)


def write_hf(payload: dict[str, Any], directory: Path) -> list[Path]:
    """Write the transformers model directory of a checkpoint's ``payload`` into ``directory`` (which
    exists); returns its files. ValidationFailed (``format``) for an arch transformers lacks."""
    from safetensors.torch import save_file

    model = payload["config"]["model"]
    tensors = own_tensors(hf_export.hf_tensors(model, payload["model"]))
    dtype = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    save_file(tensors, str(directory / EXPORT_FILE), metadata={"format": "pt"})
    configs = {CONFIG_FILE: hf_export.hf_config(model, dtype), GENERATION_FILE: hf_export.generation_config()}
    for name, config in configs.items():
        (directory / name).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    for name, text in hf_export.tokenizer_files(payload["tokenizer"], model["seq_len"]).items():
        (directory / name).write_text(text, encoding="utf-8")
    return sorted(directory.iterdir())


def to_hf_archive(checkpoint: Path, directory: Path) -> Path:
    """Write the transformers model directory of ``checkpoint`` as a new tar archive in ``directory``;
    returns it. Its members are the directory's files, plain files at the archive's top level."""
    payload = _load(checkpoint)
    hf_export.check_exportable(payload["config"]["model"])  # before anything is written
    directory.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="export-", dir=directory))
    fd, name = tempfile.mkstemp(prefix="export-", suffix=".tar", dir=directory)
    try:
        with os.fdopen(fd, "wb") as out, tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for path in write_hf(payload, work):
                info = tarfile.TarInfo(path.name)
                info.size, info.mode = path.stat().st_size, 0o644
                with path.open("rb") as file:
                    tar.addfile(info, file)
    except BaseException:
        Path(name).unlink(missing_ok=True)
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return Path(name)


def _sent(path: Path) -> tuple[Iterator[bytes], int]:
    """A file's chunks to send, and its size. The file is deleted at once and read through the
    handle still open (POSIX), so nothing is left behind however the response ends."""
    file = path.open("rb")
    path.unlink()

    def chunks() -> Iterator[bytes]:
        with file:
            while chunk := file.read(CHUNK_BYTES):
                yield chunk

    return chunks(), os.fstat(file.fileno()).st_size


def exported(checkpoint: Path, directory: Path) -> tuple[Iterator[bytes], int]:
    """The safetensors export of ``checkpoint`` (written in ``directory``) as chunks, and its size."""
    return _sent(to_safetensors(checkpoint, directory))


def exported_hf(checkpoint: Path, directory: Path) -> tuple[Iterator[bytes], int]:
    """The transformers model directory of ``checkpoint`` as a tar archive (written in ``directory``)
    in chunks, and its size."""
    return _sent(to_hf_archive(checkpoint, directory))
