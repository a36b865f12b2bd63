"""The ``muonforge`` command line: the service commands here, the client commands beside it.

The client commands are in ``muonforge.client_commands``. A service command imports app, worker
or torch only when it runs; a client command never does.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import traceback
from pathlib import Path

from muonforge import errors
from muonforge.client_commands import add_client_commands, after_ctrl_c
from muonforge.extras import MissingExtras, needs
from muonforge.specs import InputError, SpecError, load_spec
from muonforge.supervisor import UpFailed

EXIT_STATUS = """\
exit status:
  0    ok
  1    the job ended failed or cancelled (submit --follow, logs --follow), the sweep was
       cancelled (sweep --follow), a process of `muonforge up` exited, a service command whose
       extras are not installed (pip install 'muonforge[server,train]'), or an unexpected error
  2    bad input: a spec or argument that does not validate (422), an unknown id (404), a conflict
       such as cancelling a finished job (409), an upload over the limit (413), the job cap (429,
       after waiting as the server asks), a port that `muonforge up` cannot listen on
  3    cannot reach or authenticate to the server: refused, timed out, server errors (5xx) after
       retries, no API key, a rejected one (401, 403)
  130  interrupted (Ctrl-C); a job being followed goes on
  141  the reader of the output went away (`muonforge jobs --json | head`): the command stops
       quietly, as one that SIGPIPE ends (128 + 13)

