"""Running a job as a torch.distributed group: torchrun as a child process group, every rank watched.

torchrun (PyTorch's own launcher: c10d rendezvous, no restarts of its own) runs as a child process
group of this process. The ranks connect to a socket of this process (channel.py); rank 0's
telemetry goes into the caller's sink as though the trainer ran here, and its pulses drive
``should_cancel`` (which pulses a worker's lease). The group ends as one: a rank that dies ends it
(``RankFailed``: the job resumes from its latest checkpoint) unless every rank of the node had said
it was done, and a ``watch`` that raises (a lost lease), a failed sink or a cancel not honoured in
time kills every process of it. A job of several nodes runs one torchrun per node, meeting at node
0 (``Meeting``), which reports. docs/engine.md, "Several processes", has the whole protocol.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from contract.spec import TrainSpec
from contract.status import JobStatus

from .channel import ADDRESS_ENV, REPORT_ENV, REPORT_TOKEN_ENV, TOKEN_ENV, deliver, encode
from .config import job_config
from .device import resolve_device
from .outcome import NotEnoughGpus, RunResult, TrainingError
from .request import RunRequest
from .telemetry import TelemetrySink

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


@dataclass(frozen=True)
class Meeting:
    """Where the nodes of a job meet: node 0's c10d rendezvous, and its launcher's socket, which
    global rank 0 reports to."""

    rendezvous: str  # host:port
    run_id: str  # the rendezvous's id
    report: str  # host:port
    token: str


@dataclass(frozen=True)
class Node:
    """This process's node of a job of several (``resources.nnodes``)."""

    index: int  # 0: the node that hosts the rendezvous, hears rank 0 and records the outcome
    address: str  # where the other nodes reach this one
    # Node 0 passes its Meeting, the others None; returns the Meeting once every node is there.
    meet: Callable[[Meeting | None], Meeting]


def torchrun_command(
    nproc: int, rank_args: list[str], nnodes: int = 1, node: Node | None = None, meeting: Meeting | None = None
) -> list[str]:
    """torchrun with this interpreter: ``nproc`` ranks of RANK_MODULE on this node.

    With a c10d rendezvous (on a free local port for one node; node 0's for several, which node 0
    hosts), and no restarts (a failed group is this process's to handle).
    """
    rendezvous = ["--rdzv-endpoint", "127.0.0.1:0"]
    if node is not None and meeting is not None:
        is_host = f"is_host={int(node.index == 0)}"
        rendezvous = ["--rdzv-endpoint", meeting.rendezvous, "--rdzv-id", meeting.run_id, "--rdzv-conf", is_host]
        rendezvous += ["--local-addr", node.address]
    group = ["--nnodes", str(nnodes), "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d", *rendezvous]
    launcher = [sys.executable, "-m", "torch.distributed.run", *group, "--max-restarts", "0"]
    return [*launcher, "-m", RANK_MODULE, *rank_args]


