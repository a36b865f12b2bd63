"""The ``muonforge`` command line. Each subcommand imports what it needs lazily."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any


class SpecError(ValueError):
    """A job spec that cannot be read or does not validate; the message is for people."""


def read_spec(path: Path) -> dict[str, Any]:
    """A YAML or JSON job spec as a dict (not yet validated)."""
    import yaml

    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))  # JSON is YAML too
    except OSError as exc:
        raise SpecError(f"cannot read {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise SpecError(f"{path} is not valid YAML or JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise SpecError(f"{path} must hold a mapping (a JobSpec), not {type(raw).__name__}")
    return raw


def with_source(raw: dict[str, Any], **source: str) -> dict[str, Any]:
    """The spec with its data source replaced (``path=`` or ``dataset_id=``)."""
    data = {k: v for k, v in (raw.get("data") or {}).items() if k not in ("dataset_id", "builtin", "path")}
    return {**raw, "data": {**data, **source}}


def load_spec(path: Path, data: Path | None = None) -> dict[str, Any]:
    """Read a job spec, apply ``--data``, validate it with JobSpec; return its dict."""
    import pydantic

    from app.schemas import JobSpec

    raw = read_spec(path)
    if data is not None:
        raw = with_source(raw, path=str(data))
    try:
        return JobSpec.model_validate(raw).model_dump()
    except pydantic.ValidationError as exc:
        lines = [f"  {'.'.join(str(p) for p in e['loc']) or '(spec)'}: {e['msg']}" for e in exc.errors()]
        raise SpecError(f"{path} is not a valid job spec:\n" + "\n".join(lines)) from None


def cmd_train(args: argparse.Namespace) -> int:
    from muonforge.progress import ProgressSink
    from worker.engine.run import run_job
    from worker.engine.trainer import TrainingError

    spec = load_spec(args.spec, args.data)
    if spec["data"].get("dataset_id"):
        raise SpecError("data.dataset_id names an uploaded dataset: run it on a server, or give --data FILE")
    with ProgressSink(spec["train"]["steps"]) as progress:
        try:
            result = run_job(spec, args.out, sink=progress, resume=args.resume)
        except (TrainingError, FileNotFoundError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    print(json.dumps(result.as_dict()))
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    from muonforge.client import ApiError, Client
    from muonforge.progress import follow

    raw = read_spec(args.spec)
    try:
        with Client() as client:
            if args.data is not None:
                dataset = client.upload_dataset(args.data)
                print(f"uploaded {args.data} as {dataset['id']} ({dataset['bytes']:,} bytes)", file=sys.stderr)
                raw = with_source(raw, dataset_id=dataset["id"])
            job = client.create_job(raw)
            print(job["id"])
            if not args.follow:
                return 0
            job = follow(client, job)
    except ApiError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2 if exc.status in (401, 404, 409, 413, 422, 429) else 1
    except ValueError as exc:  # no API key configured
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({k: job[k] for k in ("id", "status", "progress", "summary", "error")}))
    return 0 if job["status"] == "succeeded" else 1


def cmd_migrate(args: argparse.Namespace) -> int:
    from app.migrate import upgrade
    from app.settings import get_settings

    upgrade(get_settings())
    print("database at head")
    return 0


def cmd_keys_create(args: argparse.Namespace) -> int:
    from app.db.session import transaction
    from app.services.auth import create_api_key
    from app.settings import get_settings

    with transaction(get_settings()) as session:
        key = create_api_key(session, args.tenant)
    print(f"API key for tenant {args.tenant!r} (shown once):")
    print(key)
    return 0


def cmd_api(args: argparse.Namespace) -> int:
    import uvicorn

    uvicorn.run(
        "app.main:create_app", factory=True, host=args.host, port=args.port, log_level="info",
        workers=args.processes, access_log=args.access_log,
    )  # fmt: skip
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    from muonforge.services import worker_command

    os.execv(sys.executable, worker_command(args.queues, args.concurrency))


def cmd_up(args: argparse.Namespace) -> int:
    from muonforge.services import run_up

    return run_up(args.host, args.port, args.workers)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="muonforge", description="Training as a service with Muon and MuonClip.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="run one job spec locally, no service")
    train.add_argument("spec", type=Path, help="job spec, YAML or JSON")
    train.add_argument("--out", type=Path, required=True, help="output directory")
    train.add_argument("--data", type=Path, help="corpus file (UTF-8 text); replaces the spec's data source")
    train.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    train.set_defaults(func=cmd_train)

    submit = sub.add_parser("submit", help="submit a job spec to a server (MUONFORGE_API_URL, MUONFORGE_API_KEY)")
    submit.add_argument("spec", type=Path, help="job spec, YAML or JSON")
    submit.add_argument("--data", type=Path, help="upload this corpus and train on it")
    submit.add_argument("--follow", action="store_true", help="show progress until the job finishes")
    submit.set_defaults(func=cmd_submit)

    up = sub.add_parser("up", help="migrate, then run the API and worker(s) together")
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--port", type=int, default=8000)
    up.add_argument("--workers", type=int, default=1, help="worker processes (one per device)")
    up.set_defaults(func=cmd_up)

    api = sub.add_parser("api", help="the HTTP API (uvicorn)")
    api.add_argument("--host", default="127.0.0.1")
    api.add_argument("--port", type=int, default=8000)
    api.add_argument("--processes", type=int, default=1, help="API processes sharing the port (one per core)")
    api.add_argument("--no-access-log", dest="access_log", action="store_false", help="no line per request")
    api.set_defaults(func=cmd_api)

    worker = sub.add_parser("worker", help="a Celery worker")
    worker.add_argument("--queues", default=None, help="comma-separated (default: default plus this host's device)")
    worker.add_argument("--concurrency", type=int, default=1, help="1 = one solo process (one device)")
    worker.set_defaults(func=cmd_worker)

    migrate = sub.add_parser("migrate", help="alembic upgrade head")
    migrate.set_defaults(func=cmd_migrate)

    keys = sub.add_parser("keys", help="API keys").add_subparsers(dest="keys_command", required=True)
    create = keys.add_parser("create", help="create an API key; prints it alone on the last line")
    create.add_argument("--tenant", required=True)
    create.set_defaults(func=cmd_keys_create)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except SpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
