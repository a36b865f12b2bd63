"""The client commands of ``muonforge``: each makes a few Client calls and prints.

They import neither app, worker nor torch, so they start fast.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from itertools import islice
from pathlib import Path
from typing import Any

from rich.console import Group
from rich.live import Live

from contract import metrics
from contract.export import CONFIG_FILE, EXPORT_FILE, FORMATS
from contract.status import JobStatus, SweepStatus
from contract.webhooks import WebhookEventType
from muonforge.api import SWEEP_STATUSES
from muonforge.client import FINISHED, PAGE_SIZE, STATUSES, Client, Event, Retry
from muonforge.output import (
    console,
    datasets_table,
    deliveries_table,
    event_line,
    job_details,
    jobs_table,
    metric_rows,
    metrics_csv,
    metrics_table,
    model_details,
    models_table,
    show,
    sweep_heading,
    sweeps_table,
    trials_table,
    webhooks_table,
)
from muonforge.progress import follow, transfer_bar
from muonforge.specs import InputError, read_spec, with_source

# Someone is waiting at the terminal: give up after two quick retries; wait as a 429 asks (each
# wait is shown as a note), up to a minute.
CLI_RETRY = Retry(max_retries=2, max_wait=60.0)
DEFAULT_TIMEOUT = 30.0
# A run's main curves, as the jobs list shows them: what `metrics` gives without --name (those the
# job has; an mlp has no attention).
MAIN_CURVES = (metrics.LOSS, metrics.VAL_LOSS, metrics.ATTN_MAX_LOGIT)


def connect(args: argparse.Namespace) -> Client:
    return Client(args.url, args.api_key, timeout=args.timeout or DEFAULT_TIMEOUT, retry=CLI_RETRY)


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def outcome(job: dict[str, Any]) -> int:
    """The exit status of a command that waited for the job to end."""
    return 0 if job["status"] == JobStatus.SUCCEEDED else 1


def after_ctrl_c() -> str:
    """What starts a line printed after Ctrl-C: a line feed on a terminal, past the ^C it echoed."""
    return "\n" if sys.stderr.isatty() else ""


def detached(job_id: str, fresh_line: bool = False) -> int:
    """Ctrl-C while following a job: say how to come back to it.

    ``fresh_line``: the cursor is at the start of a line already (a progress bar ends by redrawing
    its line, ^C included).
    """
    start = "" if fresh_line else after_ctrl_c()
    print(f"{start}detached; {job_id} goes on. Re-attach: muonforge logs {job_id} --follow", file=sys.stderr)
    return 130


def show_list(args: argparse.Namespace, items: list, table: Callable[[list], Any], empty: str) -> None:
    """A list command's output: JSON with --json, else a table, or ``empty`` on stderr."""
    if args.json:
        print_json(items)
    elif items:
        show(table(items))
    else:
        print(empty, file=sys.stderr)


def show_one(args: argparse.Namespace, item: Any, view: Callable[[Any], Any]) -> None:
    """A show command's output: JSON with --json, else ``view`` of it."""
    if args.json:
        print_json(item)
    else:
        show(view(item))


def print_json(value: Any) -> None:
    print(json.dumps(value, indent=2))


def cmd_submit(args: argparse.Namespace) -> int:
    raw = read_spec(args.spec)
    with connect(args) as client:
        if args.data is not None:
            raw = with_source(raw, dataset_id=upload(client, args.data, None)["id"])
        job = client.create_job(raw)
        print(job["id"], flush=True)
        if not args.follow:
            return 0
        try:
            job = follow(client, job)
        except KeyboardInterrupt:
            return detached(job["id"], fresh_line=True)
    print(json.dumps({k: job[k] for k in ("id", "status", "progress", "summary", "error")}))
    return outcome(job)


def cmd_jobs(args: argparse.Namespace) -> int:
    with connect(args) as client:
        jobs = list(islice(client.list_jobs(args.status, page_size=min(args.limit, PAGE_SIZE)), args.limit))
    show_list(args, jobs, jobs_table, "no jobs")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    with connect(args) as client:
        job = client.get_job(args.job_id)
    show_one(args, job, job_details)
    return 0


