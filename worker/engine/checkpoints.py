"""Checkpoints: everything a run needs to continue bitwise-identically on CPU."""

from __future__ import annotations

import os
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

_NAME = re.compile(r"^step_(\d{8})\.pt$")


def checkpoint_path(directory: Path, step: int) -> Path:
    return directory / f"step_{step:08d}.pt"


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(directory: Path, step: int, payload: dict[str, Any]) -> tuple[Path, int]:
    """Write atomically (temp file, fsync, rename): a crash never leaves a torn checkpoint."""
    directory.mkdir(parents=True, exist_ok=True)
    path = checkpoint_path(directory, step)
    tmp = path.with_suffix(".tmp")
    with tmp.open("wb") as f:
        torch.save({**payload, "step": step, "rng": rng_state()}, f)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
    return path, path.stat().st_size


def checkpoints_in(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint in ``directory``, by step."""
    if not directory.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name)))


def latest_checkpoint(directory: Path) -> Path | None:
    found = checkpoints_in(directory)
    return found[-1][1] if found else None


def load_checkpoint(path: Path, mmap: bool = False) -> dict[str, Any]:
    """The payload; ``mmap`` maps the tensors instead of reading them (to look at the rest)."""
    # weights_only=False: the payload holds optimizer state and RNG states, written by this engine.
    return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
