"""Limits before work, on a real server: a body over its limit is refused with 413 before it is
read, and a request without a valid key is refused with 401 before its body is read."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import httpx
import pytest

from tests.support.api import new_key
from tests.support.services import running_api
from tests.support.specs import tiny_spec

pytestmark = pytest.mark.system  # its tests start processes: the service's, torchrun's or a command's

UPLOAD_LIMIT = 100_000


@pytest.fixture(scope="module")
def small_api(settings, tmp_path_factory):
    """An API whose limits are small enough to pass in a test: 1 MiB JSON, 100 kB uploads."""
    with running_api(
        settings,
        tmp_path_factory.mktemp("small-api"),
        MUONFORGE_MAX_BODY_BYTES=str(1 << 20),
        MUONFORGE_UPLOAD_LIMIT_BYTES=str(UPLOAD_LIMIT),
    ) as url:
        yield url


def raw_request(url: str, head: str, body: bytes = b"") -> tuple[int, dict]:
    """Send a request's head (and the start of its body) and read the answer without sending
    the rest: a server that waits for the whole body times out here instead of answering."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head.replace("\n", "\r\n").encode() + b"\r\n" + body)
        answer = b""
        try:
            while b"\r\n\r\n" not in answer or not _complete(answer):
                chunk = sock.recv(65536)
                if not chunk:
                    break
                answer += chunk
        except TimeoutError:
            pytest.fail(f"no answer before the body was sent (got {answer[:200]!r})")
    status = int(answer.split(b" ", 2)[1])
    return status, json.loads(answer.split(b"\r\n\r\n", 1)[1])


def _complete(answer: bytes) -> bool:
    head, _, body = answer.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return len(body) >= int(line.split(b":")[1])
    return False


def test_a_declared_1gb_body_without_a_key_is_refused_before_it_is_read(small_api):
    head = f"POST /v1/jobs HTTP/1.1\nHost: x\nContent-Type: application/json\nContent-Length: {10**9}\n"
    status, body = raw_request(small_api, head)
    assert status == 413 and body["error"]["code"] == "payload_too_large"
    assert "1,048,576 bytes" in body["error"]["message"]


def test_a_streamed_body_without_a_valid_key_is_refused_before_it_is_read(small_api):
    for auth in ("", "Authorization: Bearer mf_not-a-key\n"):
        head = f"POST /v1/jobs HTTP/1.1\nHost: x\nContent-Type: application/json\n{auth}Transfer-Encoding: chunked\n"
        status, body = raw_request(small_api, head, b'5\r\n{"a":\r\n')  # the body never ends
        assert status == 401 and body["error"]["code"] == "unauthorized"
    multipart = "Content-Type: multipart/form-data; boundary=b"
    head = f"POST /v1/datasets HTTP/1.1\nHost: x\n{multipart}\nContent-Length: {UPLOAD_LIMIT}\n"
    status, body = raw_request(small_api, head, b"--b\r\n")
    assert status == 401


def test_a_streamed_json_body_over_the_limit_is_refused(small_api, settings):
    key = new_key(settings)
    # Chunked, so there is no Content-Length to check: the server counts, and answers once 1.5 MB
    # have come, while the body has not ended.
    head = (
        "POST /v1/jobs HTTP/1.1\nHost: x\nContent-Type: application/json\n"
        f"Authorization: Bearer {key}\nTransfer-Encoding: chunked\n"
    )
    chunk = b"x" * 60_000
    status, body = raw_request(small_api, head, b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(25)))
    assert status == 413 and body["error"]["code"] == "payload_too_large"
    # Within the limit the same key submits as usual (the tenant authenticated once, up front).
    r = httpx.post(f"{small_api}/v1/jobs", json=tiny_spec(), headers={"Authorization": f"Bearer {key}"}, timeout=30)
    assert r.status_code == 201, r.text


def test_an_upload_over_the_limit_is_refused_while_streaming(small_api, settings, tmp_path: Path):
    headers = {"Authorization": f"Bearer {new_key(settings)}"}
    big = tmp_path / "big.txt"
    big.write_bytes(b"a" * (UPLOAD_LIMIT * 40))
    with big.open("rb") as f:
        r = httpx.post(f"{small_api}/v1/datasets", files={"file": ("big.txt", f)}, headers=headers, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"
    # Just over the limit inside the multipart framing: the exact count of the file's bytes decides.
    r = httpx.post(
        f"{small_api}/v1/datasets", files={"file": ("edge.txt", b"a" * (UPLOAD_LIMIT + 1))}, headers=headers, timeout=30
    )
    assert r.status_code == 413 and r.json()["error"]["param"] == "file"
    r = httpx.post(f"{small_api}/v1/datasets", files={"file": ("ok.txt", b"a" * UPLOAD_LIMIT)}, headers=headers)
    assert r.status_code == 201 and r.json()["bytes"] == UPLOAD_LIMIT


def test_requests_in_flight_with_an_uncached_key_share_one_lookup(settings, monkeypatch):
    """When a busy key is not in the cache (its entry expired), the requests in flight with it
    wait for one lookup instead of each taking a thread and a query."""
    import asyncio
    import threading
    import time

    from app.api import limits
    from app.main import create_app

    key = new_key(settings)
    lookups, original = [], limits.authenticated

    def counted(*args):
        lookups.append(threading.get_ident())
        time.sleep(0.2)  # a slow database: every request arrives while the first lookup runs
        return original(*args)

    monkeypatch.setattr(limits, "authenticated", counted)

    async def burst() -> list[int]:
        transport = httpx.ASGITransport(app=create_app(settings))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            headers = {"Authorization": f"Bearer {key}"}
            answers = await asyncio.gather(*(client.get("/v1/jobs", headers=headers) for _ in range(20)))
        return [r.status_code for r in answers]

    assert asyncio.run(burst()) == [200] * 20
    assert len(lookups) == 1
