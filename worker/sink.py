"""The engine's telemetry sink for a service job, and where its checkpoints go.

The trainer hands each telemetry step over and goes on: a background thread publishes it to
the live bus at once (one Redis pipeline for whatever is pending, typically within a few ms)
and writes the job's metrics to the database every ``telemetry_flush_seconds``, in the same
transaction as the job's progress and summary (latest loss, val_loss, attn_max_logit, ...).
Every write of progress is fenced by the attempt number: an attempt that lost its lease learns
so at its next step. Checkpoints go to the artifact store on a thread of their own while training
goes on; each is recorded once stored (worker.artifacts says where its file is).
"""

from __future__ import annotations

import json
import logging
import queue
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from app.db.session import is_transient, on_commit, retrying, transaction
from app.messaging.live_bus import live_bus
from app.repositories.checkpoints import CheckpointRepository
from app.repositories.jobs import JobRepository
from app.services.job_journal import record_checkpoint, record_log, record_sample
from app.services.metric_history import store_metrics
from app.settings import Settings
from app.storage import Staged, StoreUnavailable, delete_all, store_from
from worker.artifacts import (
    checkpoint_key,
    is_scratch,
    retire_checkpoints,
    run_directory,
    unrecorded_checkpoints,
)
from worker.engine.checkpoints import checkpoint_path, checkpoints_in, load_checkpoint, remove_stale_temp_files
from worker.engine.run import checkpoint_dir
from worker.engine.telemetry import Report

log = logging.getLogger("muonforge.worker")
_FLUSH = object()  # asks the thread to write everything pending now
MAX_FAILURES = 5  # consecutive failed writes for a reason other than an outage before the attempt fails
UPLOADS_PENDING = 2  # checkpoints handed over and not yet stored before the next one waits


@dataclass
class Recording:
    """A checkpoint's recording, carried out on the telemetry thread; ``done`` its outcome."""

    record: Callable[[], None]
    done: Future[None] = field(default_factory=Future)


class LeaseLost(RuntimeError):
    """Another attempt owns the job now."""


class DatabaseUnavailable(ConnectionError):
    """The database stayed out of reach for longer than the outage patience: the attempt hands
    its job back (it resumes from its latest checkpoint), it does not fail it."""


