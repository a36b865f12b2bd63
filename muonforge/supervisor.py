"""Process management for `muonforge up` and `muonforge worker`.

`up` checks its port, migrates, then runs the API and the workers as children in process groups
of their own, so that a signal reaches them only through `up`: Ctrl-C, SIGTERM or SIGHUP stops
them all within seconds (the API finishes its requests for a moment; a worker's running job is
interrupted, and resumes from its latest checkpoint once its lease has lapsed and a worker runs
again), a second Ctrl-C kills them at once, and a child that exits stops the others, with one
line naming it and why. `up` prints the same API key at every start while the database accepts
it (kept in ./var/api-key, mode 0600)."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from app.settings import Settings

API_GRACE = 2.0  # seconds the API gives open requests when told to stop (event streams are cut; clients resume)
# Seconds from SIGTERM to SIGKILL. A worker's warm shutdown would wait for its running job to end,
# and an idle one on the embedded broker takes seconds to notice: it is given one.
GRACE = {"api": API_GRACE + 3.0, "worker": 1.0}


class UpFailed(Exception):
    """`muonforge up` could not start, or one of its processes exited: the line to print and the
    exit status."""

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status


def default_queues() -> str:
    import torch

    return "default,cuda" if torch.cuda.is_available() else "default,cpu"


def worker_command(queues: str | None, concurrency: int) -> list[str]:
    """A Celery worker: solo pool for one process per device (no fork after CUDA init)."""
    pool = ["--pool", "solo"] if concurrency == 1 else ["--pool", "prefork", "--concurrency", str(concurrency)]
    celery = [sys.executable, "-m", "celery", "-A", "worker.celery_app", "worker"]
    options = ["--queues", queues or default_queues(), *pool, "--prefetch-multiplier", "1", "--loglevel", "INFO"]
    return [*celery, *options, "--without-gossip", "--without-mingle"]


# -- the port -------------------------------------------------------------------------------------
def check_port(host: str, port: int) -> None:
    """Raise UpFailed (status 2) unless the API could listen on ``host:port`` now.

    It cannot when the port is taken (by a muonforge server, or by which program when this user may
    see it), or the address is not this machine's.
    """
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: TIME_WAIT is no conflict
        try:
            sock.bind((host, port))
            return
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                reason = (exc.strerror or str(exc)).lower()
                raise UpFailed(f"cannot listen on {host}:{port}: {reason}; check --host", 2) from None
    url = f"http://{host}:{port}"
    if muonforge_answers(url):
        raise UpFailed(f"a muonforge server already answers at {url}; use it, or pass another --port", 2)
    owner = port_owner(port)
    by = f" by {owner}" if owner else ""
    raise UpFailed(f"port {port} on {host} is in use{by}; stop it, or pass another --port", 2)


def muonforge_answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/readyz", timeout=1) as response:
            return "checks" in json.load(response)
    except urllib.error.HTTPError as exc:  # 503: up but not ready
        with contextlib.suppress(ValueError):
            return "checks" in json.load(exc)
    except (OSError, ValueError):
        pass
    return False


def port_owner(port: int) -> str | None:
    """The program listening on TCP ``port``, as "python (pid 123)", when /proc shows it (Linux,
    a process of this user); else None."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":  # LISTEN
                    inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return None
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in (proc / "fd").iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd) in inodes:
                        return f"{(proc / 'comm').read_text().strip()} (pid {proc.name})"
    return None


# -- the children ---------------------------------------------------------------------------------
@dataclass
class Child:
    name: str  # "the API", "the worker", "worker 2"
    proc: subprocess.Popen
    grace: float  # seconds from SIGTERM to SIGKILL

    def exited(self) -> str | None:
        """None while it runs, else how it ended: "status 1", "killed by SIGKILL"."""
        code = self.proc.poll()
        if code is None:
            return None
        return f"killed by {signal.Signals(-code).name}" if code < 0 else f"status {code}"