def caught_up(job: dict[str, Any], event: Event) -> bool:
    """Whether the events stream has reached where ``job`` (read just before it opened) was: its
    latest step, or, before its first step, its status. A finished job's stream ends by itself."""
    step = job["progress"]["step"]
    if job["status"] in FINISHED:
        return False
    if step == 0:
        return event.event == "status" and event.data["status"] == job["status"]
    return event.event == "metrics" and event.data["step"] >= step - job["spec"]["telemetry"]["every"]


def cmd_logs(args: argparse.Namespace) -> int:
    with connect(args) as client:
        now = latest = client.get_job(args.job_id)
        try:
            for event in client.events(now["id"]):
                if (line := event_line(event.event, event.data)) is not None:
                    print(line, flush=True)
                latest = event.data if event.event == "status" else latest
                if not args.follow and caught_up(now, event):
                    break
        except KeyboardInterrupt:
            if args.follow:
                return detached(now["id"])
            raise
    return outcome(latest) if args.follow else 0


def cmd_cancel(args: argparse.Namespace) -> int:
    with connect(args) as client:
        job = client.cancel_job(args.job_id)
    print(f"{job['id']}: {job['status']}")
    return 0


def cmd_metrics(args: argparse.Namespace) -> int:
    asked = list(dict.fromkeys(n for arg in args.name or [] for n in arg.split(",") if n))
    with connect(args) as client:
        series = client.metrics(args.job_id, asked or MAIN_CURVES, max_points=args.max_points)
    for name in asked:
        if name not in series:
            print(f"note: {args.job_id} has no points of {name!r}", file=sys.stderr)
    names = asked or [name for name in MAIN_CURVES if series.get(name)]
    rows = metric_rows(series, names)
    if args.csv:
        metrics_csv(rows, names, sys.stdout)
    else:
        show(metrics_table(rows, names))
    return 0


def checkpoint_step(client: Client, job_id: str, step: int | None) -> int:
    """``step``, or (None) the step of the job's latest checkpoint."""
    if step is not None:
        return step
    checkpoints = client.checkpoints(job_id)
    if not checkpoints:
        raise InputError(f"{job_id} has no checkpoint yet")
    return checkpoints[0]["step"]  # newest first


def cmd_download(args: argparse.Namespace) -> int:
    with connect(args) as client:
        step = checkpoint_step(client, args.job_id, args.step)
        name = f"{args.job_id}-step{step:08d}.pt"  # the server's file name
        out = args.out / name if args.out and args.out.is_dir() else args.out or Path(name)
        with transfer_bar(f"step {step}") as progress:
            path = client.download_checkpoint(args.job_id, step, out, progress)
    print(path)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    with connect(args) as client:
        step = checkpoint_step(client, args.job_id, args.step)
        with transfer_bar(f"step {step}") as progress:
            directory = client.export_checkpoint(args.job_id, step, args.out, progress, args.format)
    if args.format == "hf":
        print(directory)  # what AutoModelForCausalLM.from_pretrained and AutoTokenizer.from_pretrained take
    else:
        print(directory / EXPORT_FILE)
        print(directory / CONFIG_FILE)
    return 0


def upload(client: Client, path: Path, name: str | None) -> dict[str, Any]:
    with transfer_bar(path.name) as progress:
        dataset = client.upload_dataset(path, name, progress)
    print(f"uploaded {path} as {dataset['id']} ({dataset['bytes']:,} bytes)", file=sys.stderr)
    return dataset


def cmd_datasets_upload(args: argparse.Namespace) -> int:
    with connect(args) as client:
        print(upload(client, args.file, args.name)["id"])
    return 0


def cmd_datasets_list(args: argparse.Namespace) -> int:
    with connect(args) as client:
        datasets = list(islice(client.list_datasets(page_size=min(args.limit, PAGE_SIZE)), args.limit))
    show_list(args, datasets, datasets_table, "no datasets")
    return 0