def run_group(request: RunRequest) -> RunResult | None:
    """Train a job in a group of ``resources.nproc`` ranks (per node) launched and followed from here.

    The run's files go under ``request.out_dir`` (rank 0 writes them; torchrun's and the ranks'
    output goes to ``ranks.log``). Raises as the trainer would (TrainingError with its code, out of
    memory), or RankFailed. On a ``request.node`` other than 0 of a job of several, returns None
    once its ranks ended well (the outcome is node 0's). Every rank loads ``request.init_from``.
    """
    job, out_dir, node = job_config(request.spec), request.out_dir, request.node
    resources = job.resources
    check_gpus(job.train, resources.nproc)
    out_dir.mkdir(parents=True, exist_ok=True)
    suffix = f"-node{node.index}" if node is not None else ""  # the nodes may share the directory
    spec_path = out_dir / f"group-spec{suffix}.json"
    spec = request.spec if isinstance(request.spec, dict) else request.spec.model_dump(mode="json")
    spec_path.write_text(json.dumps(spec))
    args = ["--spec", str(spec_path), "--out", str(out_dir)]
    args += (["--corpus", str(request.corpus)] if request.corpus else []) + ([] if request.resume else ["--fresh"])
    args += ["--init-from", str(request.init_from)] if request.init_from else []
    reports = node is None or node.index == 0
    host = node.address if node is not None and reports else "127.0.0.1"
    group = Launch(host, out_dir / f"ranks{suffix}.log", resources.nproc)
    try:
        meeting = None
        if node is not None:
            mine = None  # node 0 says where it is met; the others learn it
            if reports:
                rendezvous = f"{node.address}:{free_port(node.address)}"
                mine = Meeting(rendezvous, secrets.token_hex(8), group.address, group.token)
            meeting = node.meet(mine)
        group.start(torchrun_command(resources.nproc, args, resources.nnodes, node, meeting), meeting)
        return group.follow(request.sink, request.should_cancel or (lambda: False), request.watch, reports)
    finally:
        group.kill()


def check_gpus(train: TrainSpec, nproc: int) -> None:
    """Fail a CUDA run at once, with the figures, when the node has fewer GPUs than ranks.

    A CUDA run puts each rank of a node on a GPU of its own (LOCAL_RANK's; nccl refuses two ranks
    on one device); failing at once beats starting ranks that fail at every restart.
    """
    device, _ = resolve_device(train)
    if device.type == "cuda" and nproc > (count := torch.cuda.device_count()):
        raise NotEnoughGpus(
            f"resources.nproc is {nproc}: each rank of a node needs a GPU of its own, and this worker has {count}"
        )


def free_port(host: str) -> int:
    """A port free on ``host`` now (for the rendezvous store torchrun binds next)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class Peer:
    """A rank's connection: its bytes not yet a whole line, and its rank once it said hello."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.buffer, self.rank, self.local = sock, b"", None, False


