"""What the commands print: tables, one job's details, the lines of ``muonforge logs``, and CSV.

The tables list jobs, datasets, models, sweeps and their trials, webhooks and their deliveries, metrics,
API keys and tenants; the CSV holds metrics.
"""

from __future__ import annotations

import csv
import sys
from datetime import UTC, datetime
from typing import Any, TextIO

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from contract import metrics
from contract.status import TRIAL_FINISHED, JobStatus, SweepStatus
from contract.webhooks import DeliveryStatus

STATUS_STYLE: dict[str, str] = {  # by a status or its text
    JobStatus.SUCCEEDED: "green",
    JobStatus.FAILED: "red",
    JobStatus.CANCELLED: "yellow",
    JobStatus.CANCELLING: "yellow",
    JobStatus.STOPPED_EARLY: "magenta",
    JobStatus.PAUSED: "cyan",
    SweepStatus.COMPLETED: "green",
}


def console() -> Console:
    """stdout; piped, wide enough that no table is cut or wrapped."""
    return Console() if sys.stdout.isatty() else Console(width=10_000)


def show(renderable: Any) -> None:
    """``renderable`` on stdout: on a terminal as rich draws it; piped, its lines without the
    spaces that pad them to their columns' width."""
    out = console()
    if sys.stdout.isatty():
        out.print(renderable)
        return
    with out.capture() as captured:
        out.print(renderable)
    sys.stdout.writelines(line.rstrip() + "\n" for line in captured.get().splitlines())


def age(timestamp: str | None, now: datetime | None = None) -> str:
    """How long ago an ISO 8601 time was: 42s, 5m, 3h, 2d."""
    if not timestamp:
        return "-"
    then = datetime.fromisoformat(timestamp)
    then = then if then.tzinfo else then.replace(tzinfo=UTC)  # the embedded database keeps UTC without a zone
    seconds = ((now or datetime.now(UTC)) - then).total_seconds()
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size:.0f}{unit}"
    return f"{max(seconds, 0):.0f}s"


def number(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, int | float) else "-"


def status(job: dict[str, Any], detail: str = "") -> Text:
    # Text, never markup: names and messages come from users and may hold brackets.
    return Text(job["status"], style=STATUS_STYLE.get(job["status"], "")) + detail


def jobs_table(jobs: list[dict[str, Any]]) -> Table:
    table = Table("id", "name", "status", "step", metrics.LOSS, metrics.VAL_LOSS, "age", box=None, header_style="bold")
    for job in jobs:
        progress, summary = job["progress"], job["summary"]
        table.add_row(
            Text(job["id"]),
            Text(job["name"] or "-"),
            status(job),
            f"{progress['step']}/{progress['total_steps']}",
            number(summary.get(metrics.LOSS)),
            number(summary.get(metrics.VAL_LOSS)),
            age(job["created_at"]),
        )
    return table


def job_details(job: dict[str, Any]) -> Table:
    spec = job["spec"]
    rows = [
        ("id", job["id"]),
        ("name", job["name"] or "-"),
        ("status", status(job, f": {job['error']['code']}: {job['error']['message']}" if job["error"] else "")),
        ("progress", f"{job['progress']['step']}/{job['progress']['total_steps']} steps, attempt {job['attempt']}"),
        ("created", f"{job['created_at']} ({age(job['created_at'])} ago)"),
        ("started", job["started_at"] or "-"),
        ("finished", job["finished_at"] or "-"),
        *((("started from", f"{p['job_id']} at step {p['step']}"),) if (p := job.get("parent")) else ()),
        *((part, settings(spec[part])) for part in ("model", "data", "optimizer", "train") if part in spec),
        *((name, f"{value:.6g}" if isinstance(value, float) else str(value)) for name, value in job["summary"].items()),
    ]
    table = Table.grid(padding=(0, 2))
    for name, value in rows:
        table.add_row(Text(name, style="bold"), value if isinstance(value, Text) else Text(value))
    return table


def settings(part: dict[str, Any]) -> str:
    """A spec section on one line, unset fields left out: ``arch=gpt n_layer=2 ...``."""
    return " ".join(f"{k}={v}" for k, v in part.items() if v is not None)


def datasets_table(datasets: list[dict[str, Any]]) -> Table:
    table = Table("id", "name", "format", "bytes", "sha256", "age", box=None, header_style="bold")
    for d in datasets:
        fmt, created = d.get("format", "text"), age(d["created_at"])
        table.add_row(Text(d["id"]), Text(d["name"]), fmt, f"{d['bytes']:,}", d["sha256"][:12], created)
    return table


