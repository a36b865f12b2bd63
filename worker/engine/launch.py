"""Running a job as a torch.distributed group: PyTorch's own launcher, torchrun (c10d rendezvous,
no restarts of its own), as a child process group of this process, with every rank watched from
here.

The ranks connect to a local socket of this process (channel.py); rank 0's telemetry goes into the
caller's sink as though the trainer ran here, and its pulses drive ``should_cancel`` (which pulses
a worker's lease). The group ends as one: a rank that dies makes torchrun stop the others and exit
(``RankFailed``: the job resumes from its latest checkpoint); a ``watch`` that raises (a lost
lease), a failure of the sink, or a cancel the group does not honour in time kill every process of
it: torchrun's process group and each rank's (torchrun starts each rank in a session of its own).
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import os
import secrets
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .channel import ADDRESS_ENV, TOKEN_ENV, deliver, encode
from .config import job_config_from_dict
from .telemetry import TelemetrySink
from .trainer import RunResult, TrainingError

log = logging.getLogger("muonforge.engine")
RANK_MODULE = "worker.engine.rank"
SOURCE_ROOT = Path(__file__).resolve().parents[2]  # the ranks import the engine from where this process does
POLL_SECONDS = 0.2
KILL_GRACE_SECONDS = 10.0  # SIGTERM, then SIGKILL after this long
CANCEL_GRACE_SECONDS = 120.0  # a cancelled group's time to checkpoint and exit on its own
DRAIN_SECONDS = 5.0  # once torchrun has exited, how long its ranks' last lines are waited for


class RankFailed(RuntimeError):
    """A process of the group died (killed, out of memory, a crash) before the run ended: the run
    can resume from its latest checkpoint."""


def torchrun_command(nproc: int, rank_args: list[str]) -> list[str]:
    """torchrun with this interpreter: ``nproc`` ranks of RANK_MODULE on this node, a c10d
    rendezvous on a free local port, and no restarts (a failed group is this process's to handle)."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "--max-restarts", "0",
        "-m", RANK_MODULE, *rank_args,
    ]  # fmt: skip


def run_group(
    spec: dict[str, Any],
    out_dir: Path,
    corpus: Path | None = None,
    sink: TelemetrySink | None = None,
    should_cancel: Callable[[], bool] | None = None,
    resume: bool = True,
    watch: Callable[[], None] | None = None,
    init_from: Path | None = None,
) -> RunResult:
    """Train ``spec`` in a group of ``resources.nproc`` ranks launched and followed from here; the
    run's files go under ``out_dir`` (rank 0 writes them, torchrun's and the ranks' output goes
    to ``ranks.log``). Raises as the trainer would (TrainingError with its code, out of memory),
    or RankFailed. ``init_from``: a warm start's checkpoint file, which every rank loads."""
    out_dir.mkdir(parents=True, exist_ok=True)
    spec_path = out_dir / "group-spec.json"
    spec_path.write_text(json.dumps(spec))
    args = ["--spec", str(spec_path), "--out", str(out_dir)]
    args += (["--corpus", str(corpus)] if corpus else []) + ([] if resume else ["--fresh"])
    args += ["--init-from", str(init_from)] if init_from else []
    group = Launch(torchrun_command(job_config_from_dict(spec).resources.nproc, args), out_dir / "ranks.log")
    try:
        return group.follow(sink, should_cancel or (lambda: False), watch)
    finally:
        group.kill()


