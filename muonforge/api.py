"""The HTTP API as the clients see it, described once for Client and AsyncClient.

It holds the job statuses, one ``Call`` per endpoint (what to send, whether it may be sent again,
how its answer is read), and the Server-Sent Events parser.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import httpx

from contract import status
from contract.status import JobStatus, SweepStatus
from muonforge.retry import Repeat

# The contract's statuses as plain strings (argparse shows its choices' repr).
STATUSES = tuple(s.value for s in JobStatus)
ACTIVE = tuple(s.value for s in JobStatus if s in status.ACTIVE)
FINISHED = tuple(s.value for s in JobStatus if s in status.FINISHED)  # terminal: such a job never changes again
SWEEP_STATUSES = tuple(s.value for s in SweepStatus)

# The server pings an open events stream every 15 s: a minute without a byte is a dead connection.
STREAM_TIMEOUT = httpx.Timeout(30.0, read=60.0)
# An upload's completion reads the whole file on the server before it answers (177 MB/s for a text
# dataset on a 2-core host): its answer is waited for as long as reading the file at this rate takes.
COMPLETION_BYTES_PER_S = 20e6
COMPLETION_MIN_S = 30.0
COMPLETION_POLL_S = 1.0  # how often a completion whose answer did not come is read (the clients' _complete)
UPLOAD_NOT_PENDING = "upload_not_pending"  # 409: the upload is completing, completed or ended


def _same(body: Any) -> Any:
    return body


@dataclass(frozen=True)
class Call:
    """One request: method, path, query, body and headers, and how its answer is read.

    ``repeat`` says whether it may be sent again after a failure; ``answers`` lists non-2xx
    statuses that are answers rather than errors; ``result`` turns the JSON body into what the
    client method returns.
    """

    method: str
    path: str
    params: dict[str, Any] | None = None
    json: Any = None
    headers: dict[str, str] | None = None
    files: dict[str, Any] | None = None
    data: dict[str, Any] | None = None
    content: Any = None
    timeout: httpx.Timeout | None = None
    repeat: Repeat = Repeat.SAFE
    answers: tuple[int, ...] = ()
    result: Callable[[Any], Any] = _same

    def request(self) -> dict[str, Any]:
        """The keyword arguments of httpx's ``stream()``."""
        sent = {k: getattr(self, k) for k in ("params", "json", "headers", "files", "data", "content", "timeout")}
        return {"method": self.method, "url": self.path, **{k: v for k, v in sent.items() if v is not None}}

    @property
    def what(self) -> str:
        return f"{self.method} {self.path}"


def _id(value: str) -> str:
    """An id as one path segment: an id typed as "../x" cannot reach another route."""
    return quote(str(value), safe="")


def _query(**params: Any) -> dict[str, Any]:
    return {k: v for k, v in params.items() if v is not None}


# -- jobs -----------------------------------------------------------------------------------------
def create_job(spec: dict[str, Any], idempotency_key: str | None = None) -> Call:
    # Without the caller's key, a fresh one per call: the server answers a repeat of the same key
    # and body with the job it created, so a retried POST never creates a second job.
    key = idempotency_key or f"mf-{uuid.uuid4().hex}"
    return Call("POST", "/v1/jobs", json=spec, headers={"Idempotency-Key": key})


def get_job(job_id: str) -> Call:
    return Call("GET", f"/v1/jobs/{_id(job_id)}")


def jobs_page(status: str | None, limit: int, after: str | None) -> Call:
    return Call("GET", "/v1/jobs", params=_query(status=status, limit=limit, after=after))


def cancel_job(job_id: str) -> Call:
    # Not repeated after an unanswered attempt: had it cancelled a queued job, the repeat would
    # answer 409 (already finished).
    return Call("POST", f"/v1/jobs/{_id(job_id)}/cancel", repeat=Repeat.UNSENT)


def job_metrics(
    job_id: str, names: Iterable[str] | None, max_points: int, from_step: int | None, to_step: int | None
) -> Call:
    params = _query(
        names=",".join(names) if names is not None else None,
        max_points=max_points,
        from_step=from_step,
        to_step=to_step,
    )
    return Call(
        "GET",
        f"/v1/jobs/{_id(job_id)}/metrics",
        params=params,
        result=lambda body: {s["name"]: s["points"] for s in body["series"]},
    )


