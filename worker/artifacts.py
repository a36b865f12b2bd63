"""A run's artifacts on this host: the store objects it reads, and where its checkpoints go.

The engine reads and writes plain files; this module puts the artifact store behind them. A run's
directory (``run_directory``: MUONFORGE_ARTIFACT_DIR/jobs/<id>) holds what the engine writes: its
checkpoints, metrics.jsonl, samples.jsonl and summary.json. With the local store that directory is
the store's own, so a checkpoint is stored where the engine wrote it. With a bucket it is this
host's scratch: checkpoints go up to the bucket in the background (worker.sink), and the latest
one comes down again when an attempt resumes on a host that lacks it (``restore_checkpoint``).

What a run reads comes through the host's cache (app.storage.ArtifactCache), pinned for as long
as the run holds it: its dataset (``dataset_file``), a warm start's checkpoint
(``warm_start_file``) and an uploaded model's files (``model_directory``). A store out of reach
is tried again for up to the outage patience, then its StoreUnavailable (a ConnectionError)
reaches the attempt, which hands the job back.
"""

from __future__ import annotations

import logging
import secrets
import shutil
import socket
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from functools import partial
from pathlib import Path

from sqlalchemy.orm import Session

from app.db.session import retrying, transaction
from app.repositories.checkpoints import CheckpointRepository
from app.repositories.jobs import JobRepository
from app.services import leases, lifecycle
from app.services.staged_models import is_staged, staged_directory
from app.settings import Settings
from app.storage import ArtifactCache, ArtifactStore, IntegrityError, LocalStore, ObjectNotFound, cache_from, store_from
from app.storage.base import file_sha256
from contract import metrics
from contract.documents import file_format
from contract.spec import JobSpec
from worker.engine.checkpoints import checkpoint_path, to_prune
from worker.engine.run import checkpoint_dir

log = logging.getLogger("muonforge.worker")
JOBS = "jobs"
DATASET_MISSING = "the file of dataset {dataset_id} is missing from the service's storage; upload the corpus again"
DATASET_CHANGED = (
    "the file of dataset {dataset_id} in the service's storage is not the one uploaded (its size or sha256 "
    "changed since); upload the corpus again"
)
INIT_MISSING = (
    "the checkpoint this job starts from (init_from: job {job_id}, step {step}) is missing from the service's "
    "storage; submit the job again from another checkpoint"
)
MODEL_MISSING = (
    "the uploaded model {model_id} this job starts from is missing from the service's storage (deleted since "
    "the job was submitted?); upload it again and submit the job with its new id"
)
MODEL_CHANGED = (
    "the files of the uploaded model {model_id} in the service's storage are not the ones uploaded (a size or "
    "sha256 changed since); upload it again and submit the job with its new id"
)
STAGED_MISSING = (
    "the staged model {model_id} this job starts from is not on the worker that took the job ({where}); the "
    "operators stage the same model directory under MUONFORGE_MODEL_DIR on every worker host"
)
INIT_CHANGED = (
    "the checkpoint this job starts from (init_from: job {job_id}, step {step}) in the service's storage is not "
    "the one recorded (its size or sha256 changed since); submit the job again from another checkpoint"
)


