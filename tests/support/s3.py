"""An S3-compatible server for the store's tests: moto's threaded server on 127.0.0.1, or the
external one MUONFORGE_TEST_S3_URL names (s3://bucket/prefix, with the AWS_* variables set)."""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from tests.support.net import free_port

EXTERNAL = os.environ.get("MUONFORGE_TEST_S3_URL")
BUCKET = "muonforge-test"
MOTO_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1"}


@dataclass
class S3Server:
    """Where the tests' bucket is: its URL (s3://bucket/prefix), the AWS environment that reaches it,
    and for moto the server itself, which a test may stop and start again (its objects survive)."""

    url: str
    env: dict[str, str]
    moto: Any = field(default=None, repr=False)

    def scoped(self, name: str) -> str:
        """A URL under this one that no other test shares."""
        return f"{self.url.rstrip('/')}/{name}-{secrets.token_hex(4)}"

    def stop(self) -> None:
        """Stop the server (moto only): requests are refused until :meth:`start`."""
        self.moto.stop()

    def start(self) -> None:
        """Start the stopped server again on the same port."""
        self.moto.start()


def moto_server() -> tuple[Any, str]:
    """moto's threaded S3 server on a free loopback port, started; and its endpoint URL."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    return server, f"http://127.0.0.1:{port}"


def external_env() -> dict[str, str]:
    """The AWS variables of this process, for an external server."""
    return {name: value for name, value in os.environ.items() if name.startswith("AWS_")}


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """An S3 bucket for this test session: MUONFORGE_TEST_S3_URL's, or a bucket on moto's server
    on 127.0.0.1 (created here, gone with the server)."""
    if EXTERNAL:
        yield S3Server(EXTERNAL, external_env())
        return
    server, endpoint = moto_server()
    try:
        httpx.put(f"{endpoint}/{BUCKET}", timeout=10).raise_for_status()
        env = {**MOTO_ENV, "AWS_ENDPOINT_URL": endpoint}
        yield S3Server(f"s3://{BUCKET}/tests", env, server)
    finally:
        server.stop()