def cmd_datasets_delete(args: argparse.Namespace) -> int:
    with connect(args) as client:
        client.delete_dataset(args.dataset_id)
    print(f"{args.dataset_id}: deleted")
    return 0


def cmd_models_upload(args: argparse.Namespace) -> int:
    path: Path = args.path
    if not path.exists():
        raise InputError(f"{path}: No such file or directory")
    with connect(args) as client, transfer_bar(path.name) as progress:
        model = client.upload_model(path, args.name, progress)
    print(
        f"uploaded {path} as {model['id']} ({model['model_type']}, {model['parameters']:,} parameters, "
        f"{model['bytes']:,} bytes)",
        file=sys.stderr,
    )
    print(model["id"])
    return 0


def cmd_models_list(args: argparse.Namespace) -> int:
    with connect(args) as client:
        models = list(islice(client.list_models(page_size=min(args.limit, PAGE_SIZE)), args.limit))
    show_list(args, models, models_table, "no models")
    return 0


def cmd_models_show(args: argparse.Namespace) -> int:
    with connect(args) as client:
        model = client.get_model(args.model_id)
    show_one(args, model, model_details)
    return 0


def cmd_models_delete(args: argparse.Namespace) -> int:
    with connect(args) as client:
        client.delete_model(args.model_id)
    print(f"{args.model_id}: deleted")
    return 0


def sweep_view(sweep: dict[str, Any]) -> Group:
    return Group(sweep_heading(sweep), trials_table(sweep))


def cmd_sweep(args: argparse.Namespace) -> int:
    raw = read_spec(args.spec)
    with connect(args) as client:
        sweep = client.create_sweep(raw)
        print(sweep["id"], flush=True)
        if not args.follow:
            return 0
        try:
            with Live(sweep_view(sweep), console=console(), auto_refresh=False) as live:
                while sweep["status"] == SweepStatus.RUNNING:
                    time.sleep(args.interval)
                    sweep = client.get_sweep(sweep["id"])
                    live.update(sweep_view(sweep), refresh=True)
        except KeyboardInterrupt:
            again = f"muonforge sweeps show {sweep['id']}"
            print(f"{after_ctrl_c()}detached; {sweep['id']} goes on. Look again: {again}", file=sys.stderr)
            return 130
    return 0 if sweep["status"] == SweepStatus.COMPLETED else 1


def cmd_sweeps_list(args: argparse.Namespace) -> int:
    with connect(args) as client:
        sweeps = list(islice(client.list_sweeps(args.status, page_size=min(args.limit, PAGE_SIZE)), args.limit))
    show_list(args, sweeps, sweeps_table, "no sweeps")
    return 0


def cmd_sweeps_show(args: argparse.Namespace) -> int:
    with connect(args) as client:
        sweep = client.get_sweep(args.sweep_id)
    show_one(args, sweep, sweep_view)
    return 0


def cmd_sweeps_cancel(args: argparse.Namespace) -> int:
    with connect(args) as client:
        sweep = client.cancel_sweep(args.sweep_id)
    print(f"{sweep['id']}: {sweep['status']}")
    return 0


JOB_EVENTS = ",".join(t for t in WebhookEventType if t.startswith("job."))  # a job's ends


def cmd_webhooks_create(args: argparse.Namespace) -> int:
    events = [e.strip() for e in args.events.split(",") if e.strip()]
    with connect(args) as client:
        webhook = client.create_webhook(args.endpoint_url, events)
    print(f"webhook {webhook['id']} for {webhook['url']}: {', '.join(webhook['events'])}")
    print("signing secret (shown once; verify the webhook-signature header with it):")
    print(webhook["secret"])
    return 0


def cmd_webhooks_list(args: argparse.Namespace) -> int:
    with connect(args) as client:
        webhooks = list(client.list_webhooks())
    show_list(args, webhooks, webhooks_table, "no webhooks")
    return 0


def cmd_webhooks_delete(args: argparse.Namespace) -> int:
    with connect(args) as client:
        client.delete_webhook(args.webhook_id)
    print(f"{args.webhook_id}: deleted")
    return 0