def job_events(job_id: str, last_event_id: str | None) -> Call:
    headers = {"Last-Event-ID": last_event_id} if last_event_id else None
    return Call("GET", f"/v1/jobs/{_id(job_id)}/events", headers=headers, timeout=STREAM_TIMEOUT)


def checkpoints_page(job_id: str, after: str | None) -> Call:
    return Call("GET", f"/v1/jobs/{_id(job_id)}/checkpoints", params=_query(limit=100, after=after))


def checkpoint_file(job_id: str, step: int, file_format: str = "pt") -> Call:
    params = {"format": file_format} if file_format != "pt" else None
    return Call("GET", f"/v1/jobs/{_id(job_id)}/checkpoints/{int(step)}", params=params)


# -- datasets -------------------------------------------------------------------------------------
def upload_dataset(filename: str, reader: Any, name: str | None) -> Call:
    # A repeat after a lost answer may store the corpus twice (two ids, one sha256), which is
    # harmless; a body that cannot be read again from its start is never repeated.
    repeat = Repeat.SAFE if reader.seekable() else Repeat.NEVER
    return Call("POST", "/v1/datasets", files={"file": (filename, reader)}, data=_query(name=name), repeat=repeat)


def datasets_page(limit: int, after: str | None) -> Call:
    return Call("GET", "/v1/datasets", params=_query(limit=limit, after=after))


def get_dataset(dataset_id: str) -> Call:
    return Call("GET", f"/v1/datasets/{_id(dataset_id)}")


def delete_dataset(dataset_id: str) -> Call:
    # Not repeated after an unanswered attempt: had it deleted the dataset, the repeat would
    # answer 404.
    return Call("DELETE", f"/v1/datasets/{_id(dataset_id)}", repeat=Repeat.UNSENT)


# -- models ---------------------------------------------------------------------------------------
def upload_model(filename: str, reader: Any, name: str | None) -> Call:
    # As a dataset's: a repeat after a lost answer may store the model twice, which is harmless.
    repeat = Repeat.SAFE if reader.seekable() else Repeat.NEVER
    return Call("POST", "/v1/models", files={"file": (filename, reader)}, data=_query(name=name), repeat=repeat)


def models_page(limit: int, after: str | None) -> Call:
    return Call("GET", "/v1/models", params=_query(limit=limit, after=after))


def get_model(model_id: str) -> Call:
    return Call("GET", f"/v1/models/{_id(model_id)}")


def delete_model(model_id: str) -> Call:
    # Not repeated after an unanswered attempt: had it deleted the model, the repeat would answer 404.
    return Call("DELETE", f"/v1/models/{_id(model_id)}", repeat=Repeat.UNSENT)


# -- resumable uploads ----------------------------------------------------------------------------
def create_upload(purpose: str, filename: str, nbytes: int, name: str | None) -> Call:
    # Not repeated after an unanswered attempt: a repeat would start a second upload.
    body = {"purpose": purpose, "filename": filename, "bytes": nbytes, **_query(name=name)}
    return Call("POST", "/v1/uploads", json=body, repeat=Repeat.UNSENT)


def get_upload(upload_id: str) -> Call:
    return Call("GET", f"/v1/uploads/{_id(upload_id)}")


def put_part(upload_id: str, number: int, content: Any, nbytes: int) -> Call:
    # The body is read from the file as it is sent: the client sends the part again itself.
    headers = {"Content-Type": "application/octet-stream", "Content-Length": str(nbytes)}
    return Call(
        "PUT",
        f"/v1/uploads/{_id(upload_id)}/parts/{int(number)}",
        content=content,
        headers=headers,
        repeat=Repeat.NEVER,
    )