def models_table(models: list[dict[str, Any]]) -> Table:
    """The models: the tenant's uploads (source ``upload``) and the operators' staged ones (``staged``)."""
    table = Table("id", "source", "name", "type", "parameters", "bytes", "age", box=None, header_style="bold")
    for m in models:
        table.add_row(
            Text(m["id"]),
            Text(m.get("source", "upload")),
            Text(m["name"]),
            Text(m["model_type"]),
            f"{m['parameters']:,}",
            f"{m['bytes']:,}",
            age(m["created_at"]),
        )
    return table


def model_details(model: dict[str, Any]) -> Table:
    """One model: its sizes, its files, its tokenizer's."""
    sizes = model["sizes"]
    rows = [
        ("id", model["id"]),
        ("source", model.get("source", "upload")),
        ("name", model["name"]),
        ("type", model["model_type"]),
        ("parameters", f"{model['parameters']:,}"),
        ("sizes", settings({k: v for k, v in sizes.items() if k != "tied_embeddings"})),
        ("tied embeddings", "yes" if sizes["tied_embeddings"] else "no"),
        ("files", ", ".join(model["files"])),
        ("tokenizer", ", ".join(model["tokenizer_files"]) or "-"),
        ("bytes", f"{model['bytes']:,}"),
        ("sha256", model["sha256"] or "-"),
        ("created", f"{model['created_at']} ({age(model['created_at'])} ago)"),
    ]
    table = Table.grid(padding=(0, 2))
    for name, value in rows:
        table.add_row(Text(name, style="bold"), Text(value))
    return table


def webhooks_table(webhooks: list[dict[str, Any]]) -> Table:
    table = Table("id", "url", "events", "age", box=None, header_style="bold")
    for w in webhooks:
        table.add_row(Text(w["id"]), Text(w["url"]), Text(",".join(w["events"])), age(w["created_at"]))
    return table


def sweeps_table(sweeps: list[dict[str, Any]]) -> Table:
    """Sweeps: trials finished of all, and the best trial's metric."""
    table = Table("id", "name", "status", "trials", "best", "age", box=None, header_style="bold")
    for s in sweeps:
        counts = s["counts"]
        done = sum(n for st, n in counts["by_status"].items() if st in TRIAL_FINISHED)
        best = s["best"]
        best_text = f"#{best['number']} {s['metric']} {number(best['metric'])}" if best else "-"
        table.add_row(
            Text(s["id"]),
            Text(s["name"] or "-"),
            status(s),
            f"{done}/{counts['total']}",
            Text(best_text),
            age(s["created_at"]),
        )
    return table


