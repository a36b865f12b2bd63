"""`muonforge up` in a real pseudo-terminal, with nothing configured (the embedded default, in a
directory of its own): a port that is taken is named before anything starts, a child that exits
stops the others, and Ctrl-C or SIGTERM stops everything within seconds, even with a job running
and an events stream open."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.support.http_stub import Reply, StubServer, scripted
from tests.support.net import free_port
from tests.support.terminal import assert_one_error, environment, finish, run, spawn

pytestmark = pytest.mark.system  # its tests start processes: the service's, torchrun's or a command's

EMBEDDED = "muonforge: embedded (SQLite and a local broker under ./var)"
LONG_JOB = {
    "model": {"arch": "gpt", "n_layer": 1, "n_head": 2, "d_model": 16, "seq_len": 16},
    "data": {"builtin": "synthetic"},
    "train": {"steps": 100_000, "batch_size": 4, "eval_every": 100_000, "checkpoint_every": 100_000},
}


def port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def processes_in(directory: Path) -> list[int]:
    """The live processes working in ``directory``: `up` and the children it started there."""
    pids = []
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            zombie = proc.name.isdigit() and (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
            if proc.name.isdigit() and not zombie and os.readlink(proc / "cwd") == str(directory):
                pids.append(int(proc.name))
    return pids


def child_running(parent: int, argument: str, timeout: float = 30) -> int:
    """The pid of the child of ``parent`` whose command line has ``argument``, once it has one."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            for pid in Path(f"/proc/{parent}/task/{parent}/children").read_text().split():
                if argument in Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0"):
                    return int(pid)
        time.sleep(0.005)
    raise AssertionError(f"no child of {parent} runs {argument!r}")


def test_a_port_in_use_is_named_before_anything_starts(tmp_path):
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        begun = time.monotonic()
        screen = run("up", "--port", port, env=environment(), cwd=tmp_path)
        assert time.monotonic() - begun < 10
    program = Path("/proc/self/comm").read_text().strip()
    assert_one_error(
        screen,
        2,
        f"error: port {port} on 127.0.0.1 is in use by {program} (pid {os.getpid()}); stop it, or pass another --port",
    )
    assert not (tmp_path / "var").exists(), "nothing was migrated or started"


def test_a_muonforge_server_already_on_the_port(tmp_path):
    ready = Reply(200, {"status": "ok", "checks": {"database": "ok", "broker": "ok"}})
    with StubServer(scripted(ready)) as server:
        screen = run("up", "--port", server.url.rsplit(":", 1)[1], env=environment(), cwd=tmp_path)
    assert_one_error(
        screen, 2, f"error: a muonforge server already answers at {server.url}; use it, or pass another --port"
    )


def test_a_child_that_exits_before_ready_stops_the_others(tmp_path):
    up = spawn("up", "--port", free_port(), env=environment(), cwd=tmp_path, timeout=60)
    os.kill(child_running(up.pid, "api"), signal.SIGKILL)  # long before it can answer
    screen = finish(up, timeout=60)
    assert screen.status == 1 and "Traceback" not in screen.raw
    assert screen.lines[0] == EMBEDDED
    assert screen.lines[-1] == "error: the API exited before it was ready (killed by SIGKILL); stopped the worker"
    assert processes_in(tmp_path) == []


def start_up(tmp_path: Path):
    """`muonforge up` on a free port, once it has printed its URL and key: (the process, URL, key)."""
    up = spawn("up", "--port", free_port(), env=environment(), cwd=tmp_path, timeout=90)
    up.expect(r"URL: (\S+)\r\n")
    url = up.match.group(1).decode()
    up.expect(r"API key: (\S+) \(kept in var/api-key\)\r\n")
    return up, url, up.match.group(1).decode()


