"""Progress bars on stderr: a training run's (step, loss, tokens/s, ETA), as a telemetry sink or
from a job's events stream, and a file transfer's (bytes, speed, ETA)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from muonforge.output import event_line


class ProgressSink:
    def __init__(self, total_steps: int, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True)
        self._progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}  val {task.fields[val]}  {task.fields[tps]} tok/s"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=self.console,
        )
        self._task = self._progress.add_task("train", total=total_steps, loss="-", val="-", tps="-")

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
        fields = {}
        if "loss" in values:
            fields["loss"] = f"{values['loss']:.4f}"
        if "val_loss" in values:
            fields["val"] = f"{values['val_loss']:.4f}"
        if "tokens_per_s" in values:
            fields["tps"] = f"{values['tokens_per_s']:,.0f}"
        self._progress.update(self._task, completed=completed, **fields)

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
    return client.get_job(job["id"])


@contextmanager
def transfer_bar(description: str) -> Iterator[Callable[[int, int | None], None] | None]:
    """A bar of bytes moved on a terminal, driven by the ``progress(done, total)`` callback it
    yields (None when stderr is not a terminal); it leaves the screen when the transfer ends (the
    command then says what it did)."""
    console = Console(stderr=True)
    if not console.is_terminal:
        yield None
        return
    columns = (TextColumn("{task.description}", markup=False), BarColumn(), DownloadColumn(), TransferSpeedColumn())
    with Progress(*columns, TimeRemainingColumn(), console=console, transient=True) as bar:
        task = bar.add_task(description, total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)