class InputUnusable(Exception):
    """A file the run reads cannot be read as its row records it: the job fails with :attr:`error`."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.error = {"code": code, "message": message}


def run_directory(settings: Settings, job_id: str) -> Path:
    """Where this host's runs of the job write (the engine's ``out_dir``)."""
    return settings.artifact_dir / JOBS / job_id


def checkpoint_key(job_id: str, step: int, attempt: int | None = None) -> str:
    """The store key of the job's checkpoint after ``step`` steps: the path of the file the engine
    writes, relative to the artifact dir (the local store's own), or with a bucket, that of the
    ``attempt`` which stored it."""
    path = checkpoint_path(checkpoint_dir(Path(JOBS, job_id)), step)
    return (path if attempt is None else path.with_suffix(f".{attempt}{path.suffix}")).as_posix()


def attempt_of(key: str) -> int:
    """The attempt that stored a checkpoint object (``step_00000100.2.pt``: 2); 0 for another name."""
    parts = key.rsplit("/", 1)[-1].split(".")
    return int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else 0


def is_scratch(settings: Settings) -> bool:
    """Whether run directories are this host's scratch (a bucket holds what is kept), rather than
    the local store's own directory."""
    return not isinstance(store_from(settings), LocalStore)


def retire_checkpoints(session: Session, job_id: str, keep: int) -> dict[int, str]:
    """The retention policy of a job's checkpoints (``train.keep_checkpoints``, and never one a
    warm start names): deletes the rows of those it retires, in the caller's transaction, and
    returns their keys by step (their objects and files go once it commits)."""
    repo = CheckpointRepository(session)
    # The job's row, for update, before its warm starts are read: an intake that inserts one
    # holds it shared until that commits, so no checkpoint goes that a new job was admitted on.
    JobRepository(session).locked(job_id)
    rows = {c.step: c for c in repo.checkpoints(job_id)}
    steps = to_prune([(s, c.metrics.get(metrics.VAL_LOSS)) for s, c in rows.items()], keep)
    started_from = repo.warm_start_steps(job_id)  # other jobs start (and restart) from these
    steps = [s for s in steps if s not in started_from]
    if steps:
        repo.delete_checkpoints(job_id, steps)
    return {s: rows[s].path for s in steps}


def unrecorded_checkpoints(
    settings: Settings, store: ArtifactStore, job_id: str, attempt: int, recorded: dict[int, str]
) -> list[str]:
    """The bucket's checkpoints of this job that attempts before ``attempt`` stored and no row
    records (``recorded``: the rows' keys by step): an attempt that died between its upload and
    its row. The attempt that holds the job deletes them."""
    prefix = checkpoint_key(job_id, 0).rsplit("/", 1)[0]
    listed = retrying(
        lambda: [o.key for o in store.list(prefix)],
        f"job {job_id}: listing its stored checkpoints",
        settings.outage_patience_seconds,
    )
    keys = set(recorded.values())
    return [key for key in listed if key not in keys and attempt_of(key) < attempt]


def read_as_stored(spec: JobSpec, dataset: leases.DatasetObject | None) -> JobSpec:
    """``spec`` with ``data.format: auto`` resolved to its dataset's format (its key's suffix): a
    cache entry is named by its sha256 alone, so the engine could not read the format from it."""
    if dataset is None or spec.data.format != "auto":
        return spec
    return spec.model_copy(update={"data": spec.data.model_copy(update={"format": file_format(dataset.key)})})


@contextmanager
def stored_file(
    settings: Settings, key: str, size: int, sha256: str | None, missing: InputUnusable, changed: InputUnusable
) -> Iterator[Path]:
    """The object's file on this host for as long as the context is open, through the cache: with
    the local store, the store's own file; with a bucket, the cache's entry, downloaded and
    verified on a miss, and never evicted while open. A missing object raises ``missing``, one
    whose size or sha256 is not the row's ``changed``."""
    cache = cache_from(settings, store_from(settings))
    with ExitStack() as held:
        opened = partial(_open_cached, held, cache, key, size, sha256, missing, changed)
        yield retrying(opened, f"{key}: reading it from the artifact store", settings.outage_patience_seconds)


def _open_cached(
    held: ExitStack,
    cache: ArtifactCache,
    key: str,
    size: int,
    sha256: str | None,
    missing: InputUnusable,
    changed: InputUnusable,
) -> Path:
    """The object's cache entry, held open by ``held``; the store's errors as the job sees them."""
    try:
        return held.enter_context(cache.open(key, size, sha256))
    except ObjectNotFound:
        raise missing from None
    except IntegrityError as exc:
        log.error("%s", exc)
        raise changed from None


@contextmanager
def dataset_file(settings: Settings, dataset: leases.DatasetObject | None) -> Iterator[Path | None]:
    """The job's dataset on this host while the context is open (None without one); fails the job
    with ``dataset_missing`` or ``dataset_changed``."""
    if dataset is None:
        yield None
        return
    missing = InputUnusable("dataset_missing", DATASET_MISSING.format(dataset_id=dataset.id))
    changed = InputUnusable("dataset_changed", DATASET_CHANGED.format(dataset_id=dataset.id))
    with stored_file(settings, dataset.key, dataset.bytes, dataset.sha256, missing, changed) as path:
        yield path


@contextmanager
def warm_start_file(settings: Settings, spec: JobSpec) -> Iterator[Path | None]:
    """The checkpoint a warm-started job loads (its parent's at the step resolved at intake) while
    the context is open, or None without ``init_from``; fails the job with
    ``init_checkpoint_missing`` or ``init_checkpoint_changed``."""
    init = spec.init_from
    if init is None or init.step is None:
        yield None
        return
    job_id, step = init.job_id, init.step
    facts = {"job_id": job_id, "step": step}
    missing = InputUnusable("init_checkpoint_missing", INIT_MISSING.format(**facts))
    changed = InputUnusable("init_checkpoint_changed", INIT_CHANGED.format(**facts))

    def row() -> tuple[str, int, str | None] | None:
        with transaction(settings) as session:
            found = CheckpointRepository(session).checkpoint(job_id, step)
            return (found.path, found.bytes, found.sha256) if found is not None else None

    stored = retrying(row, f"job {job_id}: its checkpoint {step}", settings.outage_patience_seconds)
    if stored is None:
        raise missing
    with stored_file(settings, *stored, missing, changed) as path:
        yield path


@contextmanager
def token_entries(settings: Settings) -> Iterator[Callable[[str], Path]]:
    """The token cache of this host's runs: an entry's directory in the bounded cache by its name,
    every entry handed out kept (never evicted) until the context ends."""
    cache = cache_from(settings, store_from(settings))
    with ExitStack() as held:
        yield lambda name: held.enter_context(cache.derived(name))


@contextmanager
def model_directory(
    settings: Settings, job_id: str, model_id: str | None, model: lifecycle.ModelObjects | None
) -> Iterator[Path | None]:
    """The directory of the model the job starts from on this host, while the context is open (None
    without a model): a staged model's under this worker's MUONFORGE_MODEL_DIR; an upload's, the
    local store's own directory, or with a bucket a directory of links to its files in the host's
    cache (each downloaded and verified on a miss, and held while open). A model not here fails the
    job with ``model_missing``, an upload's file changed in the store with ``model_changed``."""
    if model_id is None:
        yield None
        return
    missing = InputUnusable("model_missing", model_missing(settings, model_id))
    if is_staged(model_id):
        directory = staged_directory(settings, model_id)
        if directory is None or not (directory / "config.json").is_file():
            raise missing
        yield directory
        return
    if model is None:
        raise missing
    if not is_scratch(settings):
        directory = settings.artifact_dir / model.path
        if not directory.is_dir():
            raise missing
        yield directory
        return
    if not model.files:
        raise missing  # recorded before its files' digests were kept: no copy can be verified
    changed = InputUnusable("model_changed", MODEL_CHANGED.format(model_id=model_id))
    links = run_directory(settings, job_id) / f"model-{secrets.token_hex(4)}"
    links.mkdir(parents=True)
    try:
        with ExitStack() as held:
            for name, (size, sha256) in model.files.items():
                path = held.enter_context(stored_file(settings, f"{model.path}/{name}", size, sha256, missing, changed))
                (links / name).symlink_to(path)
            yield links
    finally:
        shutil.rmtree(links, ignore_errors=True)


def model_missing(settings: Settings, model_id: str) -> str:
    """Why the job's model is not here (``model_missing``), and what to do; a staged model's host
    and path go to this worker's log alone."""
    if not is_staged(model_id):
        return MODEL_MISSING.format(model_id=model_id)
    directory = staged_directory(settings, model_id)
    if directory is None:
        where = "its MUONFORGE_MODEL_DIR is not set"
    else:
        where = f"its MUONFORGE_MODEL_DIR has no {directory.name} directory with a config.json"
    if directory is None or not (directory / "config.json").is_file():
        log.warning("staged model %s is not on %s: %s (%s)", model_id, socket.gethostname(), where, directory)
    return STAGED_MISSING.format(model_id=model_id, where=where)


def restore_checkpoint(settings: Settings, job_id: str) -> int | None:
    """Put the job's latest stored checkpoint in this host's run directory, where the engine resumes
    from the latest one; its step, or None when there is none to put (or the run directory is the
    local store's own). A local file of that step is kept when it has the row's sha256; an object
    missing from the store or changed there is passed over for the one before it."""
    if not is_scratch(settings):
        return None
    store, patience = store_from(settings), settings.outage_patience_seconds

    def rows() -> list[tuple[int, str, int, str | None]]:
        with transaction(settings) as session:
            return [(c.step, c.path, c.bytes, c.sha256) for c in CheckpointRepository(session).checkpoints(job_id)]

    directory = checkpoint_dir(run_directory(settings, job_id))
    for step, key, size, sha256 in retrying(rows, f"job {job_id}: its checkpoints", patience):
        if sha256 is None:
            continue  # recorded before digests were kept: no copy can be verified
        path = checkpoint_path(directory, step)
        if path.is_file() and path.stat().st_size == size and file_sha256(path) == sha256:
            return step
        try:
            retrying(
                partial(store.fetch, key, path, size, sha256), f"job {job_id}: fetching checkpoint {step}", patience
            )
        except (ObjectNotFound, IntegrityError) as exc:
            log.warning("job %s: checkpoint %d cannot be restored from the store: %s", job_id, step, exc)
            continue
        log.info("job %s: checkpoint %d restored from the store (%d bytes)", job_id, step, size)
        return step
    return None


def discard_scratch(settings: Settings, job_id: str) -> None:
    """Remove this host's copies of the job's checkpoints once its attempt has ended, when the
    store holds them elsewhere (a bucket); with the local store they are the stored ones."""
    if is_scratch(settings):
        shutil.rmtree(checkpoint_dir(run_directory(settings, job_id)), ignore_errors=True)