def test_up_prints_the_lines_that_point_a_shell_at_it(tmp_path):
    """Pasted into a new shell whose PATH lacks this environment's `muonforge` (as after `make
    run`, which installs into .venv), the lines `up` prints make the command line work."""
    bin_dir = str(Path(sys.executable).parent)
    path = os.pathsep.join(d for d in os.environ["PATH"].split(os.pathsep) if d != bin_dir)
    up = spawn("up", "--port", free_port(), env=environment(PATH=path), cwd=tmp_path, timeout=90)
    up.expect(r"URL: (\S+)\r\n")
    url = up.match.group(1).decode()
    up.expect(r"API key: (\S+) \(kept in var/api-key\)\r\n")
    key = up.match.group(1).decode()
    up.expect(r"The command line, in another shell:\r\n  (.+)\r\n  (export .+)\r\n")
    setup, export = (group.decode() for group in up.match.groups())
    assert export == f"export MUONFORGE_API_URL={url} MUONFORGE_API_KEY={key}"
    shell = subprocess.run(
        ["bash", "-c", f"{setup}\n{export}\nmuonforge jobs --json"],
        env=environment(PATH=path),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (shell.returncode, shell.stdout, shell.stderr) == (0, "[]\n", "")
    stop_up(up)


def test_sigterm_stops_the_api_and_the_worker(tmp_path):
    up, url, _ = start_up(tmp_path)
    assert len(processes_in(tmp_path)) == 3, "up, the API and the worker"
    begun = time.monotonic()
    up.kill(signal.SIGTERM)
    screen = finish(up)
    assert time.monotonic() - begun < 5
    assert screen.status == 0 and "Traceback" not in screen.raw
    assert "muonforge: stopping (SIGTERM)" in screen.lines and screen.lines[-1] == "muonforge: stopped"
    assert processes_in(tmp_path) == []
    assert port_is_free(int(url.rsplit(":", 1)[1]))


def test_ctrl_c_stops_everything_promptly_with_a_job_running_and_a_stream_open(tmp_path):
    up, url, key = start_up(tmp_path)
    headers = {"Authorization": f"Bearer {key}"}
    job = httpx.post(f"{url}/v1/jobs", json=LONG_JOB, headers=headers).json()
    deadline = time.monotonic() + 60
    while httpx.get(f"{url}/v1/jobs/{job['id']}", headers=headers).json()["progress"]["step"] == 0:
        assert time.monotonic() < deadline, "the job did not start"
        time.sleep(0.1)
    streaming = threading.Event()

    def follow() -> None:  # an open events stream, as `muonforge logs --follow` keeps
        events = f"{url}/v1/jobs/{job['id']}/events"
        with contextlib.suppress(httpx.HTTPError), httpx.stream("GET", events, headers=headers, timeout=None) as answer:
            for _ in answer.iter_lines():
                streaming.set()

    threading.Thread(target=follow, daemon=True).start()
    assert streaming.wait(10)
    begun = time.monotonic()
    up.sendintr()
    screen = finish(up)
    assert time.monotonic() - begun < 8, "the API cuts open streams after 2 s; the worker is given 1 s"
    assert screen.status == 0 and "Traceback" not in screen.raw.split("muonforge: stopping")[-1]
    assert "muonforge: stopping (SIGINT)" in screen.lines and screen.lines[-1] == "muonforge: stopped"
    assert processes_in(tmp_path) == []
    assert port_is_free(int(url.rsplit(":", 1)[1]))


def stop_up(up) -> None:
    up.kill(signal.SIGTERM)
    assert finish(up).status == 0


def works(url: str, key: str) -> bool:
    return httpx.get(f"{url}/v1/jobs", headers={"Authorization": f"Bearer {key}"}).status_code == 200


def test_up_prints_the_same_key_at_every_start_until_it_no_longer_works(tmp_path):
    stored = tmp_path / "var" / "api-key"
    up, url, key = start_up(tmp_path)
    assert works(url, key)
    stop_up(up)
    assert stored.read_text().strip() == key and stored.stat().st_mode & 0o777 == 0o600

    up, url, again = start_up(tmp_path)
    assert again == key and works(url, key)
    stop_up(up)

    revoke = run("keys", "revoke", key[:10], env=environment(), cwd=tmp_path)
    assert revoke.status == 0 and revoke.lines[0].startswith("revoked key_"), revoke.lines
    up, url, new = start_up(tmp_path)
    assert new != key and works(url, new) and not works(url, key)
    assert stored.read_text().strip() == new and stored.stat().st_mode & 0o777 == 0o600
    stop_up(up)

    for database in (tmp_path / "var").glob("muonforge.db*"):  # a reset: the database starts over
        database.unlink()
    up, url, fresh = start_up(tmp_path)
    assert fresh != new and works(url, fresh)
    assert stored.read_text().strip() == fresh
    stop_up(up)
    assert processes_in(tmp_path) == []
