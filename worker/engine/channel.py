"""The line between a job's ranks and the process that launched their group (launch.run_group).

Every rank connects to its node's launcher and says who it is (rank, pid, the launch's token);
rank 0 then streams what the trainer hands its sink, a pulse before its steps and the run's
outcome, as JSON lines, and the launcher answers ``cancel`` when the job is to stop. Every rank
says ``done`` to its own node's launcher once its share of the run is over, before it leaves the
group: a fault while the group is torn down then cannot pass for a rank lost mid-run. In a job of
several nodes rank 0 streams to node 0's launcher (the reporting one), wherever the rendezvous put
it, over a second line when that is not its own node's. A rank whose launcher is gone (a line
ends) exits at once: nothing outlives the attempt that started it.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .outcome import RunResult
from .telemetry import Report, TelemetrySink

ADDRESS_ENV = "MUONFORGE_GROUP_ADDRESS"  # host:port of the node's launcher's socket
TOKEN_ENV = "MUONFORGE_GROUP_TOKEN"  # proves a connection is one of this launch's ranks
REPORT_ENV = "MUONFORGE_GROUP_REPORT"  # host:port of the reporting launcher's socket, where it is another
REPORT_TOKEN_ENV = "MUONFORGE_GROUP_REPORT_TOKEN"
PULSE_SECONDS = 0.25  # rank 0 asks whether to stop at most this often (the launcher pulses the lease)
ORPHANED_EXIT = 75  # a rank's exit status once its launcher is gone


def encode(record: dict[str, Any]) -> bytes:
    return json.dumps(record).encode() + b"\n"


class RankChannel:
    """A rank's end of the line; on rank 0 also the trainer's sink and its should_cancel."""

    def __init__(self, address: str, token: str, rank: int, report: tuple[str, str] | None = None) -> None:
        """``address``, ``token``: the node's launcher; ``report``: the reporting launcher's, when
        it is another (rank 0 of a job of several nodes)."""
        self._cancel, self._closing = threading.Event(), False
        self._pulsed = 0.0
        lead = rank == 0
        elsewhere = report if report is not None and report[0] != address else None
        self._lines = [self._connect(address, token, rank, local=True, reports=lead and elsewhere is None)]
        if lead and elsewhere is not None:
            report_address, report_token = elsewhere
            self._lines.append(self._connect(report_address, report_token, rank, local=False, reports=True))
        self._sock = self._lines[-1]  # what rank 0 reports on

    def _connect(self, address: str, token: str, rank: int, local: bool, reports: bool) -> socket.socket:
        host, port = address.rsplit(":", 1)
        sock = socket.create_connection((host, int(port)), timeout=30)
        sock.settimeout(None)
        hello = {"kind": "hello", "rank": rank, "pid": os.getpid(), "token": token, "local": local, "reports": reports}
        sock.sendall(encode(hello))
        threading.Thread(target=self._listen, args=(sock,), name="launcher", daemon=True).start()
        return sock

    def _send(self, record: dict[str, Any]) -> None:
        self._sock.sendall(encode(record))

    def _listen(self, sock: socket.socket) -> None:
        """Take ``cancel``; once a line ends its launcher is gone (killed, or it stopped the
        group): leave now, without the interpreter's teardown."""
        with sock.makefile("rb") as lines:
            try:
                for line in lines:
                    if json.loads(line).get("kind") == "cancel":
                        self._cancel.set()
            except (OSError, ValueError):
                pass
        if not self._closing:
            print("the process that launched this group is gone: exiting", file=sys.stderr, flush=True)
            os._exit(ORPHANED_EXIT)

    # -- the engine's TelemetrySink (rank 0) ------------------------------------------------------
    def metrics(self, report: Report) -> None:
        self._send({"kind": "metrics", **asdict(report)})

    def checkpoint(self, step: int, path: Path, nbytes: int, metrics: dict[str, float]) -> None:
        self._send({"kind": "checkpoint", "step": step, "path": str(path), "bytes": nbytes, "metrics": metrics})

    def log(self, level: str, message: str) -> None:
        self._send({"kind": "log", "level": level, "message": message})

    def sample(self, step: int, prompt: str, text: str) -> None:
        self._send({"kind": "sample", "step": step, "prompt": prompt, "text": text})

    def routing(self, table: Mapping[str, Any]) -> None:
        """The job's parameter routing table (optimizer.routing_table), for the launcher's sink."""
        self._send({"kind": "routing", "table": table})

    def should_cancel(self) -> bool:
        """Asked before every step: a pulse to the launcher now and then, and its answer so far."""
        now = time.monotonic()
        if now - self._pulsed >= PULSE_SECONDS:
            self._pulsed = now
            self._send({"kind": "pulse"})
        return self._cancel.is_set()

    # -- the outcome (rank 0) -----------------------------------------------------------------------
    def result(self, result: RunResult) -> None:
        self._send({"kind": "result", **asdict(result)})

    def error(self, code: str, message: str) -> None:
        self._send({"kind": "error", "code": code, "message": message})

    # -- every rank ---------------------------------------------------------------------------------
    def done(self) -> None:
        """This rank's share of the run is over (trained, or stopped with the group's error)."""
        self._lines[0].sendall(encode({"kind": "done"}))

    def close(self) -> None:
        self._closing = True
        for sock in self._lines:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # ends the listening thread's read
            sock.close()


def deliver(record: dict[str, Any], sink: TelemetrySink) -> None:
    """Hand a record of rank 0's telemetry to the launcher's sink, as the trainer would have."""
    kind = record["kind"]
    if kind == "metrics":
        sink.metrics(Report(record["step"], record["values"], record["completed"], record["summary"]))
    elif kind == "checkpoint":
        sink.checkpoint(record["step"], Path(record["path"]), record["bytes"], record["metrics"])
    elif kind == "log":
        sink.log(record["level"], record["message"])
    elif kind == "sample":
        sink.sample(record["step"], record["prompt"], record["text"])
    elif kind == "routing" and callable(keep := getattr(sink, "routing", None)):
        keep(record["table"])  # a sink that keeps no table (a progress bar) is not handed one
