"""The Python client: ``from muonforge import Client``.

client = Client()                      # MUONFORGE_API_URL, MUONFORGE_API_KEY
job = client.create_job(spec_dict)     # a JobSpec as a dict
for event in client.events(job["id"]): # live: status, metrics, checkpoint, log ... done
    print(event.event, event.data)
job = client.wait(job["id"])           # polls until the job finishes
history = client.metrics(job["id"], names=["loss", "val_loss"], max_points=500)
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

FINISHED = ("succeeded", "failed", "cancelled")


class ApiError(RuntimeError):
    """An error answer of the API: ``status``, ``code``, ``message``, ``param``."""

    def __init__(self, status: int, code: str, message: str, param: str | None) -> None:
        super().__init__(f"{status} {code}: {message}" + (f" ({param})" if param else ""))
        self.status, self.code, self.message, self.param = status, code, message, param


@dataclass
class Event:
    """One Server-Sent Event: its type, id (None for ``done``) and JSON data."""

    event: str
    id: str | None
    data: Any


def parse_sse(lines: Iterable[str]) -> Iterator[Event]:
    """Events from the lines of a text/event-stream (comments, such as pings, skipped)."""
    fields: dict[str, str] = {}
    data: list[str] = []
    for line in lines:
        if not line:
            if data:
                yield Event(fields.get("event", "message"), fields.get("id"), json.loads("\n".join(data)))
            fields, data = {}, []
        elif not line.startswith(":"):
            name, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if name == "data":
                data.append(value)
            else:
                fields[name] = value


class Client:
    def __init__(self, url: str | None = None, api_key: str | None = None, timeout: float = 30.0) -> None:
        url = url or os.environ.get("MUONFORGE_API_URL", "http://127.0.0.1:8000")
        key = api_key or os.environ.get("MUONFORGE_API_KEY")
        if not key:
            raise ValueError("no API key: pass api_key= or set MUONFORGE_API_KEY")
        self._http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=timeout)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    # -- jobs -------------------------------------------------------------------------------------
    def create_job(self, spec: dict[str, Any], idempotency_key: str | None = None) -> dict[str, Any]:
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return self._call("POST", "/v1/jobs", json=spec, headers=headers)

    def get_job(self, job_id: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/jobs/{job_id}")

    def cancel_job(self, job_id: str) -> dict[str, Any]:
        return self._call("POST", f"/v1/jobs/{job_id}/cancel")

    def list_jobs(self, status: str | None = None, limit: int = 100) -> Iterator[dict[str, Any]]:
        """Every job, newest first, following the pages."""
        after = None
        while True:
            params = {"limit": limit, **({"status": status} if status else {}), **({"after": after} if after else {})}
            page = self._call("GET", "/v1/jobs", params=params)
            yield from page["data"]
            if not page["has_more"]:
                return
            after = page["next_after"]

    def wait(
        self, job_id: str, poll: float = 1.0, on_update: Callable[[dict[str, Any]], None] | None = None
    ) -> dict[str, Any]:
        """Poll until the job is succeeded, failed or cancelled; returns the final Job."""
        while True:
            job = self.get_job(job_id)
            if on_update:
                on_update(job)
            if job["status"] in FINISHED:
                return job
            time.sleep(poll)

    def events(self, job_id: str, last_event_id: str | None = None, reconnect: bool = True) -> Iterator[Event]:
        """The job's events (``GET /v1/jobs/{id}/events``) until ``done``, after ``last_event_id``
        if given. A dropped connection is resumed from the last id received, as a browser's
        EventSource does."""
        while True:
            headers = {"Last-Event-ID": last_event_id} if last_event_id else {}
            timeout = httpx.Timeout(30.0, read=60.0)  # the server pings every 15 s
            try:
                with self._http.stream("GET", f"/v1/jobs/{job_id}/events", headers=headers, timeout=timeout) as r:
                    if not r.is_success:
                        r.read()
                        self._raise(r)
                    for event in parse_sse(r.iter_lines()):
                        last_event_id = event.id or last_event_id
                        yield event
                        if event.event == "done":
                            return
            except httpx.TransportError:
                if not reconnect:
                    raise
                time.sleep(1.0)

    def metrics(
        self, job_id: str, names: Iterable[str] | None = None, max_points: int = 1000,
        from_step: int | None = None, to_step: int | None = None,
    ) -> dict[str, list[list[float]]]:  # fmt: skip
        """History per metric name, downsampled by the server to at most ``max_points`` points."""
        params: dict[str, Any] = {"max_points": max_points}
        if names is not None:
            params["names"] = ",".join(names)
        params |= {k: v for k, v in (("from_step", from_step), ("to_step", to_step)) if v is not None}
        history = self._call("GET", f"/v1/jobs/{job_id}/metrics", params=params)
        return {s["name"]: s["points"] for s in history["series"]}

    def checkpoints(self, job_id: str) -> list[dict[str, Any]]:
        """The job's checkpoints, newest first, each with the metrics of its step."""
        return self._call("GET", f"/v1/jobs/{job_id}/checkpoints")["data"]

    def download_checkpoint(self, job_id: str, step: int, path: str | Path) -> Path:
        """Stream the checkpoint written after ``step`` steps to ``path``."""
        path = Path(path)
        with self._http.stream("GET", f"/v1/jobs/{job_id}/checkpoints/{step}") as response:
            if not response.is_success:
                response.read()
                self._raise(response)
            with path.open("wb") as f:
                for chunk in response.iter_bytes():
                    f.write(chunk)
        return path

    # -- datasets ---------------------------------------------------------------------------------
    def upload_dataset(self, path: str | Path, name: str | None = None) -> dict[str, Any]:
        path = Path(path)
        with path.open("rb") as f:
            return self._call("POST", "/v1/datasets", files={"file": (path.name, f)}, data={"name": name or path.name})

    def get_dataset(self, dataset_id: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/datasets/{dataset_id}")

    # -- plumbing ---------------------------------------------------------------------------------
    def _call(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        response = self._http.request(method, path, **kwargs)
        if response.is_success:
            return response.json()
        self._raise(response)

    @staticmethod
    def _raise(response: httpx.Response) -> None:
        try:
            error = response.json()["error"]
        except (ValueError, KeyError, TypeError):
            error = {"code": "internal", "message": response.text[:500], "param": None}
        raise ApiError(
            response.status_code, error.get("code", "internal"), error.get("message", ""), error.get("param")
        )
