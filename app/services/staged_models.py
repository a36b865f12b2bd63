"""Operator-staged models: transformers model directories under MUONFORGE_MODEL_DIR, for every tenant.

Each immediate subdirectory of the model directory that holds a ``config.json`` is a model named
``staged:<directory>`` (contract.spec STAGED_PREFIX; no upload's id has a colon). It is checked as an
upload is (app.services.model_archive, app.services.model_weights): no pickled weights, the config a
decoder family of contract.hf without code, the safetensors headers exactly the tensors the config
builds; and no file the service reads may be a link that leaves its directory (nor the directory a
link that leaves MUONFORGE_MODEL_DIR). Of its files only those an upload may hold are read; others
(a README, a LICENSE, subdirectories) are left alone. The service never writes there.

The directories are scanned when a request needs them, and each one's outcome is kept until one of
its entries changes (name, size, modification time, inode): the weights are checked once per state
of a directory, not per request. A directory refused is left out with a warning in the log, once per
state; nothing here raises for what is on disk.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from app.errors import ValidationFailed
from app.services.model_archive import CONFIG, check_not_pickled, is_model_file
from app.services.model_weights import check_config, check_weights
from app.settings import Settings
from contract.spec import STAGED_NAME, STAGED_PREFIX

log = logging.getLogger("muonforge.models")

WHERE = "the directory"  # what holds the files, in the upload's checks' messages
Fingerprint = tuple[Any, ...]


class StagedModelMissing(LookupError):
    """No staged model of that id here: the message says why (no model directory, no such
    directory, or a directory refused)."""


@dataclass(frozen=True)
class StagedModel:
    """A checked model directory under MUONFORGE_MODEL_DIR, with the fields an upload's row has."""

    name: str  # its directory's name
    directory: Path
    config: dict[str, Any]
    files: list[str]  # those the service reads, sorted
    parameters: int
    bytes: int  # of those files
    created_at: datetime  # the newest modification among them
    sha256: None = None  # an upload's is its archive's; a staged model has none

    @property
    def id(self) -> str:
        return STAGED_PREFIX + self.name

    @property
    def model_type(self) -> str:
        return str(self.config["model_type"])


def is_staged(model_id: str) -> bool:
    """Whether ``model_id`` names a staged model (``staged:<directory>``) rather than an upload."""
    return model_id.startswith(STAGED_PREFIX)


def staged_directory(settings: Settings, model_id: str) -> Path | None:
    """Where a staged model's directory is on this host (under its own MUONFORGE_MODEL_DIR),
    whether or not it is there; None where no model directory is set."""
    if settings.model_dir is None:
        return None
    return settings.model_dir / model_id.removeprefix(STAGED_PREFIX)


# -- the scan -------------------------------------------------------------------------------------
_lock = threading.Lock()
_outcomes: dict[Path, tuple[Fingerprint, StagedModel | str]] = {}  # a directory's state and what it gave
_warned: set[tuple[str, str]] = set()


def staged_models(settings: Settings) -> list[StagedModel]:
    """The staged models that passed their checks, by name."""
    return [m for m in _scan(settings).values() if isinstance(m, StagedModel)]


def staged_model(settings: Settings, model_id: str) -> StagedModel:
    """The staged model of that id; StagedModelMissing where there is none here."""
    name = model_id.removeprefix(STAGED_PREFIX)
    root = settings.model_dir
    if root is None:
        raise StagedModelMissing(f"no model {model_id!r}: this service has no staged models (MUONFORGE_MODEL_DIR)")
    directory = root / name
    outcome = _outcome(root, directory) if re.fullmatch(STAGED_NAME, name) and _is_model_dir(directory) else None
    if outcome is None:
        raise StagedModelMissing(f"no model {model_id!r}: no model directory {name!r} is staged")
    if isinstance(outcome, str):  # the reason, with the operators' paths, is for the API's log alone
        raise StagedModelMissing(
            f"no model {model_id!r}: the staged directory {name!r} fails the checks a model passes (the API's log "
            "says why; the service's operators can fix it)"
        )
    return outcome


