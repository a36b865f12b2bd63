"""The Python client: ``from muonforge import Client``.

client = Client()                      # MUONFORGE_API_URL, MUONFORGE_API_KEY
job = client.create_job(spec_dict)     # a JobSpec as a dict
job = client.wait(job["id"])           # polls until the job finishes
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

FINISHED = ("succeeded", "failed", "cancelled")


class ApiError(RuntimeError):
    """An error answer of the API: ``status``, ``code``, ``message``, ``param``."""

    def __init__(self, status: int, code: str, message: str, param: str | None) -> None:
        super().__init__(f"{status} {code}: {message}" + (f" ({param})" if param else ""))
        self.status, self.code, self.message, self.param = status, code, message, param


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
        try:
            error = response.json()["error"]
        except (ValueError, KeyError, TypeError):
            error = {"code": "internal", "message": response.text[:500], "param": None}
        raise ApiError(
            response.status_code, error.get("code", "internal"), error.get("message", ""), error.get("param")
        )
