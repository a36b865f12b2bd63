"""A checkpoint's weights as a safetensors file (``GET …/checkpoints/{step}?format=safetensors``).

The file holds the model's tensors only, with the model's config as JSON metadata, for loading
without this service (``worker.engine.export`` builds the model from it; docs/engine.md,
"Exported weights").

torch and safetensors are imported when an export is asked for, not when the API starts.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from contract.export import EXPORT_KEY

CHUNK_BYTES = 1 << 20


def export_config(payload: dict[str, Any]) -> dict[str, Any]:
    """The model's config from a checkpoint's payload: the engine's model config and the tokenizer.

    The model config is the spec's model section, the vocabulary size and the engine's fixed ratios;
    the tokenizer is ``{"kind": "byte" | "char", "chars"}``, null for the synthetic task's token ids.
    """
    return {**payload["config"]["model"], "tokenizer": payload["tokenizer"]}


def to_safetensors(checkpoint: Path, directory: Path) -> Path:
    """Write the weights of ``checkpoint`` to a new safetensors file in ``directory``; returns it.

    safetensors takes neither views nor tensors that share memory: each tensor is made contiguous,
    and one that shares its storage with another (the output head tied to the token embedding) is
    written as a copy of its own, so the file loads into the model as it is (strictly).
    """
    import torch
    from safetensors.torch import save_file

    payload = torch.load(checkpoint, map_location="cpu", weights_only=True, mmap=True)
    tensors, seen = {}, set()
    for name, tensor in payload["model"].items():
        storage = tensor.untyped_storage().data_ptr()
        tensors[name] = tensor.detach().clone() if storage in seen else tensor.detach().contiguous()
        seen.add(storage)
    metadata = {"format": "pt", EXPORT_KEY: json.dumps(export_config(payload), sort_keys=True)}
    directory.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix="export-", suffix=".safetensors", dir=directory)
    os.close(fd)
    try:
        save_file(tensors, name, metadata=metadata)
    except BaseException:
        Path(name).unlink(missing_ok=True)
        raise
    return Path(name)


def exported(checkpoint: Path, directory: Path) -> tuple[Iterator[bytes], int]:
    """The safetensors export of ``checkpoint`` as chunks to send, and its size.

    The file, written in ``directory``, is deleted at once and read through the handle still open
    (POSIX), so nothing is left behind however the response ends.
    """
    path = to_safetensors(checkpoint, directory)
    file = path.open("rb")
    path.unlink()

    def chunks() -> Iterator[bytes]:
        with file:
            while chunk := file.read(CHUNK_BYTES):
                yield chunk

    return chunks(), os.fstat(file.fileno()).st_size