class JobSink:
    """Telemetry of one attempt: to the live bus at once, to the database in batches; the job's
    progress and summary kept current (as the trainer reports them); checkpoints, log lines and
    samples recorded as job events; the parameter routing table kept on the job's row."""

    def __init__(
        self,
        settings: Settings,
        job_id: str,
        attempt: int,
        step: int,
        summary: dict[str, float],
        keep_checkpoints: int = 3,
    ) -> None:
        self.settings, self.job_id, self.attempt, self.keep_checkpoints = settings, job_id, attempt, keep_checkpoints
        self.bus = live_bus(settings)
        # The latest progress and summary reported (a resumed attempt starts from what is known).
        self.step, self.summary = step, dict(summary)
        self._pending: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._buffer: list[tuple[int, dict[str, float]]] = []
        self._mark: str | None = None  # the bus position of the last step published
        self._unpublished: list[tuple[int, str]] | None = []  # steps to publish, oldest first (None: no more)
        self._progress: tuple[int, dict[str, float]] | None = None
        self._next_step = step  # the first telemetry step not yet handed to the bus (where an event goes)
        self._flushed = threading.Event()
        self._error: BaseException | None = None  # ends the attempt
        self._store_error: BaseException | None = None  # the last store failed (an outage): points still buffered
        self._thread = threading.Thread(target=self._run, name=f"telemetry-{job_id}", daemon=True)
        self._thread.start()
        self.store, self.scratch = store_from(settings), is_scratch(settings)
        self.directory = checkpoint_dir(run_directory(settings, job_id))  # this host's checkpoint files
        self._uploader = ThreadPoolExecutor(1, thread_name_prefix=f"checkpoints-{job_id}")
        self._uploads: deque[Future[None]] = deque()

    # -- the engine's TelemetrySink ------------------------------------------------------------
    def metrics(self, report: Report) -> None:
        self._raise_if_failed()
        self.step, self.summary = report.completed, report.summary
        self._pending.put(report)

    def checkpoint(self, step: int, path: Path, nbytes: int, metrics: dict[str, float]) -> None:
        """Hand a checkpoint file over: it goes to the artifact store, and its row to the database,
        in the background while training goes on. At most UPLOADS_PENDING wait their turn; one more
        waits for the oldest to be stored (a store slower than the checkpoints holds training back)."""
        self._raise_if_failed()
        while len(self._uploads) >= UPLOADS_PENDING:
            self._uploads.popleft().result()
        self._uploads.append(self._uploader.submit(self._store_checkpoint, step, path, dict(metrics)))

    def _store_checkpoint(self, step: int, path: Path, metrics: dict[str, float]) -> None:
        """Store the file at its key, then record it in one transaction (fenced): its row, its
        event and the retention policy. The metrics before it are stored
        first, so a resumed attempt that starts from it lacks none. A store out of reach is tried
        again for up to the outage patience (StoreUnavailable after); no database lock is held
        while the store is waited for.

        With a bucket the key names the attempt, so it is written there directly, with no staging
        copy: a stale attempt never replaces the object another attempt's row records, and an
        object no row records is deleted by the next attempt (with the local store the engine's
        file is the object, written in place as it has always been)."""
        patience, what = self.settings.outage_patience_seconds, f"job {self.job_id}: storing checkpoint {step}"
        key = checkpoint_key(self.job_id, step, self.attempt if self.scratch else None)
        staged = retrying(partial(self.store.put_file, path, key), what, patience)

        def record() -> None:  # on the telemetry thread, in order with the steps handed over
            recorded = Recording(partial(self._record_checkpoint, step, staged, key, metrics))
            self._pending.put(recorded)
            while not recorded.done.done():
                if not self._thread.is_alive():
                    raise RuntimeError(f"job {self.job_id}: the telemetry thread stopped before checkpoint {step}")
                wait([recorded.done], timeout=1.0)
            recorded.done.result()

        try:
            self._retrying(record, f"recording checkpoint {step}")
        except LeaseLost:
            if self.scratch:
                self._discard([key], [])  # no row names it: the attempt that holds the job writes its own
            raise

    def _record_checkpoint(self, step: int, staged: Staged, key: str, metrics: dict[str, float]) -> None:
        """The checkpoint's row, its event and the retention policy, in one transaction (fenced),
        on the telemetry thread once every step handed over before is published and stored: its
        event comes after those steps, live and read back from the database alike."""
        self._store()
        with transaction(self.settings) as session:
            if JobRepository(session).held(self.job_id, self.attempt) is None:
                raise LeaseLost(f"job {self.job_id}: attempt {self.attempt} no longer holds the lease")  # fenced
            replaced = CheckpointRepository(session).checkpoint(self.job_id, step)
            if replaced is not None and replaced.path != key:  # an earlier attempt's, of the same step
                on_commit(session, partial(self._discard, [replaced.path], []))
            position = self._next_step
            record_checkpoint(session, self.bus, self.job_id, self.attempt, step, staged, key, metrics, position)
            self._prune(session)

    def wait_for_checkpoints(self) -> None:
        """Wait until every checkpoint handed over is stored (the first failure raised)."""
        while self._uploads:
            self._uploads.popleft().result()

    def _prune(self, session) -> None:
        """The retention policy (worker.artifacts.retire_checkpoints): rows now, the store's
        objects and this host's files once committed."""
        if retired := retire_checkpoints(session, self.job_id, self.keep_checkpoints):
            files = [checkpoint_path(self.directory, s) for s in retired]
            on_commit(session, partial(self._discard, list(retired.values()), files))

    def _discard(self, keys: list[str], files: list[Path]) -> None:
        """Delete pruned checkpoints: the store's objects and this host's files (one and the same
        with the local store). A store out of reach leaves its objects behind, logged."""
        delete_all(self.store, keys)
        for path in files:
            path.unlink(missing_ok=True)

    def adopt_checkpoints(self) -> None:
        """Settle the checkpoint files in this host's run directory that no attempt recorded (an
        attempt that died, or lost its lease, between writing a checkpoint and recording it). A
        file past the latest recorded checkpoint and within the stored progress (every metric
        before it is stored) is stored and recorded, and the attempt resumes from it; any other is
        deleted: one past the progress, so that the attempt resumes from an earlier one and redoes
        those steps, their metrics included; one before the latest recorded, as retention would.
        With a bucket, the objects of earlier attempts that no row records (an attempt that died
        between its commit and its row) are deleted from it too."""

        if removed := remove_stale_temp_files(self.directory):
            log.info("job %s: removed %d temp file(s) of attempts that died mid-write", self.job_id, removed)

        def recorded() -> dict[int, str]:
            with transaction(self.settings) as session:
                return {c.step: c.path for c in CheckpointRepository(session).checkpoints(self.job_id)}

        steps = retrying(recorded, f"job {self.job_id}: its checkpoints", self.settings.outage_patience_seconds)
        if self.scratch:
            orphans = unrecorded_checkpoints(self.settings, self.store, self.job_id, self.attempt, steps)
            if orphans:
                log.info("job %s: deleting %d checkpoint(s) stored but never recorded", self.job_id, len(orphans))
                self._discard(orphans, [])
        latest = max(steps, default=-1)
        for step, path in checkpoints_in(self.directory):
            if step in steps:
                continue
            if step > self.step or step < latest:
                if step > self.step:
                    log.warning(
                        "job %s: checkpoint %d is past the stored metrics (%d): redone", self.job_id, step, self.step
                    )
                path.unlink(missing_ok=True)
                continue
            self._store_checkpoint(step, path, load_checkpoint(path, mmap=True).get("last_metrics", {}))

    def log(self, level: str, message: str) -> None:
        def record() -> None:
            with transaction(self.settings) as session:
                record_log(session, self.bus, self.job_id, level, message, step=self.step)

        self._retrying(record, "recording a log line")

    def sample(self, step: int, prompt: str, text: str) -> None:
        def record() -> None:
            with transaction(self.settings) as session:
                record_sample(session, self.bus, self.job_id, step, prompt, text)

        self._retrying(record, "recording a sample")

    def routing(self, table: Mapping[str, Any]) -> None:
        """The parameter routing table of the attempt's model (worker.engine.optimizer.routing_table),
        stored on the job's row in place of an earlier attempt's (fenced, like progress)."""
        stored = {**table, "attempt": self.attempt}

        def record() -> None:
            with transaction(self.settings) as session:
                if not JobRepository(session).record_routing(self.job_id, self.attempt, stored):
                    raise LeaseLost(f"job {self.job_id}: attempt {self.attempt} no longer holds the lease")

        self._retrying(record, "recording the parameter routing")

    def _retrying(self, fn, what: str) -> None:
        """``fn`` through a database or store outage of up to the outage patience (then
        DatabaseUnavailable, or the store's StoreUnavailable)."""
        try:
            retrying(fn, f"job {self.job_id}: {what}", self.settings.outage_patience_seconds)
        except Exception as exc:
            if is_transient(exc) and not isinstance(exc, StoreUnavailable):
                raise DatabaseUnavailable(f"the database was out of reach while {what}: {exc}") from exc
            raise

    # -- control ---------------------------------------------------------------------------------
    def flush(self) -> None:
        """Publish and store everything handed over so far (waits for the thread); through an
        outage, tries again for up to the outage patience."""
        self._retrying(self._flush_once, "storing metrics")

    def _flush_once(self) -> None:
        self._flushed.clear()
        self._pending.put(_FLUSH)
        while not self._flushed.wait(1.0):
            if not self._thread.is_alive():
                break
        self._raise_if_failed()
        if self._store_error is not None:
            raise self._store_error

    def close(self) -> None:
        """Store the checkpoints handed over, flush, then stop the threads."""
        try:
            self.wait_for_checkpoints()
            self.flush()
        finally:
            self._uploader.shutdown(wait=True, cancel_futures=True)
            self._pending.put(None)
            self._thread.join(timeout=30)

    def _raise_if_failed(self) -> None:
        """The error that ends the attempt, if the telemetry thread or a checkpoint's upload met one."""
        if self._error is not None:
            raise self._error
        while self._uploads and self._uploads[0].done():
            self._uploads.popleft().result()

    # -- the thread --------------------------------------------------------------------------------
    def _run(self) -> None:
        """Publish what arrives; store every flush interval. Through a database outage the
        points stay buffered and the store is tried again with backoff and jitter; an outage
        longer than the patience ends the attempt with DatabaseUnavailable (the job resumes)."""
        flush_every, patience = self.settings.telemetry_flush_seconds, self.settings.outage_patience_seconds
        next_store = time.monotonic() + flush_every
        stop, failures, outage_since, backoff = False, 0, None, flush_every
        while not stop:
            try:
                items = [self._pending.get(timeout=max(0.0, next_store - time.monotonic()))]
            except queue.Empty:
                items = []  # time to store
            while True:
                try:
                    items.append(self._pending.get_nowait())
                except queue.Empty:
                    break
            flush, stop = _FLUSH in items, None in items
            try:
                self._handle(items)
                if flush or stop or time.monotonic() >= next_store:
                    next_store = time.monotonic() + flush_every
                    self._store()
                    self._store_error, failures, outage_since, backoff = None, 0, None, flush_every
            except LeaseLost as exc:
                self._error = exc  # the trainer stops at its next step
            except Exception as exc:
                now = time.monotonic()
                self._store_error = exc
                if is_transient(exc):  # an outage: keep the points, try again later
                    outage_since = outage_since or now
                    down = now - outage_since
                    log.warning("job %s: the database is out of reach (%.0f s): %s", self.job_id, down, exc)
                    backoff = min(2 * backoff, 5.0)
                    next_store = now + random.uniform(0.5, 1.0) * backoff
                    if down > patience or stop:
                        self._error = DatabaseUnavailable(f"the database was out of reach for {down:.0f} s")
                else:
                    failures += 1
                    log.warning("job %s: telemetry write failed (%d in a row): %s", self.job_id, failures, exc)
                    if failures >= MAX_FAILURES or stop:
                        self._error = RuntimeError(f"telemetry could not be written: {exc}")
            if flush:
                self._flushed.set()
        self._flushed.set()

    def _handle(self, items: list[Any]) -> None:
        """Publish the reports among ``items`` and carry out their checkpoint recordings, in order
        (a recording's outcome goes to the thread that waits for it)."""
        reports: list[Report] = []
        for item in items:
            if isinstance(item, Report):
                reports.append(item)
            elif isinstance(item, Recording):
                if reports:
                    self._publish(reports)
                    reports = []
                try:
                    item.record()
                except BaseException as exc:
                    item.done.set_exception(exc)
                else:
                    item.done.set_result(None)
        if reports:
            self._publish(reports)

    def _publish(self, reports: list[Report]) -> None:
        """Into the buffer for the next store, and to the live bus now. If the bus is down or does
        not answer, the events stream reads the database instead: the mark stays at the last step
        published, and the steps not published go out first at the next publish, so that the bus
        never holds a step after the mark without the steps before it (a reader tailing from the
        mark would skip them). Past ``live_stream_maxlen`` held steps the stream could not keep
        them anyway: they are dropped and no metrics are published for the rest of the attempt
        (readers get them from the database)."""
        self._buffer += [(r.step, r.values) for r in reports]
        self._progress = (reports[-1].completed, reports[-1].summary)
        self._next_step = reports[-1].step + 1
        if self._unpublished is None:
            return
        self._unpublished += [(r.step, json.dumps(r.values)) for r in reports]
        try:
            marks = self.bus.publish_metrics(self.job_id, self._unpublished)
        except Exception as exc:
            if len(self._unpublished) == len(reports):  # the first failure since the bus last answered
                log.warning("job %s: live publish failed: %s; holding the steps until it answers", self.job_id, exc)
            if len(self._unpublished) > self.settings.live_stream_maxlen:
                log.warning(
                    "job %s: live bus down for %d steps: no more metrics on it", self.job_id, len(self._unpublished)
                )
                self._unpublished = None
            return
        if (held := len(self._unpublished) - len(reports)) > 0:
            log.info("job %s: live bus back; published %d held steps", self.job_id, held)
        self._unpublished = []
        self._mark = marks[-1]

    def _store(self) -> None:
        """The buffered metrics, progress and summary, in one transaction (progress fenced)."""
        if not self._buffer and self._progress is None:
            return
        with transaction(self.settings) as session:
            store_metrics(session, self.job_id, self._buffer, self._mark)
            if self._progress is not None:
                step, summary = self._progress
                if not JobRepository(session).record_progress(self.job_id, self.attempt, step, summary):
                    raise LeaseLost(f"job {self.job_id}: attempt {self.attempt} no longer holds the lease")
        self._buffer, self._progress = [], None