def start(name: str, command: list[str], grace: float) -> Child:
    """A child in a process group of its own (a Ctrl-C at the terminal reaches `up` alone), which
    gets SIGTERM if `up` dies, even by SIGKILL (Linux)."""
    preexec = None
    if sys.platform == "linux":
        prctl, parent = ctypes.CDLL(None, use_errno=True).prctl, os.getpid()

        def preexec() -> None:
            prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
            if os.getppid() != parent:  # it died before that
                os._exit(1)

    proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, process_group=0, preexec_fn=preexec)
    return Child(name, proc, grace)


def stop(children: list[Child], signals: Signals) -> None:
    """SIGTERM to every child still running, SIGKILL to each after its grace, or to all at once
    when asked again (a second Ctrl-C); returns once all have exited."""
    for child in children:
        if child.proc.poll() is None:
            child.proc.terminate()
    begun, asked = time.monotonic(), signals.count
    while running := [c for c in children if c.proc.poll() is None]:
        elapsed = time.monotonic() - begun
        for child in running:
            if signals.count > asked or elapsed >= child.grace:
                child.proc.kill()
                child.proc.wait()
        time.sleep(0.02)


class Signals:
    """Ctrl-C, SIGTERM and SIGHUP, counted rather than raised while `up` runs: it checks between
    steps, so no child is ever left half started."""

    HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self.count = 0
        self.name: str | None = None  # of the first signal

    def __enter__(self) -> Signals:
        self._saved = {sig: signal.signal(sig, self._handle) for sig in self.HANDLED}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame) -> None:
        self.count += 1
        self.name = self.name or signal.Signals(signum).name

    def wait(self, seconds: float) -> bool:
        """Sleep up to ``seconds``; True when a stop was asked for."""
        deadline = time.monotonic() + seconds
        while not self.count and time.monotonic() < deadline:
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        return bool(self.count)


def readiness(url: str) -> dict | None:
    """The API's /readyz report (200 or 503), or None while it does not answer."""
    try:
        with urllib.request.urlopen(f"{url}/readyz", timeout=2) as response:
            return json.load(response)
    except urllib.error.HTTPError as exc:
        with contextlib.suppress(ValueError):
            return json.load(exc)
    except (OSError, ValueError):
        pass
    return None


def wait_ready(url: str, children: list[Child], signals: Signals, host: str, port: int, timeout: float = 60.0) -> bool:
    """Wait until the API is ready (True) or a stop is asked for (False); raise UpFailed when a
    child exits first or the API is not ready in time."""
    deadline, report = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        report = readiness(url)
        if report is not None and report.get("status") == "ok":
            return True
        check_children(children, host, port, ready=False)
        if signals.wait(0.2):
            return False
    checks = ", ".join(f"{name} {state}" for name, state in (report or {}).get("checks", {}).items())
    raise UpFailed(f"the API was not ready after {timeout:.0f} s" + (f": {checks}" if checks else ""))


def check_children(children: list[Child], host: str, port: int, ready: bool) -> None:
    """Raise UpFailed naming the first child that has exited, and why."""
    for child in children:
        if (how := child.exited()) is None:
            continue
        when = "" if ready else " before it was ready"
        reason = f" ({how})"
        if child.name == "the API" and not ready:
            try:
                check_port(host, port)
            except UpFailed as exc:  # taken since the check: the line says by what
                raise UpFailed(f"the API could not listen: {exc}", 2) from None
            if not how.startswith("killed"):
                reason = f" ({how}; its output is above)"
        raise UpFailed(f"{child.name} exited{when}{reason}")


# -- the local API key ----------------------------------------------------------------------------
KEY_FILE = "api-key"  # under ./var, beside the embedded database
KEY_TENANT, KEY_NAME = "default", "muonforge up"


