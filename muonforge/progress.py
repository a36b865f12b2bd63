"""Progress bars on stderr: a training run's and a file transfer's.

A run's bar (step, loss, tokens/s, ETA) follows it as a telemetry sink or from a job's events
stream; a transfer's shows bytes, speed and ETA.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypedDict

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    Task,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.text import Text

from contract import metrics
from contract.status import FINISHED
from muonforge.output import STATUS_STYLE, event_line


class EtaColumn(TimeRemainingColumn):
    """The time left as "ETA h:mm:ss" while the run goes on; nothing once it has ended."""

    def render(self, task: Task) -> Text:
        if task.fields["state"] in FINISHED:
            return Text("")
        return Text("ETA ") + super().render(task)


class _Shown(TypedDict, total=False):
    """The figures a run's bar shows, as far as they are known."""

    loss: str
    val: str
    tps: str


class ProgressSink:
    """A training run's bar: step, loss, val_loss, tokens/s, elapsed time and ETA; its first
    column says "train" while it runs and the job's outcome once it has ended."""

    def __init__(self, total_steps: int, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True, log_path=False)
        self._state = TextColumn("{task.fields[state]}", style="bold")
        self._progress = Progress(
            self._state,
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}  val {task.fields[val]}  {task.fields[tps]} tok/s"),
            TimeElapsedColumn(),
            EtaColumn(),
            console=self.console,
        )
        self._task = self._progress.add_task("train", total=total_steps, loss="-", val="-", tps="-", state="train")

    def __enter__(self) -> ProgressSink:
        self._progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self._progress.stop()

    def metrics(self, report) -> None:
        """The engine's telemetry (``muonforge train``): a worker.engine.telemetry.Report."""
        self.show(report.completed, report.values)

    def show(self, completed: int, values: dict[str, float]) -> None:
        """Steps completed, and whichever of loss, val_loss and tokens_per_s are known."""
        fields: _Shown = {}
        if metrics.LOSS in values:
            fields["loss"] = f"{values[metrics.LOSS]:.4f}"
        if metrics.VAL_LOSS in values:
            fields["val"] = f"{values[metrics.VAL_LOSS]:.4f}"
        if metrics.TOKENS_PER_S in values:
            fields["tps"] = f"{values[metrics.TOKENS_PER_S]:,.0f}"
        self._progress.update(self._task, completed=completed, **fields)

    def end(self, status: str) -> None:
        """The job ended: its bar stops there, named by the outcome."""
        self._state.style = STATUS_STYLE.get(status, "bold")
        self._progress.update(self._task, state=status)
        self._progress.stop_task(self._task)

    def checkpoint(self, step: int, path: Path, nbytes: int, metrics: dict[str, float]) -> None:
        self._progress.console.log(f"checkpoint step {step}: {path} ({nbytes / 2**20:.1f} MiB)", markup=False)

    def log(self, level: str, message: str) -> None:
        self._progress.console.log(f"{level}: {message}", markup=False, highlight=False)

    def sample(self, step: int, prompt: str, text: str) -> None:
        self._progress.console.log(event_line("sample", {"step": step, "text": text}), markup=False, highlight=False)


def follow(client, job: dict) -> dict:
    """Draw the job's progress from its live events stream until it finishes; returns the final
    Job."""
    bar = ProgressSink(job["progress"]["total_steps"])
    with bar:
        for event in client.events(job["id"]):
            if event.event == "metrics":  # measured after ``step`` steps: at least that many are done
                bar.show(event.data["step"], event.data["metrics"])
                continue
            if event.event == "status":
                bar.show(event.data["progress"]["step"], {})
            if (line := event_line(event.event, event.data)) is not None:
                bar.console.log(line, markup=False, highlight=False)
            if event.event == "status" and event.data["status"] in FINISHED:
                bar.end(event.data["status"])
    return client.get_job(job["id"])


@contextmanager
def transfer_bar(description: str) -> Iterator[Callable[[int, int | None], None] | None]:
    """A bar of bytes moved on a terminal, driven by the ``progress(done, total)`` callback it yields.

    It yields None when stderr is not a terminal; the bar leaves the screen when the transfer ends
    (the command then says what it did).
    """
    console = Console(stderr=True)
    if not console.is_terminal:
        yield None
        return
    columns = (TextColumn("{task.description}", markup=False), BarColumn(), DownloadColumn(), TransferSpeedColumn())
    with Progress(*columns, TimeRemainingColumn(), console=console, transient=True) as bar:
        task = bar.add_task(description, total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)