def param_value(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def rung_mark(trial: dict[str, Any], rung: dict[str, Any]) -> str:
    """A rung result in a trials table: ``+`` went on at once, ``^`` promoted after waiting there,
    ``=`` waits there now, ``x`` stopped there."""
    if rung["continued"]:
        return "^" if rung.get("promoted") else "+"
    return "=" if trial["status"] == JobStatus.PAUSED else "x"


def trials_table(sweep: dict[str, Any]) -> Table:
    """A sweep's trials: parameters, status, steps, metric and rung results (:func:`rung_mark`);
    the best one marked *."""
    paths = list(sweep["spec"]["space"])
    best = sweep["best"]["number"] if sweep["best"] else None
    table = Table("#", "job", *paths, "status", "step", sweep["metric"], "rungs", box=None, header_style="bold")
    for t in sweep["trials"]:
        rungs = " ".join(f"{r['rung']}:{rung_mark(t, r)}" for r in t["rungs"])
        mark = "*" if t["number"] == best else ""
        table.add_row(
            f"{t['number']}{mark}",
            Text(t["job_id"] or "-"),
            *(Text(param_value(t["params"].get(p))) for p in paths),
            status(t),
            str(t["step"]),
            number(t["metric"]),
            rungs or "-",
        )
    return table


def sweep_heading(sweep: dict[str, Any]) -> Text:
    counts = ", ".join(f"{n} {st}" for st, n in sorted(sweep["counts"]["by_status"].items()))
    best = sweep["best"]
    text = Text(f"{sweep['id']} {sweep['name'] or ''} ") + status(sweep) + f" ({counts})"
    if best:
        text += f"; best #{best['number']}: {sweep['metric']} {number(best['metric'])} ({best['job_id']})"
    return text


DELIVERY_STYLE = {DeliveryStatus.DELIVERED: "green", DeliveryStatus.FAILED: "red"}


def deliveries_table(deliveries: list[dict[str, Any]]) -> Table:
    """Deliveries with their attempts so far and the latest one's answer (a status code or an error)."""
    table = Table("id", "event", "status", "attempts", "last answer", "age", box=None, header_style="bold")
    for d in deliveries:
        last = d["attempts"][-1] if d["attempts"] else None
        answer = "-" if last is None else str(last["status_code"] or last["error"])
        table.add_row(
            Text(d["id"]),
            Text(d["event_type"]),
            Text(d["status"], style=DELIVERY_STYLE.get(d["status"], "")),
            str(len(d["attempts"])),
            Text(answer),
            age(d["created_at"]),
        )
    return table


def keys_table(keys: list[dict[str, Any]]) -> Table:
    """API keys (``KeyInfo`` fields; times as datetimes): when each was created, last used and
    revoked, as ages ("-": never)."""
    table = Table("id", "tenant", "name", "prefix", "created", "last used", "revoked", box=None, header_style="bold")

    def ago(when: Any) -> str:
        return f"{age(when.isoformat())} ago" if when else "-"

    for key in keys:
        table.add_row(
            Text(key["id"]),
            Text(key["tenant"]),
            Text(key["name"] or "-"),
            Text(key["prefix"]),
            ago(key["created_at"]),
            ago(key["last_used_at"]),
            ago(key["revoked_at"]),
        )
    return table


def job_cap(cap: int | None, default: int) -> str:
    """A tenant's job cap for people: the number, "default (8)" (the server's), or "suspended" (0)."""
    if cap is None:
        return f"default ({default})"
    return "suspended" if cap == 0 else str(cap)


def tenants_table(tenants: list[dict[str, Any]], default_cap: int) -> Table:
    """Tenants (``TenantFigures`` fields): job cap, queued plus running jobs, bytes of datasets
    stored, keys not revoked; ``default_cap`` is the server's cap, shown where a tenant has none."""
    headers = ("name", "id", "job cap", "queued+running", "stored bytes", "active keys")
    table = Table(*headers, box=None, header_style="bold")
    for t in tenants:
        table.add_row(
            Text(t["name"]),
            Text(t["id"]),
            job_cap(t["job_cap"], default_cap),
            str(t["active_jobs"]),
            f"{t['stored_bytes']:,}",
            str(t["active_keys"]),
        )
    return table


def metric_rows(series: dict[str, list[list[float]]], names: list[str]) -> list[list[Any]]:
    """One row per step that any series has: ``[step, value of names[0] or None, ...]``.

    The server downsamples each series on its own, so a step may have one series and not another.
    """
    by_name = {name: {int(step): value for step, value in series.get(name, [])} for name in names}
    steps = sorted({step for points in by_name.values() for step in points})
    return [[step, *(by_name[name].get(step) for name in names)] for step in steps]


def metrics_csv(rows: list[list[Any]], names: list[str], out: TextIO) -> None:
    """``step,<name>,...``; values as Python writes floats (they read back exactly), empty where
    a series has no point at that step."""
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["step", *names])
    writer.writerows([[step, *("" if v is None else repr(v) for v in values)] for step, *values in rows])


def metrics_table(rows: list[list[Any]], names: list[str]) -> Table:
    table = Table("step", *map(escape, names), box=None, header_style="bold")
    for step, *values in rows:
        table.add_row(str(step), *("" if v is None else f"{v:.6g}" for v in values))
    return table


def event_line(kind: str, data: dict[str, Any]) -> str | None:
    """A status, log, checkpoint or sample event as a line of ``muonforge logs``; None for the others."""
    if kind == "status":
        error = data.get("error")
        detail = f": {error['code']}: {error['message']}" if error else f" (attempt {data['attempt']})"
        return f"status      {data['status']}{detail}"
    if kind == "log":
        return f"{data['level']:<11} {data['message']}"
    if kind == "checkpoint":
        return f"checkpoint  step {data['step']} ({data['bytes'] / 2**20:.2f} MiB)"
    if kind == "sample":
        return f"sample      step {data['step']}: {data['text'][:100]!r}"
    return None