An error is one line on stderr; --debug adds its traceback and the client's retries.
environment: MUONFORGE_API_URL (default http://127.0.0.1:8000), MUONFORGE_API_KEY,
MUONFORGE_DEBUG=1 (as --debug); the service's settings are listed in the README."""
READER_GONE = 141  # 128 + SIGPIPE (13): what a shell reports of a command that SIGPIPE ended


@needs("train")
def cmd_train(args: argparse.Namespace) -> int:
    from muonforge.progress import ProgressSink
    from worker.engine.launch import RankFailed
    from worker.engine.outcome import TrainingError
    from worker.engine.request import RunRequest
    from worker.engine.run import run_job

    spec = load_spec(args.spec, args.data)
    if spec["data"].get("dataset_id"):
        raise SpecError("data.dataset_id names an uploaded dataset: run it on a server, or give --data FILE")
    if spec.get("init_from"):
        raise SpecError("init_from names a checkpoint of a server's job: submit the spec to that server")
    if (spec["model"].get("hf") or {}).get("model_id"):
        raise SpecError("model.hf.model_id names a server's uploaded model: submit the spec to that server")
    with ProgressSink(spec["train"]["steps"]) as progress:
        try:
            result = run_job(RunRequest(spec, args.out, sink=progress, resume=args.resume))
            if result is None:  # only a node other than 0 of a job leaves the outcome to another
                raise RuntimeError("the run ended without its outcome")
        except (TrainingError, RankFailed, FileNotFoundError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    print(json.dumps(result.as_dict()))
    return 0


@needs("server")
def cmd_migrate(args: argparse.Namespace) -> int:
    from app.db.migrate import upgrade
    from app.settings import get_settings

    upgrade(get_settings())
    print("database at head")
    return 0


@needs("server")
def cmd_keys_create(args: argparse.Namespace) -> int:
    from app.db.session import transaction
    from app.services.auth import create_api_key
    from app.settings import get_settings

    with transaction(get_settings()) as session:
        key = create_api_key(session, args.tenant, args.name)
    named = f" named {args.name!r}" if args.name else ""
    print(f"API key{named} for tenant {args.tenant!r} (shown once):")
    print(key)
    return 0


@needs("server")
def cmd_keys_list(args: argparse.Namespace) -> int:
    from app.db.session import transaction
    from app.errors import NotFound
    from app.services.auth import list_api_keys
    from app.settings import get_settings
    from muonforge.output import keys_table, show

    try:
        with transaction(get_settings()) as session:
            keys = list_api_keys(session, args.tenant)
    except NotFound as exc:
        raise InputError(exc.message) from None
    show(keys_table([vars(key) for key in keys]))
    return 0


@needs("server")
def cmd_keys_revoke(args: argparse.Namespace) -> int:
    from app.db.session import transaction
    from app.errors import Conflict, NotFound
    from app.services.auth import revoke_api_key
    from app.settings import get_settings
    from muonforge.output import age

    settings = get_settings()
    try:
        with transaction(settings) as session:
            key, revoked = revoke_api_key(session, args.key)
    except NotFound as exc:
        raise InputError(f"{exc.message}; `muonforge keys list` shows the ids and prefixes") from None
    except Conflict as exc:
        raise InputError(exc.message) from None
    what = f"{key.id} ({key.prefix}…{f', {key.name!r}' if key.name else ''}, tenant {key.tenant!r})"
    if not revoked:
        since = f", {age(key.revoked_at.isoformat())} ago" if key.revoked_at is not None else ""
        print(f"{what} was already revoked{since}")
        return 0
    within = f"{settings.auth_cache_seconds:g} s (MUONFORGE_AUTH_CACHE_SECONDS)"
    print(f"revoked {what}; API processes refuse it within {within}, open event streams included")
    return 0


@needs("server")
def cmd_tenants_list(args: argparse.Namespace) -> int:
    from app.db.session import transaction
    from app.services.tenants import list_tenants
    from app.settings import get_settings
    from muonforge.output import show, tenants_table

    settings = get_settings()
    with transaction(settings) as session:
        tenants = list_tenants(session)
    show(tenants_table([t._asdict() for t in tenants], settings.tenant_job_cap))
    return 0


@needs("server")
def cmd_tenants_set_cap(args: argparse.Namespace) -> int:
    from app.db.session import transaction
    from app.errors import NotFound, ValidationFailed
    from app.services.tenants import job_cap as applied_cap
    from app.services.tenants import parse_job_cap, set_job_cap
    from app.settings import get_settings
    from muonforge.output import job_cap

    settings = get_settings()
    try:
        cap = parse_job_cap(args.cap)
        with transaction(settings) as session:
            tenant, previous = set_job_cap(session, args.tenant, cap)
    except NotFound as exc:
        raise InputError(f"{exc.message}; `muonforge tenants list` shows the tenants") from None
    except ValidationFailed as exc:
        raise InputError(exc.message) from None
    default = settings.tenant_job_cap

    def shown(value: int | None) -> str:
        return f"default ({default}, MUONFORGE_TENANT_JOB_CAP)" if value is None else job_cap(value, default)

    now = "suspended (job cap 0)" if cap == 0 else f"job cap {shown(cap)}"
    was = "unchanged" if previous == cap else f"was {shown(previous)}"
    print(f"tenant {tenant.name!r} ({tenant.id}): {now}, {was}")
    jobs = "job goes" if tenant.active_jobs == 1 else "jobs go"
    active = f"its {tenant.active_jobs} queued or running {jobs} on"
    if cap == 0:
        print(f"its submissions answer 403 tenant_suspended; {active}")
    elif tenant.active_jobs >= (limit := applied_cap(cap, default)):
        print(f"{active}; its submissions answer 429 until it has fewer than {limit}")
    within = f"{settings.auth_cache_seconds:g} s (MUONFORGE_AUTH_CACHE_SECONDS)"
    print(f"API processes apply it within {within}")
    return 0


@needs("server")
def cmd_api(args: argparse.Namespace) -> int:
    import uvicorn

    from app.settings import get_settings

    settings = get_settings()
    if args.workers is None:
        # Per-tenant limits are shared through Redis; the embedded mode (SQLite, no Redis) has
        # one writer and nothing to share them through: one process.
        args.workers = (os.cpu_count() or 1) if settings.redis_url and not settings.embedded else 1
    uvicorn.run(
        "app.main:create_app",
        factory=True,
        host=args.host,
        port=args.port,
        log_level="info",
        workers=args.workers,
        access_log=args.access_log,
        timeout_graceful_shutdown=args.graceful_timeout,
    )
    return 0


@needs("server", "train")
def cmd_worker(args: argparse.Namespace) -> int:
    from muonforge.supervisor import worker_command

    os.execv(sys.executable, worker_command(args.queues, args.concurrency))


@needs("server", "train")
def cmd_up(args: argparse.Namespace) -> int:
    from muonforge.supervisor import run_up

    return run_up(args.host, args.port, args.workers)


def connection_options(parser: argparse.ArgumentParser, default: object) -> None:
    parser.add_argument("--url", default=default, help="the server (default: MUONFORGE_API_URL)")
    parser.add_argument("--api-key", default=default, help="the API key (default: MUONFORGE_API_KEY)")
    parser.add_argument(
        "--timeout", type=float, default=default, metavar="SECONDS", help="wait this long for each answer (default 30)"
    )
    parser.add_argument("--debug", action="store_true", default=default, help="tracebacks and retries on stderr")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="muonforge",
        description="Training as a service with Muon and MuonClip.",
        epilog=EXIT_STATUS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    connection_options(parser, None)
    common = argparse.ArgumentParser(add_help=False)
    connection_options(common, argparse.SUPPRESS)  # also after the command; unset there, the global value holds
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="run one job spec locally, no service")
    train.add_argument("spec", type=Path, help="job spec, YAML or JSON")
    train.add_argument("--out", type=Path, required=True, help="output directory")
    train.add_argument(
        "--data", type=Path, help="corpus file (UTF-8 text, .jsonl rows or .parquet); replaces the spec's data source"
    )
    train.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    train.set_defaults(func=cmd_train)

    add_client_commands(sub, common)

    up = sub.add_parser("up", help="migrate, then run the API and worker(s) together")
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--port", type=int, default=8000)
    up.add_argument("--workers", type=int, default=1, help="worker processes (one per device)")
    up.set_defaults(func=cmd_up)

    api = sub.add_parser("api", help="the HTTP API (uvicorn)")
    api.add_argument("--host", default="127.0.0.1")
    api.add_argument("--port", type=int, default=8000)
    api.add_argument(
        "--workers",
        type=int,
        default=None,
        help="API processes sharing the port (default: one per core; one in the embedded mode)",
    )
    api.add_argument("--no-access-log", dest="access_log", action="store_false", help="no line per request")
    api.add_argument(
        "--graceful-timeout",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="on SIGTERM, wait this long for requests to end, then cut them (default 5)",
    )
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
    create.add_argument("--name", help="what the key is for (laptop, ci), as `keys list` shows it")
    create.set_defaults(func=cmd_keys_create)
    listing = keys.add_parser("list", help="API keys: id, tenant, name, prefix, created, last used, revoked")
    listing.add_argument("--tenant", help="only this tenant's keys")
    listing.set_defaults(func=cmd_keys_list)
    revoke = keys.add_parser("revoke", help="revoke an API key")
    revoke.add_argument("key", metavar="KEY", help="its id (key_…), its prefix (mf_…, as `keys list` shows) or the key")
    revoke.set_defaults(func=cmd_keys_revoke)

    tenants = sub.add_parser("tenants", help="tenants and their job caps").add_subparsers(
        dest="tenants_command", required=True
    )
    listing = tenants.add_parser(
        "list", help="tenants: name, id, job cap, queued+running jobs, bytes stored (datasets and models), active keys"
    )
    listing.set_defaults(func=cmd_tenants_list)
    set_cap = tenants.add_parser(
        "set-cap",
        help="set a tenant's job cap (queued plus running jobs); 0 suspends it",
        description="Set a tenant's job cap: the queued plus running jobs it may have. API processes"
        " apply it within MUONFORGE_AUTH_CACHE_SECONDS (they keep a verified key's tenant, cap"
        " included, that long).",
    )
    set_cap.add_argument("tenant", metavar="NAME", help="the tenant's name, as `tenants list` shows it")
    set_cap.add_argument(
        "cap",
        metavar="N",
        help="a whole number >= 0 (0 suspends: submissions answer 403 tenant_suspended, jobs"
        " already queued or running go on), or 'default' for the server's MUONFORGE_TENANT_JOB_CAP",
    )
    set_cap.set_defaults(func=cmd_tenants_set_cap)
    return parser


def key_source(args: argparse.Namespace | None) -> str:
    """Where the API key the client sent came from, as the error line names it."""
    return "given with --api-key" if getattr(args, "api_key", None) else "from MUONFORGE_API_KEY"


def explain(exc: Exception, args: argparse.Namespace | None = None) -> tuple[int, str]:
    """The exit status of an error that ends a command, and its line for people."""
    match exc:
        case InputError():
            return 2, str(exc)
        case UpFailed():
            return exc.status, str(exc)
        case MissingExtras():
            return 1, str(exc)
        case errors.ConfigError():
            return 3, f"{exc.problem}: set {exc.env} or pass --{exc.argument.replace('_', '-')}"
        case errors.ConnectionFailed(timed_out=True):
            return 3, (
                f"the server at {exc.url} gave {exc.reason}{attempts(exc)}; try again later, or wait longer with"
                " --timeout SECONDS"
            )
        case errors.ConnectionFailed():
            return 3, f"{exc}; start one with 'muonforge up', or point MUONFORGE_API_URL (or --url) at it"
        case errors.Forbidden():
            return 3, f"the API key {key_source(args)} is not allowed to do this: {exc.message} {answer(exc)}"
        case errors.Unauthorized():
            return 3, f"the server refused the API key {key_source(args)}: {exc.message} {answer(exc)}"
        case errors.ServerError():
            after = f" after {exc.attempts} attempts" if exc.attempts > 1 else ""
            request_id = f", request id {exc.request_id}" if exc.request_id else ""
            return 3, f"the server failed{after}: {exc.message} ({exc.status} {exc.code}{request_id})"
        case errors.ValidationError():
            fields = "; ".join(f"{param}: {message}" if param else message for param, message in exc.fields)
            return 2, f"{fields} {answer(exc)}"
        case errors.PayloadTooLarge() if path := getattr(args, "file", None) or getattr(args, "data", None):
            return 2, f"{path}: {exc.message} {answer(exc)}"
        case errors.RateLimited():
            waited = f"; still refused after {exc.attempts} attempts over {exc.waited:.0f} s" * (exc.attempts > 1)
            again = f"; try again in {exc.retry_after:.0f} s" if exc.retry_after is not None else ""
            return 2, f"{exc.message}{waited}{again} {answer(exc)}"
        case errors.NotFound() if exc.code != "not_found" and exc.request:  # not the API's answer
            return 2, f"{exc.request}: {exc.message} {answer(exc)}; is MUONFORGE_API_URL (or --url) a muonforge server?"
        case errors.ApiError():
            return 2, f"{exc.message} {answer(exc)}"
        case OSError() if exc.filename:
            return 2, f"{exc.filename}: {exc.strerror}"
    return 1, f"unexpected {type(exc).__name__}: {exc} (--debug shows the traceback)"


def answer(exc: errors.ApiError) -> str:
    return f"({exc.status} {exc.code})"


def attempts(exc: errors.MuonforgeError) -> str:
    return f" ({exc.attempts} attempts)" if exc.attempts > 1 else ""


def show_retries(debug: bool) -> None:
    """The client's log on stderr: with --debug every retry, else only the waits the server asks
    for (a 429's Retry-After), as notes."""
    log = logging.getLogger("muonforge.client")
    if debug:
        logging.basicConfig(format="%(name)s: %(message)s")
        log.setLevel(logging.INFO)
    elif not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("note: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.WARNING)


def reader_gone() -> int:
    """The exit status once stdout's reader has gone (``| head``): the shell's for a command that
    SIGPIPE ended, as git's. stdout now leads to /dev/null, so that the flush at exit does not fail
    again."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return READER_GONE


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    debug = args.debug or os.environ.get("MUONFORGE_DEBUG") == "1"
    show_retries(debug)
    try:
        status = args.func(args)
        sys.stdout.flush()  # here, where a reader that has gone is caught
        return status
    except BrokenPipeError:
        return reader_gone()
    except KeyboardInterrupt:
        print(f"{after_ctrl_c()}interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if debug:
            traceback.print_exc()
        status, message = explain(exc, args)
        print(f"error: {message}", file=sys.stderr)
        return status


if __name__ == "__main__":
    sys.exit(main())