def _scan(settings: Settings) -> dict[str, StagedModel | str]:
    """Every staged directory's outcome by name, in name order: the model, or why it was refused."""
    root = settings.model_dir
    if root is None:
        return {}
    try:
        with os.scandir(root) as it:
            names = sorted(e.name for e in it if e.is_dir())
    except OSError as exc:
        _warn_once(str(root), f"MUONFORGE_MODEL_DIR {root} cannot be read: {exc}")
        return {}
    found = {name: _outcome(root, root / name) for name in names if _is_model_dir(root / name)}
    with _lock:
        for gone in [d for d in _outcomes if d.parent == root and d.name not in found]:
            del _outcomes[gone]
    return found


def _is_model_dir(directory: Path) -> bool:
    """Whether a directory of MUONFORGE_MODEL_DIR is meant as a model: it holds a config.json."""
    config = directory / CONFIG
    return directory.is_dir() and (config.exists() or config.is_symlink())


def _outcome(root: Path, directory: Path) -> StagedModel | str:
    """The directory's model or why it is refused: checked again only once it changed."""
    fingerprint = _fingerprint(directory)
    with _lock:  # one check of a directory at a time, whatever the threads asking
        known = _outcomes.get(directory)
        if known is not None and known[0] == fingerprint:
            return known[1]
        outcome = _check(root, directory)
        if isinstance(outcome, str):
            log.warning("staged model %s (%s) is left out: %s", STAGED_PREFIX + directory.name, directory, outcome)
        else:
            log.info("staged model %s: %s, %d parameters", outcome.id, outcome.model_type, outcome.parameters)
        _outcomes[directory] = (fingerprint, outcome)
        return outcome


def _fingerprint(directory: Path) -> Fingerprint:
    """What changes when anything the check read changes: each entry's name, size, modification
    time and inode (through links), and where the directory itself leads."""
    state: list[Any] = [str(directory.resolve())]
    try:
        with os.scandir(directory) as it:
            for entry in sorted(it, key=lambda e: e.name):
                try:
                    st = entry.stat()
                    state.append((entry.name, entry.is_symlink(), st.st_size, st.st_mtime_ns, st.st_ino))
                except OSError:
                    state.append((entry.name, entry.is_symlink(), None))
    except OSError as exc:
        state.append(str(exc))
    return tuple(state)


def _check(root: Path, directory: Path) -> StagedModel | str:
    """The directory as a staged model, or why it is refused."""
    name = directory.name
    if not re.fullmatch(STAGED_NAME, name):
        return (
            f"its name {name!r} is not a staged model's: a letter or digit, then letters, digits, '.', '_' or '-' "
            "(100 at most)"
        )
    try:
        resolved = directory.resolve(strict=True)
        if not resolved.is_relative_to(root.resolve()):
            return f"it is a link to {resolved}, outside MUONFORGE_MODEL_DIR: copy the model in"
        files = _model_files(directory, resolved)
        config = check_config(directory / CONFIG, WHERE)
        parameters = check_weights(directory, files, config, WHERE)
        stats = [(directory / f).stat() for f in files]
    except ValidationFailed as exc:
        return exc.message
    except OSError as exc:
        return f"it cannot be read: {exc}"
    return StagedModel(
        name=name,
        directory=directory,
        config=config,
        files=files,
        parameters=parameters,
        bytes=sum(st.st_size for st in stats),
        created_at=datetime.fromtimestamp(max(st.st_mtime for st in stats), UTC),
    )


def _model_files(directory: Path, resolved: Path) -> list[str]:
    """The directory's files the service reads, sorted; refused for a pickled weight file, or one
    of those files that is a link leaving the directory or not a regular file."""
    files: list[str] = []
    for path in sorted(directory.iterdir()):
        name = path.name
        if path.is_dir():
            continue  # never read
        check_not_pickled(name, f"file {name!r}")
        if not is_model_file(name):
            continue
        if path.is_symlink() and not path.resolve().is_relative_to(resolved):
            raise ValidationFailed(f"file {name!r} is a link that leaves the directory (to {path.resolve()})")
        if not path.is_file():
            raise ValidationFailed(f"file {name!r} is not a regular file")
        files.append(name)
    return files


def _warn_once(key: str, message: str) -> None:
    if (key, message) not in _warned:
        _warned.add((key, message))
        log.warning("%s", message)
