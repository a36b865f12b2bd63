"""The engine's telemetry sink for a service job.

The trainer hands each telemetry step over and goes on: a background thread publishes it to
the live bus at once (one Redis pipeline for whatever is pending, typically within a few ms)
and writes the job's metrics to the database every ``telemetry_flush_seconds``, in the same
transaction as the job's progress and summary (latest loss, val_loss, attn_max_logit, ...).
Every write of progress is fenced by the attempt number: an attempt that lost its lease learns
so at its next step.
"""

from __future__ import annotations

import json
import logging
import queue
import random
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from app.db.session import is_transient, on_commit, retrying, transaction
from app.messaging.live_bus import live_bus
from app.repositories.checkpoints import CheckpointRepository
from app.repositories.jobs import JobRepository
from app.services.job_journal import record_checkpoint, record_log, record_sample
from app.services.metric_history import store_metrics
from app.settings import Settings
from contract import metrics
from worker.engine.checkpoints import checkpoints_in, load_checkpoint, remove_stale_temp_files, to_prune
from worker.engine.telemetry import Report

log = logging.getLogger("muonforge.worker")
_FLUSH = object()  # asks the thread to write everything pending now
MAX_FAILURES = 5  # consecutive failed writes for a reason other than an outage before the attempt fails


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
        self._flushed = threading.Event()
        self._error: BaseException | None = None  # ends the attempt
        self._store_error: BaseException | None = None  # the last store failed (an outage): points still buffered
        self._thread = threading.Thread(target=self._run, name=f"telemetry-{job_id}", daemon=True)
        self._thread.start()

    # -- the engine's TelemetrySink ------------------------------------------------------------
    def metrics(self, report: Report) -> None:
        self._raise_if_failed()
        self.step, self.summary = report.completed, report.summary
        self._pending.put(report)

    def checkpoint(self, step: int, path: Path, nbytes: int, metrics: dict[str, float]) -> None:
        self.flush()  # the metrics before it are stored first
        relative = str(path.relative_to(self.settings.artifact_dir))

        def record() -> None:
            with transaction(self.settings) as session:
                if not JobRepository(session).record_progress(self.job_id, self.attempt, self.step, self.summary):
                    raise LeaseLost(f"job {self.job_id}: attempt {self.attempt} no longer holds the lease")  # fenced
                record_checkpoint(session, self.bus, self.job_id, self.attempt, step, relative, nbytes, metrics)
                self._prune(session)

        self._retrying(record, f"recording checkpoint {step}")

    def _prune(self, session) -> None:
        """The retention policy (``train.keep_checkpoints``, and every checkpoint a warm start
        names): rows now, files once committed."""
        repo = CheckpointRepository(session)
        # The job's row, for update, before its warm starts are read: an intake that inserts one
        # holds it shared until that commits, so no checkpoint goes that a new job was admitted on.
        JobRepository(session).locked(self.job_id)
        rows = {c.step: c for c in repo.checkpoints(self.job_id)}
        steps = to_prune([(s, c.metrics.get(metrics.VAL_LOSS)) for s, c in rows.items()], self.keep_checkpoints)
        started_from = repo.warm_start_steps(self.job_id)  # other jobs start (and restart) from these
        steps = [s for s in steps if s not in started_from]
        if not steps:
            return
        repo.delete_checkpoints(self.job_id, steps)
        paths = [self.settings.artifact_dir / rows[s].path for s in steps]

        def unlink() -> None:
            for path in paths:
                path.unlink(missing_ok=True)

        on_commit(session, unlink)

    def adopt_checkpoints(self, directory: Path) -> None:
        """Settle the checkpoint files in ``directory`` that no attempt recorded (an attempt that
        died, or lost its lease, between writing a checkpoint and recording it). A file within the
        stored progress (every metric before it is stored) is recorded, and the attempt resumes
        from it; a file past it is deleted, so that the attempt resumes from an earlier one and
        redoes those steps, their metrics included."""

        if removed := remove_stale_temp_files(directory):
            log.info("job %s: removed %d temp file(s) of attempts that died mid-write", self.job_id, removed)

        def adopt() -> None:
            with transaction(self.settings) as session:
                recorded = {c.step for c in CheckpointRepository(session).checkpoints(self.job_id)}
                for step, path in checkpoints_in(directory):
                    if step in recorded:
                        continue
                    if step > self.step:
                        log.warning(
                            "job %s: checkpoint %d is past the stored metrics (%d): redone",
                            self.job_id,
                            step,
                            self.step,
                        )
                        path.unlink(missing_ok=True)
                        continue
                    nbytes, metrics = path.stat().st_size, load_checkpoint(path, mmap=True).get("last_metrics", {})
                    relative = str(path.relative_to(self.settings.artifact_dir))
                    record_checkpoint(session, self.bus, self.job_id, self.attempt, step, relative, nbytes, metrics)

        self._retrying(adopt, "adopting checkpoints")

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
        """``fn`` through a database outage of up to the outage patience (then DatabaseUnavailable)."""
        try:
            retrying(fn, f"job {self.job_id}: {what}", self.settings.outage_patience_seconds)
        except Exception as exc:
            if is_transient(exc):
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
        """Flush, then stop the thread."""
        try:
            self.flush()
        finally:
            self._pending.put(None)
            self._thread.join(timeout=30)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

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
            reports = [item for item in items if isinstance(item, Report)]
            flush, stop = _FLUSH in items, None in items
            try:
                if reports:
                    self._publish(reports)
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