class Peer:
    """A rank's connection: its bytes not yet a whole line, and its rank once it said hello."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.buffer, self.rank = sock, b"", None


class Launch:
    """torchrun and its ranks, started and followed."""

    def __init__(self, command: list[str], log_path: Path) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.setblocking(False)
        self.token = secrets.token_hex(16)
        path = os.pathsep.join(p for p in (str(SOURCE_ROOT), os.environ.get("PYTHONPATH")) if p)
        env = os.environ | {
            ADDRESS_ENV: f"127.0.0.1:{self.listener.getsockname()[1]}", TOKEN_ENV: self.token, "PYTHONPATH": path
        }  # fmt: skip
        self.log_path = log_path
        with log_path.open("ab") as out:
            self.proc = subprocess.Popen(
                command, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ)
        self.pids: set[int] = set()  # of the ranks that said hello
        self.lead: Peer | None = None
        self.outcome: dict[str, Any] | None = None  # rank 0's result or error record
        self.progress: tuple[int, dict[str, float]] = (0, {})  # steps completed and the summary, as last reported
        self.cancel_at: float | None = None

    # -- following ------------------------------------------------------------------------------
    def follow(self, sink: TelemetrySink | None, should_cancel: Callable[[], bool], watch) -> RunResult:
        exited_at = None
        while True:
            for key, _ in self.selector.select(POLL_SECONDS):
                if key.fileobj is self.listener:
                    self._accept()
                else:
                    self._read(key.data, sink, should_cancel)
            if watch is not None:
                watch()
            if self.proc.poll() is not None:
                exited_at = exited_at or time.monotonic()
                if len(self.selector.get_map()) == 1 or time.monotonic() - exited_at > DRAIN_SECONDS:
                    break  # every rank's line has ended (or the stragglers are killed)
            elif self.cancel_at is not None and time.monotonic() - self.cancel_at > CANCEL_GRACE_SECONDS:
                log.warning("the group did not stop %.0f s after a cancel: it is killed", CANCEL_GRACE_SECONDS)
                completed, summary = self.progress
                return RunResult("cancelled", completed, summary, None, 0.0)
        return self._outcome()

    def _outcome(self) -> RunResult:
        record = self.outcome or {"kind": None}
        if record["kind"] == "result":
            return RunResult(**{k: v for k, v in record.items() if k != "kind"})
        if record["kind"] == "error":
            code, message = record["code"], record["message"]
            if code == "out_of_memory":
                raise torch.OutOfMemoryError(message)
            if code == "internal":
                raise RuntimeError(message)
            error = TrainingError(message)
            error.code = code
            raise error
        raise RankFailed(
            f"a process of the group exited before the run ended (torchrun's exit status {self.proc.returncode}; "
            f"its output is in {self.log_path})"
        )

    def _accept(self) -> None:
        try:
            sock, _ = self.listener.accept()
        except BlockingIOError:
            return
        sock.setblocking(False)
        self.selector.register(sock, selectors.EVENT_READ, Peer(sock))

    def _read(self, peer: Peer, sink: TelemetrySink | None, should_cancel: Callable[[], bool]) -> None:
        try:
            data = peer.sock.recv(1 << 16)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:  # the rank's line ended: it exited
            self.selector.unregister(peer.sock)
            peer.sock.close()
            return
        *lines, peer.buffer = (peer.buffer + data).split(b"\n")
        for line in lines:
            record = json.loads(line)
            if peer.rank is None:
                self._hello(peer, record)
            elif peer is self.lead:
                self._handle(record, sink, should_cancel)

    def _hello(self, peer: Peer, record: dict[str, Any]) -> None:
        if record.get("kind") != "hello" or not hmac.compare_digest(str(record.get("token")), self.token):
            log.warning("a connection to the group's socket that is none of its ranks: closed")
            self.selector.unregister(peer.sock)
            peer.sock.close()
            return
        peer.rank = record["rank"]
        self.pids.add(record["pid"])
        if peer.rank == 0:
            self.lead = peer

    def _handle(self, record: dict[str, Any], sink: TelemetrySink | None, should_cancel: Callable[[], bool]) -> None:
        kind = record["kind"]
        if kind == "pulse":
            if should_cancel() and self.cancel_at is None:
                self.cancel_at = time.monotonic()
                with contextlib.suppress(OSError):  # rank 0 is gone: the group's end tells the rest
                    self.lead.sock.sendall(encode({"kind": "cancel"}))
        elif kind in ("result", "error"):
            self.outcome = record
        else:
            if kind == "metrics":
                self.progress = (record["completed"], record["summary"])
            if sink is not None:
                deliver(record, sink)

    # -- stopping ---------------------------------------------------------------------------------
    def kill(self) -> None:
        """Stop every process of the group still there (SIGTERM, then SIGKILL after a grace), and
        close the sockets: a rank left behind sees its line end and exits."""
        groups = [pid for pid in (self.proc.pid, *self.pids) if alive(pid)]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in groups:
                signal_group(pid, sig)
            deadline = time.monotonic() + KILL_GRACE_SECONDS
            while (groups := [pid for pid in groups if alive(pid)]) and time.monotonic() < deadline:
                self.proc.poll()  # reaps torchrun
                time.sleep(0.05)
            if not groups:
                break
        self.proc.wait()
        for key in list(self.selector.get_map().values()):
            key.fileobj.close()
        self.selector.close()


def signal_group(pid: int, sig: signal.Signals) -> None:
    """``sig`` to the process group ``pid`` leads (torchrun's, a rank's), or to ``pid`` alone."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, dead but not yet reaped by its parent, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # the id went to another user's process: ours is gone
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return True