class Launch:
    """torchrun and its ranks, started and followed."""

    def __init__(self, host: str, log_path: Path, nproc: int) -> None:
        self.listener = socket.create_server((host, 0))
        self.listener.setblocking(False)
        self.address, self.token = f"{host}:{self.listener.getsockname()[1]}", secrets.token_hex(16)
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ)
        self.pids: set[int] = set()  # of the ranks that said hello
        self.nproc = nproc  # ranks on this node
        self.done: set[int] = set()  # this node's ranks whose share of the run is over
        self.lead: Peer | None = None
        self.outcome: dict[str, Any] | None = None  # rank 0's result or error record
        self.progress: tuple[int, dict[str, float]] = (0, {})  # steps completed and the summary, as last reported
        self.cancel_at: float | None = None

    def start(self, command: list[str], meeting: Meeting | None = None) -> None:
        """Start torchrun; its ranks reach this launcher (and ``meeting``'s, which rank 0 reports to)."""
        path = os.pathsep.join(p for p in (str(SOURCE_ROOT), os.environ.get("PYTHONPATH")) if p)
        env = os.environ | {ADDRESS_ENV: self.address, TOKEN_ENV: self.token, "PYTHONPATH": path}
        if meeting is not None:
            env |= {REPORT_ENV: meeting.report, REPORT_TOKEN_ENV: meeting.token}
        with self.log_path.open("ab") as out:
            self.proc = subprocess.Popen(
                command,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    # -- following ------------------------------------------------------------------------------
    def follow(
        self, sink: TelemetrySink | None, should_cancel: Callable[[], bool], watch, reports: bool = True
    ) -> RunResult | None:
        """Until torchrun has exited and the ranks' lines have ended; the run's outcome (None on a
        node that does not report, once its ranks ended well)."""
        proc = self.proc
        if proc is None:
            raise RuntimeError("the group was not started")
        exited_at = None
        while True:
            for key, _ in self.selector.select(POLL_SECONDS):
                if key.fileobj is self.listener:
                    self._accept()
                else:
                    self._read(key.data, sink, should_cancel)
            if watch is not None and self.outcome is None:
                watch()
            if proc.poll() is not None:
                exited_at = exited_at or time.monotonic()
                lines = [key.data for key in self.selector.get_map().values() if key.data is not None]
                # Every line has ended; or, after the drain, stragglers are killed, but rank 0 of
                # another node (it may still write the last checkpoint) is waited for.
                if not lines or (time.monotonic() - exited_at > DRAIN_SECONDS and self.lead not in lines):
                    break
            elif self.cancel_at is not None and time.monotonic() - self.cancel_at > CANCEL_GRACE_SECONDS:
                log.warning("the group did not stop %.0f s after a cancel: it is killed", CANCEL_GRACE_SECONDS)
                completed, summary = self.progress
                return RunResult(JobStatus.CANCELLED, completed, summary, None, 0.0)
        finished = len(self.done) == self.nproc
        if proc.returncode != 0 and finished:
            log.warning(
                "torchrun exited with status %s after every rank of the node was done: a fault while the group "
                "was torn down, not a lost rank (its output is in %s)",
                proc.returncode,
                self.log_path,
            )
        if not reports and (proc.returncode == 0 or finished):
            return None
        return self._outcome(proc.returncode)

    def _outcome(self, returncode: int | None) -> RunResult:
        record = self.outcome or {"kind": None}
        if record["kind"] == "result":
            return RunResult(**{k: v for k, v in record.items() if k != "kind"})
        if record["kind"] == "error":
            code, message = record["code"], record["message"]
            if code == "out_of_memory":
                raise torch.OutOfMemoryError(message)
            error = TrainingError(message)
            error.code = code
            raise error
        raise RankFailed(
            f"a process of the group exited before the run ended (torchrun's exit status {returncode}; "
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
            elif record.get("kind") == "done":
                if peer.local:
                    self.done.add(peer.rank)
            elif peer is self.lead:
                self._handle(peer, record, sink, should_cancel)

    def _hello(self, peer: Peer, record: dict[str, Any]) -> None:
        if record.get("kind") != "hello" or not hmac.compare_digest(str(record.get("token")), self.token):
            log.warning("a connection to the group's socket that is none of its ranks: closed")
            self.selector.unregister(peer.sock)
            peer.sock.close()
            return
        peer.rank, peer.local = record["rank"], bool(record["local"])
        if peer.local:  # a process of this node's (rank 0 of another also reports here)
            self.pids.add(record["pid"])
        if record["reports"]:
            self.lead = peer

    def _handle(
        self, lead: Peer, record: dict[str, Any], sink: TelemetrySink | None, should_cancel: Callable[[], bool]
    ) -> None:
        kind = record["kind"]
        if kind == "pulse":
            if should_cancel() and self.cancel_at is None:
                self.cancel_at = time.monotonic()
                with contextlib.suppress(OSError):  # rank 0 is gone: the group's end tells the rest
                    lead.sock.sendall(encode({"kind": "cancel"}))
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
        if self.proc is not None:
            self._stop(self.proc)
        for key in list(self.selector.get_map().values()):
            if isinstance(key.fileobj, socket.socket):  # the listener and the ranks' lines: all there is
                key.fileobj.close()
        self.selector.close()

    def _stop(self, proc: subprocess.Popen) -> None:
        """SIGTERM, then SIGKILL after a grace, to torchrun's and the ranks' process groups still there."""
        groups = [pid for pid in (proc.pid, *self.pids) if alive(pid)]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in groups:
                signal_group(pid, sig)
            deadline = time.monotonic() + KILL_GRACE_SECONDS
            while (groups := [pid for pid in groups if alive(pid)]) and time.monotonic() < deadline:
                proc.poll()  # reaps torchrun
                time.sleep(0.05)
            if not groups:
                break
        proc.wait()


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
