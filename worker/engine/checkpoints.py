"""Checkpoints: everything a run needs to continue bitwise-identically on CPU."""

from __future__ import annotations

import os
import random
import re
import secrets
from pathlib import Path
from typing import Any

import numpy as np
import torch

_NAME = re.compile(r"^step_(\d{8})\.pt$")
TMP_SUFFIX = ".tmp"


def checkpoint_path(directory: Path, step: int) -> Path:
    return directory / f"step_{step:08d}.pt"


def rng_state() -> dict[str, Any]:
    """Every generator's state as tensors and plain values (what ``weights_only`` loading takes)."""
    numpy = np.random.get_state(legacy=False)
    numpy["state"]["key"] = torch.from_numpy(numpy["state"]["key"].astype(np.int64))
    state = {"torch": torch.get_rng_state(), "numpy": numpy, "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    numpy = {**state["numpy"], "state": dict(state["numpy"]["state"])}
    numpy["state"]["key"] = numpy["state"]["key"].numpy().astype(np.uint32)
    np.random.set_state(numpy)
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(directory: Path, step: int, payload: dict[str, Any]) -> tuple[Path, int]:
    """Write a checkpoint atomically and durably.

    A temp file of this process's own (a stale attempt writing the same step cannot collide with
    it), fsync, rename, fsync of the directory. A crash never leaves a torn checkpoint, and a
    checkpoint once recorded survives a power loss.
    """
    directory.mkdir(parents=True, exist_ok=True)
    path = checkpoint_path(directory, step)
    tmp = directory / f"{path.name}.{os.getpid()}-{secrets.token_hex(4)}{TMP_SUFFIX}"
    try:
        with tmp.open("wb") as f:
            torch.save({**payload, "step": step, "rng": rng_state()}, f)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_directory(directory)
    return path, path.stat().st_size


def fsync_directory(directory: Path) -> None:
    """Make a rename in ``directory`` durable (POSIX; a no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_stale_temp_files(directory: Path) -> int:
    """Delete the temp files that attempts which died mid-write left in ``directory``; how many."""
    stale = list(directory.glob(f"*{TMP_SUFFIX}")) if directory.is_dir() else []
    for path in stale:
        path.unlink(missing_ok=True)
    return len(stale)


def to_prune(kept: list[tuple[int, float | None]], keep: int) -> list[int]:
    """The retention rule: of the checkpoints (step, val_loss or None), the steps to delete so that
    the latest ``keep`` remain, plus the one with the lowest val_loss (the earliest on a tie)."""
    by_step = sorted(kept)
    scored = [(loss, step) for step, loss in by_step if loss is not None and loss == loss]  # NaN never best
    best = min(scored)[1] if scored else None
    latest = {step for step, _ in by_step[-keep:]}
    return [step for step, _ in by_step if step not in latest and step != best]


def checkpoints_in(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint in ``directory``, by step."""
    if not directory.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name)))


def latest_checkpoint(directory: Path) -> Path | None:
    found = checkpoints_in(directory)
    return found[-1][1] if found else None


def load_checkpoint(path: Path, mmap: bool = False) -> dict[str, Any]:
    """The payload; ``mmap`` maps the tensors instead of reading them (to look at the rest).

    ``weights_only``: tensors and plain values only, so a file planted on a shared volume cannot
    run code when it is loaded.
    """
    return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
