"""A real HTTP server on a loopback address whose answers a test scripts: the outer boundary of the
clients' retry tests (503s, 429s, answers lost on the way back) and a webhook receiver."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]  # lower-case names
    body: bytes


@dataclass
class Reply:
    status: int = 200
    body: Any = field(default_factory=dict)  # JSON, or bytes sent as they are
    headers: dict[str, str] = field(default_factory=dict)


DROP = "drop"  # close the connection without answering


class StubServer:
    """Every request is recorded in ``requests`` and answered by ``handler(request)``: a Reply,
    DROP, or byte chunks sent as a stream (a list, or an iterator whose chunks are sent as they
    come); the connection then closes."""

    def __init__(
        self, handler: Callable[[Request], Reply | str | list[bytes] | Iterator[bytes]], host: str = "127.0.0.1"
    ) -> None:
        self.requests: list[Request] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def answer(self) -> None:
                request = Request(self.command, self.path, {k.lower(): v for k, v in self.headers.items()}, self.body())
                stub.requests.append(request)
                reply = handler(request)
                if reply == DROP:
                    self.close_connection = True
                elif not isinstance(reply, Reply):
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Connection", "close")
                    self.end_headers()
                    try:
                        for chunk in reply:
                            self.wfile.write(chunk)
                            self.wfile.flush()
                    except OSError:  # the client went away
                        pass
                    self.close_connection = True
                else:
                    body = reply.body if isinstance(reply.body, bytes) else json.dumps(reply.body).encode()
                    self.send_response(reply.status)
                    for name, value in {"Content-Type": "application/json", **reply.headers}.items():
                        self.send_header(name, value)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    try:
                        self.wfile.write(body)
                    except OSError:  # the client went away (a test's Ctrl-C)
                        self.close_connection = True

            def body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    chunks = []
                    while size := int(self.rfile.readline().split(b";")[0], 16):
                        chunks.append(self.rfile.read(size))
                        self.rfile.readline()
                    self.rfile.readline()
                    return b"".join(chunks)
                return self.rfile.read(int(self.headers.get("Content-Length", 0)))

            do_GET = do_POST = do_DELETE = answer

        self._server = ThreadingHTTPServer((host, 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://{host}:{self._server.server_address[1]}"

    def __enter__(self) -> StubServer:
        threading.Thread(target=self._server.serve_forever, args=(0.01,), daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()


def scripted(*replies: Reply | str, then: Reply | None = None) -> Callable[[Request], Reply | str]:
    """A handler that gives ``replies`` in turn, then ``then`` (by default the last reply) forever."""
    queue = list(replies)

    def handle(request: Request) -> Reply | str:
        return queue.pop(0) if queue else (then or replies[-1])

    return handle