def local_api_key(settings: Settings, path: Path) -> str:
    """The key `up` prints: the one stored at ``path`` while the database accepts it, else a new one.

    A new one is for the tenant "default" (the first start, a revoked key, a database reset),
    written to ``path`` readable by this user alone (mode 0600) in place of the old one.
    """
    from app.db.session import transaction
    from app.services.auth import create_api_key, key_is_active

    with contextlib.suppress(FileNotFoundError):
        stored = path.read_text().strip()
        with transaction(settings) as session:
            if stored and key_is_active(session, stored):
                return stored
    with transaction(settings) as session:
        key = create_api_key(session, KEY_TENANT, KEY_NAME)
    write_private(path, key + "\n")
    return key


def write_private(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` at once, in a file only this user may read or write."""
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # a leftover file keeps its mode through O_CREAT
    with os.fdopen(fd, "w") as out:
        out.write(text)
    os.replace(part, path)


def client_setup(url: str, key: str) -> list[str]:
    """The shell lines that point the command line at this server.

    Where ``muonforge`` on the PATH is not this one (`make run` installs it into .venv), the
    activation of this environment first.
    """
    here = Path(sys.executable).parent
    lines = [f"export MUONFORGE_API_URL={shlex.quote(url)} MUONFORGE_API_KEY={shlex.quote(key)}"]
    if (found := shutil.which("muonforge")) and Path(found).resolve() == (here / "muonforge").resolve():
        return lines
    activate = here / "activate"
    with contextlib.suppress(ValueError):
        activate = activate.relative_to(Path.cwd())
    on_path = f"export PATH={shlex.quote(str(here))}:$PATH"
    setup = f". {shlex.quote(str(activate))}" if (here / "activate").exists() else on_path
    return [setup, *lines]


def run_up(host: str, port: int, workers: int) -> int:
    """Check the port, migrate, start the API and the workers, print the URL, the local API key
    (``local_api_key``) and the shell lines for the command line (``client_setup``), then run until
    Ctrl-C, SIGTERM or SIGHUP (0) or until a child exits (UpFailed)."""
    check_port(host, port)
    with Signals() as signals:
        from app.db.migrate import upgrade
        from app.settings import VAR, get_settings

        settings = get_settings()
        upgrade(settings)
        mode = "embedded (SQLite and a local broker under ./var)" if settings.embedded else "Postgres and Redis"
        print(f"muonforge: {mode}", flush=True)
        serve = ["--host", host, "--port", str(port), "--graceful-timeout", str(API_GRACE)]
        api = [sys.executable, "-m", "muonforge.cli", "api", *serve]
        children: list[Child] = []
        try:
            if signals.count:
                return 0
            children.append(start("the API", api, GRACE["api"]))
            worker = worker_command(None, 1)  # imports torch: while the API starts
            for n in range(workers):
                children.append(start("the worker" if workers == 1 else f"worker {n + 1}", worker, GRACE["worker"]))
            url = f"http://{host}:{port}"
            if not wait_ready(url, children, signals, host, port):
                return 0
            key = local_api_key(settings, VAR / KEY_FILE)
            print(f"URL: {url}", flush=True)
            print(f"API key: {key} (kept in {VAR / KEY_FILE})", flush=True)
            print("The command line, in another shell:", *client_setup(url, key), sep="\n  ", flush=True)
            while not signals.wait(0.2):
                check_children(children, host, port, ready=True)
            return 0
        except UpFailed as exc:
            others = [c.name for c in children if c.proc.poll() is None]
            if others:
                exc.args = (f"{exc}; stopped {' and '.join(others)}",)
            raise
        finally:
            asked = signals.count and any(c.proc.poll() is None for c in children)
            if asked:
                echoed = signals.name == "SIGINT" and sys.stderr.isatty()  # the terminal shows ^C: a line of its own
                say(("\n" if echoed else "") + f"muonforge: stopping ({signals.name})")
            stop(children, signals)
            if asked:
                say("muonforge: stopped")


def say(line: str) -> None:
    """A line on stderr, unless it is gone (the terminal closed: SIGHUP)."""
    with contextlib.suppress(OSError):
        print(line, file=sys.stderr, flush=True)