def complete_upload(upload_id: str, parts: list[tuple[int, str]], size: int) -> Call:
    # Not repeated after an unanswered attempt: the client reads the upload to learn what happened.
    body = {"parts": [{"number": n, "sha256": sha256} for n, sha256 in parts]}
    return Call(
        "POST",
        f"/v1/uploads/{_id(upload_id)}/complete",
        json=body,
        timeout=httpx.Timeout(COMPLETION_MIN_S, read=completion_seconds(size)),
        repeat=Repeat.UNSENT,
    )


def completion_seconds(size: int) -> float:
    """How long a completion of ``size`` bytes may take to answer: the file read at COMPLETION_BYTES_PER_S."""
    return max(COMPLETION_MIN_S, size / COMPLETION_BYTES_PER_S)


# -- webhooks -------------------------------------------------------------------------------------
def create_webhook(url: str, events: Iterable[str]) -> Call:
    # Not repeated after an unanswered attempt: had it created the endpoint, a repeat would make a
    # second one (with another secret).
    return Call("POST", "/v1/webhooks", json={"url": url, "events": list(events)}, repeat=Repeat.UNSENT)


def webhooks_page(limit: int, after: str | None) -> Call:
    return Call("GET", "/v1/webhooks", params=_query(limit=limit, after=after))


def get_webhook(webhook_id: str) -> Call:
    return Call("GET", f"/v1/webhooks/{_id(webhook_id)}")


def delete_webhook(webhook_id: str) -> Call:
    # Not repeated after an unanswered attempt: had it deleted the endpoint, the repeat would answer 404.
    return Call("DELETE", f"/v1/webhooks/{_id(webhook_id)}", repeat=Repeat.UNSENT)


def deliveries_page(webhook_id: str, limit: int, after: str | None) -> Call:
    return Call("GET", f"/v1/webhooks/{_id(webhook_id)}/deliveries", params=_query(limit=limit, after=after))


# -- sweeps ---------------------------------------------------------------------------------------
def create_sweep(spec: dict[str, Any], idempotency_key: str | None = None) -> Call:
    # As for a job: a fresh key per call unless the caller gives one, so a retried POST answers
    # with the sweep the first attempt created instead of starting a second one.
    key = idempotency_key or f"mf-{uuid.uuid4().hex}"
    return Call("POST", "/v1/sweeps", json=spec, headers={"Idempotency-Key": key})


def sweeps_page(status: str | None, limit: int, after: str | None) -> Call:
    return Call("GET", "/v1/sweeps", params=_query(status=status, limit=limit, after=after))


def get_sweep(sweep_id: str) -> Call:
    return Call("GET", f"/v1/sweeps/{_id(sweep_id)}")


def cancel_sweep(sweep_id: str) -> Call:
    return Call("POST", f"/v1/sweeps/{_id(sweep_id)}/cancel", repeat=Repeat.UNSENT)


# -- health ---------------------------------------------------------------------------------------
def healthz() -> Call:
    return Call("GET", "/healthz")


def readyz() -> Call:
    # 503 is the report of a server that is up but not ready: returned, not raised or retried.
    return Call("GET", "/readyz", answers=(503,))


# -- events ---------------------------------------------------------------------------------------
@dataclass
class Event:
    """One Server-Sent Event: its type, id (None for ``done``) and JSON data."""

    event: str
    id: str | None
    data: Any


class SseParser:
    """Lines of a text/event-stream in, Events out (comments, such as pings, skipped).
    ``last_event_id`` outlives a connection: it is what a reconnect sends as Last-Event-ID."""

    def __init__(self, last_event_id: str | None = None) -> None:
        self.last_event_id = last_event_id
        self.connect()

    def connect(self) -> None:
        """A new connection: drop the part of an event the old one was cut in."""
        self._fields: dict[str, str] = {}
        self._data: list[str] = []

    def feed(self, line: str) -> Event | None:
        if not line:
            event = None
            if self._data:
                kind, event_id = self._fields.get("event", "message"), self._fields.get("id")
                event = Event(kind, event_id, json.loads("\n".join(self._data)))
                self.last_event_id = event_id or self.last_event_id
            self.connect()
            return event
        if not line.startswith(":"):
            name, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if name == "data":
                self._data.append(value)
            else:
                self._fields[name] = value
        return None
