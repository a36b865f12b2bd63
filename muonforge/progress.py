"""A telemetry sink that draws a rich progress bar: step, loss, tokens/s, ETA."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


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

    def metrics(self, step: int, values: dict[str, float]) -> None:
        self.show(step + 1 if "loss" in values else step, values)

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
        self._progress.console.log(f"checkpoint step {step}: {path} ({nbytes / 2**20:.1f} MiB)")

    def log(self, level: str, message: str) -> None:
        self._progress.console.log(f"[{level}] {message}")


def follow(client, job: dict) -> dict:
    """Draw the job's progress from its live events stream until it finishes; returns the final
    Job."""
    bar = ProgressSink(job["progress"]["total_steps"])
    with bar:
        for event in client.events(job["id"]):
            if event.event == "metrics":
                bar.metrics(event.data["step"], event.data["metrics"])
            elif event.event == "checkpoint":
                bar.console.log(f"checkpoint step {event.data['step']} ({event.data['bytes'] / 2**20:.1f} MiB)")
            elif event.event == "log":
                bar.log(event.data["level"], event.data["message"])
            elif event.event == "status":
                bar.console.log(f"status {event.data['status']} (attempt {event.data['attempt']})")
    return client.get_job(job["id"])