def cmd_webhooks_deliveries(args: argparse.Namespace) -> int:
    with connect(args) as client:
        pages = client.webhook_deliveries(args.webhook_id, page_size=min(args.limit, PAGE_SIZE))
        deliveries = list(islice(pages, args.limit))
    show_list(args, deliveries, deliveries_table, "no deliveries")
    return 0


def add_client_commands(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """The client commands, each taking the ``common`` options (--url, --api-key, --debug)."""

    def command(parsers: argparse._SubParsersAction, name: str, func, help: str) -> argparse.ArgumentParser:
        parser = parsers.add_parser(name, parents=[common], help=help, description=help)
        parser.set_defaults(func=func)
        return parser

    submit = command(sub, "submit", cmd_submit, "submit a job spec; prints the job's id")
    submit.add_argument("spec", type=Path, help="job spec, YAML or JSON")
    submit.add_argument("--data", type=Path, help="upload this corpus and train on it")
    submit.add_argument("--follow", action="store_true", help="show progress until the job finishes")

    jobs = command(sub, "jobs", cmd_jobs, "list jobs, newest first")
    jobs.add_argument("--status", choices=STATUSES)
    jobs.add_argument("--limit", type=positive, default=20, help="at most this many (default 20)")
    jobs.add_argument("--json", action="store_true", help="the Job objects as JSON")

    show_job = command(sub, "show", cmd_show, "one job: status, progress, spec, latest metrics")
    show_job.add_argument("job_id")
    show_job.add_argument("--json", action="store_true", help="the Job object as JSON")

    logs = command(sub, "logs", cmd_logs, "a job's status changes, log lines and checkpoints so far")
    logs.add_argument("job_id")
    logs.add_argument("--follow", action="store_true", help="keep streaming until the job finishes")

    cancel = command(sub, "cancel", cmd_cancel, "cancel a job (a running one stops at its next step)")
    cancel.add_argument("job_id")

    metrics = command(sub, "metrics", cmd_metrics, "a job's metric history, one column per name")
    metrics.add_argument("job_id")
    metrics.add_argument(
        "--name",
        action="append",
        help=f"metric name, repeatable or comma-separated (default: {', '.join(MAIN_CURVES)}, those the job has)",
    )
    metrics.add_argument("--csv", action="store_true", help="CSV: step,<name>,... (empty where a series has no point)")
    metrics.add_argument("--max-points", type=int, default=1000, help="points per series, downsampled by the server")

    download = command(sub, "download", cmd_download, "download a checkpoint")
    download.add_argument("job_id")
    download.add_argument("--step", type=int, help="the checkpoint's step (default: the latest)")
    download.add_argument("--out", type=Path, help="file or directory (default: ./<job>-step<N>.pt)")

    export = command(
        sub,
        "export",
        cmd_export,
        "a checkpoint's weights for use without the service: model.safetensors and config.json, "
        "or a transformers model directory (--format hf)",
    )
    export.add_argument("job_id")
    export.add_argument("--step", type=int, help="the checkpoint's step (default: the latest)")
    export.add_argument("--out", type=Path, required=True, help="the directory to write them in (created if need be)")
    export.add_argument(
        "--format",
        choices=FORMATS,
        default="safetensors",
        help="safetensors (default): for the engine's model code; hf: config.json, model.safetensors, "
        "generation_config.json and tokenizer files that transformers loads (arch gpt and hf)",
    )

    sweep = command(sub, "sweep", cmd_sweep, "submit a sweep file (base spec and search space); prints its id")
    sweep.add_argument("spec", type=Path, help="sweep spec, YAML or JSON (examples/sweeps/lr-and-optimizer.yaml)")
    sweep.add_argument("--follow", action="store_true", help="show a live table of its trials until the sweep ends")
    sweep.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes (default 2)")

    sweeps = sub.add_parser("sweeps", help="list, show and cancel sweeps").add_subparsers(
        dest="sweeps_command", required=True
    )
    listing = command(sweeps, "list", cmd_sweeps_list, "list sweeps, newest first")
    listing.add_argument("--status", choices=SWEEP_STATUSES)
    listing.add_argument("--limit", type=positive, default=20, help="at most this many (default 20)")
    listing.add_argument("--json", action="store_true", help="the Sweep objects as JSON")
    show_ = command(sweeps, "show", cmd_sweeps_show, "one sweep: its trials, their parameters and metrics, the best")
    show_.add_argument("sweep_id")
    show_.add_argument("--json", action="store_true", help="the Sweep object as JSON, trials included")
    cancel_ = command(sweeps, "cancel", cmd_sweeps_cancel, "cancel a sweep: no trial starts any more")
    cancel_.add_argument("sweep_id")

    datasets = sub.add_parser("datasets", help="upload, list and delete corpora").add_subparsers(
        dest="datasets_command", required=True
    )
    upload_ = command(
        datasets, "upload", cmd_datasets_upload, "upload a corpus (UTF-8 text, .jsonl rows or .parquet); prints its id"
    )
    upload_.add_argument("file", type=Path)
    upload_.add_argument("--name", help="default: the file's name")
    listing = command(datasets, "list", cmd_datasets_list, "list uploaded corpora, newest first")
    listing.add_argument("--limit", type=positive, default=20, help="at most this many (default 20)")
    listing.add_argument("--json", action="store_true", help="the Dataset objects as JSON")
    delete = command(datasets, "delete", cmd_datasets_delete, "delete a corpus (refused while a job uses it)")
    delete.add_argument("dataset_id")

    models = sub.add_parser("models", help="upload, list, show and delete transformers models").add_subparsers(
        dest="models_command", required=True
    )
    upload_ = command(
        models,
        "upload",
        cmd_models_upload,
        "upload a transformers model directory (config.json, safetensors weights, tokenizer files) or a .tar, "
        ".tar.gz or .zip of one; prints its id",
    )
    upload_.add_argument("path", type=Path, metavar="DIR|ARCHIVE")
    upload_.add_argument("--name", help="default: the directory's or the archive's name")
    listing = command(
        models, "list", cmd_models_list, "list models: your uploads, newest first, then the staged ones (source)"
    )
    listing.add_argument("--limit", type=positive, default=20, help="at most this many (default 20)")
    listing.add_argument("--json", action="store_true", help="the Model objects as JSON")
    show_ = command(models, "show", cmd_models_show, "one model: its sizes, parameters and files")
    show_.add_argument("model_id")
    show_.add_argument("--json", action="store_true", help="the Model object as JSON, its config.json included")
    delete = command(
        models,
        "delete",
        cmd_models_delete,
        "delete an uploaded model and its files (refused while a job uses it; staged models are the operators')",
    )
    delete.add_argument("model_id")

    webhooks = sub.add_parser("webhooks", help="signed callbacks when jobs end").add_subparsers(
        dest="webhooks_command", required=True
    )
    create = command(webhooks, "create", cmd_webhooks_create, "add an endpoint; prints its signing secret, once")
    create.add_argument("endpoint_url", metavar="URL", help="where the events are POSTed (http or https)")
    create.add_argument("--events", default=JOB_EVENTS, help=f"comma-separated event types (default {JOB_EVENTS})")
    listing = command(webhooks, "list", cmd_webhooks_list, "list endpoints, newest first")
    listing.add_argument("--json", action="store_true", help="the Webhook objects as JSON")
    delete = command(webhooks, "delete", cmd_webhooks_delete, "delete an endpoint and its delivery log")
    delete.add_argument("webhook_id")
    deliveries = command(
        webhooks, "deliveries", cmd_webhooks_deliveries, "an endpoint's deliveries, newest first, with their attempts"
    )
    deliveries.add_argument("webhook_id")
    deliveries.add_argument("--limit", type=positive, default=20, help="at most this many (default 20)")
    deliveries.add_argument("--json", action="store_true", help="the deliveries as JSON, attempts included")
