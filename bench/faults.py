"""Servers a bench can break: a TCP proxy in front of Postgres that drops every connection and
refuses new ones for a while (a restart, an outage), and a throwaway redis-server that can be
killed, restarted on the same port, paused and resumed. tests/service/test_outages.py uses the
same TcpProxy."""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import redis


class TcpProxy:
    """Forwards 127.0.0.1:``port`` to ``upstream``; ``cut()`` closes every connection and refuses
    new ones until ``restore()``."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._open = threading.Event()
        self._open.set()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.dropped = 0  # connections closed by cut()
        self.refused = 0  # connections refused while cut
        threading.Thread(target=self._accept, daemon=True).start()

    def cut(self) -> None:
        self._open.clear()
        with self._lock:
            conns, self._conns = self._conns, set()
        self.dropped += len(conns) // 2  # a client's socket and its server's
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()

    def restore(self) -> None:
        self._open.set()

    def close(self) -> None:
        self.cut()
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if not self._open.is_set():
                self.refused += 1
                client.close()  # refused: the server is down
                continue
            try:
                server = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            with self._lock:
                self._conns |= {client, server}
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for conn in (src, dst):
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
            with self._lock:
                self._conns -= {src, dst}


class RedisServer:
    """A redis-server of its own on ``port``, its data in ``directory``, with an append-only
    file as in the deployment (docker-compose.yml): a kill -9 loses at most the last second of
    writes. ``kill()`` then ``start()`` is a crash and a restart on the same port; ``pause()``
    (SIGSTOP: connections stay open, nothing answers) and ``resume()``."""

    def __init__(self, port: int, directory: Path, log: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("needs a redis-server binary on PATH")
        self.binary, self.port, self.directory, self.log = binary, port, directory, log
        self.directory.mkdir(parents=True, exist_ok=True)
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 20.0) -> None:
        """Start (or restart) the server; returns once it answers PING (its data loaded)."""
        args = ["--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.directory), "--save", ""]
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [self.binary, *args, "--appendonly", "yes"], stdout=log, stderr=subprocess.STDOUT
            )
        client = redis.Redis.from_url(self.url, socket_timeout=1, socket_connect_timeout=1)
        deadline = time.monotonic() + timeout
        while True:
            try:
                if client.ping():
                    return
            except redis.RedisError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start; see {self.log}")
            time.sleep(0.05)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
