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
import threading
import time
from pathlib import Path
from typing import Any

from app.db.session import transaction
from app.live import live_bus
from app.repositories.jobs import JobRepository
from app.services.job_events import record_checkpoint, record_log, record_sample
from app.services.telemetry import store_metrics
from app.settings import Settings
from worker.engine.checkpoints import checkpoints_in, load_checkpoint
from worker.engine.telemetry import Report

log = logging.getLogger("muonforge.worker")
_FLUSH = object()  # asks the thread to write everything pending now
MAX_FAILURES = 5  # consecutive failed writes (one per flush interval) before the attempt fails


class LeaseLost(RuntimeError):
    """Another attempt owns the job now."""


class JobSink:
    """Telemetry of one attempt: to the live bus at once, to the database in batches; the job's
    progress and summary kept current (as the trainer reports them); checkpoints, log lines and
    samples recorded as job events."""

    def __init__(self, settings: Settings, job_id: str, attempt: int, step: int, summary: dict[str, float]) -> None:
        self.settings, self.job_id, self.attempt = settings, job_id, attempt
        self.bus = live_bus(settings)
        # The latest progress and summary reported (a resumed attempt starts from what is known).
        self.step, self.summary = step, dict(summary)
        self._pending: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._buffer: list[tuple[int, dict[str, float]]] = []
        self._mark: str | None = None
        self._progress: tuple[int, dict[str, float]] | None = None
        self._flushed = threading.Event()
        self._error: BaseException | None = None
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
        with transaction(self.settings) as session:
            if not JobRepository(session).record_progress(self.job_id, self.attempt, self.step, self.summary):
                raise LeaseLost(f"job {self.job_id}: attempt {self.attempt} no longer holds the lease")  # fenced
            record_checkpoint(session, self.bus, self.job_id, self.attempt, step, relative, nbytes, metrics)

    def adopt_checkpoints(self, directory: Path) -> None:
        """Record the checkpoint files in ``directory`` that no attempt recorded (an attempt
        that died between writing a checkpoint and recording it): a resumed attempt starts from
        the latest file, so its checkpoint must be listed too."""
        with transaction(self.settings) as session:
            repo = JobRepository(session)
            recorded = {c.step for c in repo.checkpoints(self.job_id)}
            for step, path in checkpoints_in(directory):
                if step not in recorded:
                    nbytes, metrics = path.stat().st_size, load_checkpoint(path, mmap=True).get("last_metrics", {})
                    relative = str(path.relative_to(self.settings.artifact_dir))
                    record_checkpoint(session, self.bus, self.job_id, self.attempt, step, relative, nbytes, metrics)

    def log(self, level: str, message: str) -> None:
        with transaction(self.settings) as session:
            record_log(session, self.bus, self.job_id, level, message, step=self.step)

    def sample(self, step: int, prompt: str, text: str) -> None:
        with transaction(self.settings) as session:
            record_sample(session, self.bus, self.job_id, step, prompt, text)

    # -- control ---------------------------------------------------------------------------------
    def flush(self) -> None:
        """Publish and store everything handed over so far (waits for the thread)."""
        self._flushed.clear()
        self._pending.put(_FLUSH)
        while not self._flushed.wait(1.0):
            if not self._thread.is_alive():
                break
        self._raise_if_failed()

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
        flush_every = self.settings.telemetry_flush_seconds
        next_store = time.monotonic() + flush_every
        stop, failures = False, 0
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
                    self._store()
                    next_store = time.monotonic() + flush_every
            except LeaseLost as exc:
                self._error = exc  # the trainer stops at its next step
            except Exception as exc:  # a database or Redis blip: kept, tried again at the next store
                failures += 1
                log.warning("job %s: telemetry write failed (%d in a row): %s", self.job_id, failures, exc)
                if failures >= MAX_FAILURES or stop:
                    self._error = RuntimeError(f"telemetry could not be written: {exc}")
            else:
                failures = 0
            if flush:
                self._flushed.set()
        self._flushed.set()

    def _publish(self, reports: list[Report]) -> None:
        """Into the buffer for the next store, and to the live bus now (if the bus is down, the
        events stream reads the database instead: the mark stays at the last step published)."""
        self._buffer += [(r.step, r.values) for r in reports]
        self._progress = (reports[-1].completed, reports[-1].summary)
        try:
            marks = self.bus.publish_metrics(self.job_id, [(r.step, json.dumps(r.values)) for r in reports])
        except Exception as exc:
            log.warning("job %s: live publish failed: %s", self.job_id, exc)
            return
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
