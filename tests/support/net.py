"""Loopback ports and waiting for a condition."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import TypeVar

import httpx

T = TypeVar("T")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def closed_port_url() -> str:
    """A loopback URL where nothing listens (a port just bound and released): connections are refused."""
    return f"http://127.0.0.1:{free_port()}"


def wait_for(predicate: Callable[[], T], timeout: float = 60.0, interval: float = 0.1) -> T:
    """The first truthy value ``predicate()`` returns, polled every ``interval`` seconds; fails the
    test after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError("condition not met in time")


def http_ready(url: str) -> bool:
    """Whether the service at ``url`` answers /readyz with 200."""
    try:
        return httpx.get(f"{url}/readyz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
