"""The Python client: ``from muonforge import Client`` (and its asyncio twin, muonforge.async_client).

client = Client()                      # MUONFORGE_API_URL, MUONFORGE_API_KEY
job = client.create_job(spec_dict)     # a JobSpec as a dict
for event in client.events(job["id"]): # live: status, metrics, checkpoint, log ... done
    print(event.event, event.data)
job = client.wait(job["id"])           # polls until the job finishes
history = client.metrics(job["id"], names=["loss", "val_loss"], max_points=500)

AsyncClient has the same methods, awaited; its lists and events are async iterators. Both
retry 429, 5xx, connection failures and timeouts as their ``retry`` policy says (see
``muonforge.retry``), and raise ``ApiError`` (a subclass per kind), ``ConnectionFailed`` or
``ConfigError`` (all ``MuonforgeError``). Every request, and the description of its answer, is
in ``muonforge.api``; the methods here only send them.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Any, BinaryIO, TypedDict, TypeGuard

import httpx

from contract.export import EXPORT_FILE, FORMATS
from contract.status import UploadStatus
from muonforge import api
from muonforge.api import ACTIVE, FINISHED, STATUSES, Call, Event, SseParser
from muonforge.errors import ApiError, ConfigError, Conflict, ConnectionFailed, MuonforgeError, RateLimited, ServerError
from muonforge.errors import NotFound as NotFoundError
from muonforge.retry import NO_RETRY, Attempts, Retry
from muonforge.transfer import (
    PART_BYTES,
    Download,
    Part,
    Progress,
    SharedProgress,
    UploadState,
    extract_export,
    model_in_parts,
    open_model_upload,
    open_upload,
    part_chunks,
    part_sha256,
    parts_of,
    write_export_config,
)

__all__ = [
    "ACTIVE",
    "FINISHED",
    "STATUSES",
    "ApiError",
    "Client",
    "ConfigError",
    "ConnectionFailed",
    "Event",
    "MuonforgeError",
    "Retry",
]

DEFAULT_URL = "http://127.0.0.1:8000"
PAGE_SIZE = 100  # the server's largest page
DEFAULT_RETRY = Retry()
Json = dict[str, Any]


class _HttpOptions(TypedDict):
    """What either client's httpx client is built with."""

    base_url: str
    headers: dict[str, str]
    timeout: float


class ClientBase:
    """What both clients are built from: the URL and key (arguments, else the environment), the
    timeout and the retry policy."""

    def __init__(self, url: str | None, api_key: str | None, timeout: float, retry: Retry) -> None:
        self.url = (url or os.environ.get("MUONFORGE_API_URL") or DEFAULT_URL).rstrip("/")
        if not self.url.startswith(("http://", "https://")):
            problem = f"the API URL {self.url!r} does not start with http:// or https://"
            raise ConfigError(problem, "MUONFORGE_API_URL", "url")
        key = api_key or os.environ.get("MUONFORGE_API_KEY")
        if not key:
            raise ConfigError("no API key", "MUONFORGE_API_KEY", "api_key")
        self.retry, self.timeout = retry, timeout
        self._http_options: _HttpOptions = {
            "base_url": self.url,
            "headers": {"Authorization": f"Bearer {key}"},
            "timeout": timeout,
        }

    def _attempts(self, call: Call, retrying: bool = True) -> Attempts:
        timeout = call.timeout.read if call.timeout is not None else self.timeout
        return Attempts(self.retry if retrying else NO_RETRY, call.repeat, self.url, call.what, timeout)


class Client(ClientBase):
    """The API over HTTP (httpx), one request at a time. ``sleep`` is how it waits between
    attempts (seconds)."""

    def __init__(
        self,
        url: str | None = None,
        api_key: str | None = None,
        timeout: float = 30.0,
        *,
        retry: Retry = DEFAULT_RETRY,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        super().__init__(url, api_key, timeout, retry)
        self._sleep = sleep
        self._http = httpx.Client(**self._http_options)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    # -- jobs -------------------------------------------------------------------------------------
    def create_job(self, spec: Json, idempotency_key: str | None = None) -> Json:
        """Submit a JobSpec (a dict); returns the Job. Without ``idempotency_key`` the client makes
        one, so its own retries cannot create the job twice."""
        return self._call(api.create_job(spec, idempotency_key))

    def get_job(self, job_id: str) -> Json:
        return self._call(api.get_job(job_id))

    def list_jobs(self, status: str | None = None, page_size: int = PAGE_SIZE) -> Iterator[Json]:
        """Every job (of ``status``, if given), newest first, fetched a page at a time."""
        return self._each(lambda after: api.jobs_page(status, page_size, after))

    def list_jobs_page(self, status: str | None = None, limit: int = 20, after: str | None = None) -> Json:
        """One page: ``{data, has_more, next_after}``; pass ``next_after`` as ``after`` for the next."""
        return self._call(api.jobs_page(status, limit, after))

    def cancel_job(self, job_id: str) -> Json:
        """A queued job is cancelled at once, a running one is ``cancelling`` until its worker
        stops; a finished one raises Conflict. Returns the Job."""
        return self._call(api.cancel_job(job_id))

    def wait(self, job_id: str, poll: float = 1.0, on_update: Callable[[Json], None] | None = None) -> Json:
        """Poll every ``poll`` seconds until the job has finished; returns the final Job."""
        while True:
            job = self.get_job(job_id)
            if on_update:
                on_update(job)
            if job["status"] in FINISHED:
                return job
            self._sleep(poll)

    def events(self, job_id: str, last_event_id: str | None = None, reconnect: bool = True) -> Iterator[Event]:
        """The job's events until ``done``, after ``last_event_id`` if given. A dropped connection
        is resumed after the last event received (``reconnect=False``: raised instead)."""
        parser = SseParser(last_event_id)
        attempts = self._attempts(api.job_events(job_id, last_event_id), reconnect)
        while True:
            try:
                with self._http.stream(**api.job_events(job_id, parser.last_event_id).request()) as response:
                    if not response.is_success:
                        response.read()
                        delay = attempts.after_response(response)
                    else:
                        parser.connect()
                        for line in response.iter_lines():
                            if (event := parser.feed(line)) is not None:
                                attempts.reset()
                                yield event
                                if event.event == "done":
                                    return
                        delay = attempts.after_error(httpx.ReadError("the stream ended before its done event"))
            except httpx.TransportError as exc:
                delay = attempts.after_error(exc)
            self._sleep(delay)

    def metrics(
        self,
        job_id: str,
        names: Iterable[str] | None = None,
        max_points: int = 1000,
        from_step: int | None = None,
        to_step: int | None = None,
    ) -> dict[str, list[list[float]]]:
        """``{name: [[step, value], ...]}``, downsampled by the server to at most ``max_points``
        real points per series (min, max and last of each step bucket, so spikes survive)."""
        return self._call(api.job_metrics(job_id, names, max_points, from_step, to_step))

    def checkpoints(self, job_id: str) -> list[Json]:
        """The job's checkpoints, newest first, each with the metrics of its step."""
        return list(self._each(lambda after: api.checkpoints_page(job_id, after)))

    def download_checkpoint(
        self, job_id: str, step: int, path: str | Path, progress: Progress | None = None, format: str = "pt"
    ) -> Path:
        """Stream the checkpoint written after ``step`` steps to ``path`` (``format="safetensors"``:
        its weights only); ``progress(done, total)`` is called in bytes as it arrives. Returns the path."""

        def save(response: httpx.Response) -> Path:
            with Download(path, response.headers, progress) as out:
                for chunk in response.iter_bytes():
                    out.write(chunk)
            return out.path

        return self._run(api.checkpoint_file(job_id, step, format), save)

    def export_checkpoint(
        self,
        job_id: str,
        step: int,
        directory: str | Path,
        progress: Progress | None = None,
        format: str = "safetensors",
    ) -> Path:
        """The weights of the checkpoint written after ``step`` steps, for use without the service,
        written in ``directory`` (created if need be); returns the directory.

        ``format="safetensors"``: ``model.safetensors`` and ``config.json`` (the model's config), for
        the engine's model code. ``format="hf"``: a transformers model directory (config.json,
        model.safetensors, generation_config.json and the tokenizer's files), unpacked from the
        server's tar archive; ValidationError (``format``) for an arch transformers lacks (moe, mlp).
        """
        if format not in FORMATS:
            raise ValueError(f"format must be one of {', '.join(FORMATS)} (got {format!r})")
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        if format == "safetensors":
            weights = self.download_checkpoint(job_id, step, directory / EXPORT_FILE, progress, format)
            return write_export_config(weights).parent
        with tempfile.TemporaryDirectory(prefix=".export-", dir=directory) as temp:
            archive = self.download_checkpoint(job_id, step, Path(temp) / "hf.tar", progress, format)
            extract_export(archive, directory)
        return directory

    # -- datasets ---------------------------------------------------------------------------------
    def upload_dataset(
        self, file: str | Path | BinaryIO, name: str | None = None, progress: Progress | None = None
    ) -> Json:
        """Upload a corpus: UTF-8 text, .jsonl rows or .parquet by its file name (a path, or a
        binary file read from its start); ``progress(done, total)`` is called in bytes as it is
        sent. Returns the Dataset."""
        if isinstance(file, str | os.PathLike) and os.path.getsize(file) > PART_BYTES:
            done = self.upload_in_parts(file, "dataset", name, progress)
            return self.get_dataset(done["dataset_id"])
        with open_upload(file, progress) as (filename, reader):
            return self._call(api.upload_dataset(filename, reader, name or filename))

    def list_datasets(self, page_size: int = PAGE_SIZE) -> Iterator[Json]:
        return self._each(lambda after: api.datasets_page(page_size, after))

    def list_datasets_page(self, limit: int = 20, after: str | None = None) -> Json:
        return self._call(api.datasets_page(limit, after))

    def get_dataset(self, dataset_id: str) -> Json:
        return self._call(api.get_dataset(dataset_id))

    def delete_dataset(self, dataset_id: str) -> None:
        """Delete a dataset and its file; Conflict (``dataset_in_use``) while a queued or running
        job trains on it, NotFound for an unknown one."""
        self._call(api.delete_dataset(dataset_id))

    # -- models -----------------------------------------------------------------------------------
    def upload_model(
        self,
        path: str | Path,
        name: str | None = None,
        progress: Progress | None = None,
        *,
        part_size: int = PART_BYTES,
    ) -> Json:
        """Upload a transformers model: a directory (sent as a tar of its files) or a .tar, .tar.gz
        or .zip of one, sent as it is. It needs config.json and safetensors weights;
        ValidationError (``file``) says what the server refused. ``progress(done, total)`` is
        called in bytes as it is sent. Returns the Model, with its sizes and config.

        More than ``part_size`` bytes go up in parts (:meth:`upload_in_parts`), resumed when
        interrupted; a directory's tar is then kept in the uploads' cache until it is done."""
        path = Path(path)
        archive = model_in_parts(path, part_size)
        if archive is None:
            with open_model_upload(path, progress) as (filename, reader):
                return self._call(api.upload_model(filename, reader, name or path.name))
        done = self.upload_in_parts(archive, "model", name or path.name, progress, part_size=part_size)
        if archive != path:
            shutil.rmtree(archive.parent, ignore_errors=True)  # the directory's kept tar
        return self.get_model(done["model_id"])

    # -- resumable uploads ------------------------------------------------------------------------
    def upload_in_parts(
        self,
        path: str | os.PathLike,
        purpose: str,
        name: str | None = None,
        progress: Progress | None = None,
        *,
        part_size: int = PART_BYTES,
        parallel: int = 4,
    ) -> Json:
        """Upload a file as a dataset or a model (``purpose``) in parts of ``part_size`` bytes,
        ``parallel`` at a time, each checked against the sha256 the server computed and sent again
        when it differs or fails. An upload of the same file that stopped before its end (the
        same path, size and modification time, to this server) is resumed: the parts the server
        holds with this file's bytes are not sent again. Returns the completed Upload, with its
        ``dataset_id`` or ``model_id``."""
        path = Path(path)
        size, state = path.stat().st_size, UploadState(self.url, path, purpose)
        upload = self._resumable(state)
        if upload is None:
            upload = self._call(api.create_upload(purpose, path.name, size, name or path.name))
            state.remember(upload["id"])
        received = {p["number"]: p for p in upload["parts"]}
        shared = SharedProgress(progress, size)

        def send(part: Part) -> str:
            have = received.get(part.number)
            if have is not None and have["bytes"] == part.length and part_sha256(path, part) == have["sha256"]:
                shared.add(part.length)
                return have["sha256"]
            return self._send_part(upload["id"], path, part, shared)

        with ThreadPoolExecutor(max(1, parallel)) as pool:
            digests = list(pool.map(send, parts_of(size, part_size)))
        done = self._complete(upload["id"], list(enumerate(digests, 1)), size)
        state.forget()
        return done

    def _complete(self, upload_id: str, parts: list[tuple[int, str]], size: int) -> Json:
        """Complete an upload. Where its answer does not come (its checks outlast the read timeout,
        a proxy cuts the connection) the server goes on: the upload is read until it is no longer
        ``completing``. Completed: that is the answer; ``pending``: the completion failed its checks
        or had not begun, and is asked again (a second one while the first runs answers 409
        ``upload_not_pending``, and the upload is read again), until api.completion_seconds."""
        deadline = None
        while True:
            try:
                return self._call(api.complete_upload(upload_id, parts, size))
            except (ConnectionFailed, Conflict) as exc:
                if isinstance(exc, Conflict) and exc.code != api.UPLOAD_NOT_PENDING:
                    raise
                deadline = deadline or time.monotonic() + api.completion_seconds(size)
                while (upload := self.get_upload(upload_id))["status"] == UploadStatus.COMPLETING:
                    if time.monotonic() > deadline:
                        raise
                    self._sleep(api.COMPLETION_POLL_S)
                if upload["status"] == UploadStatus.COMPLETED:
                    return upload
                if upload["status"] != UploadStatus.PENDING or time.monotonic() > deadline:
                    raise

    def _send_part(self, upload_id: str, path: Path, part: Part, shared: SharedProgress) -> str:
        """PUT one part, read from the file as it goes; sent again (up to the retry policy's count)
        after a failure that may be passing or an answer whose sha256 is not the bytes read."""
        for attempt in range(self.retry.max_retries + 1):
            digest, sent = hashlib.sha256(), shared.counter()
            chunks = part_chunks(path, part, digest, sent.add)
            try:
                answer = self._call(api.put_part(upload_id, part.number, chunks, part.length))
            except (ConnectionFailed, ServerError, RateLimited):
                sent.undo()
                if attempt == self.retry.max_retries:
                    raise
                self._sleep(min(self.retry.backoff * 2**attempt, self.retry.max_backoff))
                continue
            if answer["sha256"] == digest.hexdigest():
                return answer["sha256"]
            sent.undo()  # changed on the way: sent again
        raise MuonforgeError(f"part {part.number} of {path} did not arrive intact in {attempt + 1} tries")

    def get_upload(self, upload_id: str) -> Json:
        """A resumable upload: its status and the parts the server holds."""
        return self._call(api.get_upload(upload_id))

    def _resumable(self, state: UploadState) -> Json | None:
        """The pending upload ``state`` remembers, if the server still has it."""
        upload_id = state.upload_id()
        if upload_id is None:
            return None
        try:
            upload = self.get_upload(upload_id)
        except NotFoundError:
            upload = None
        if not resumable(upload):
            state.forget()
            return None
        return upload

    def list_models(self, page_size: int = PAGE_SIZE) -> Iterator[Json]:
        return self._each(lambda after: api.models_page(page_size, after))

    def list_models_page(self, limit: int = 20, after: str | None = None) -> Json:
        return self._call(api.models_page(limit, after))

    def get_model(self, model_id: str) -> Json:
        """A model: its files, sizes, parameters and config.json; NotFound for an unknown one."""
        return self._call(api.get_model(model_id))

    def delete_model(self, model_id: str) -> None:
        """Delete an uploaded model and its files; NotFound for an unknown one, Conflict
        (``model_in_use``) while a queued, running or paused job starts from it, Conflict for a
        staged model (``staged:…``, the operators')."""
        self._call(api.delete_model(model_id))

    # -- webhooks ---------------------------------------------------------------------------------
    def create_webhook(self, url: str, events: Iterable[str]) -> Json:
        """An endpoint that receives the given event types as signed POSTs.

        The types are ``job.succeeded``, ``job.failed``, ``job.cancelled`` and ``sweep.completed``. The
        answer's ``secret`` is shown this once: keep it to verify the signatures. ValidationError
        (``url``) for a destination the server does not deliver to.
        """
        return self._call(api.create_webhook(url, events))

    def list_webhooks(self, page_size: int = PAGE_SIZE) -> Iterator[Json]:
        return self._each(lambda after: api.webhooks_page(page_size, after))

    def get_webhook(self, webhook_id: str) -> Json:
        return self._call(api.get_webhook(webhook_id))

    def delete_webhook(self, webhook_id: str) -> None:
        self._call(api.delete_webhook(webhook_id))

    def webhook_deliveries(self, webhook_id: str, page_size: int = PAGE_SIZE) -> Iterator[Json]:
        """The endpoint's deliveries, newest first, each with its attempts."""
        return self._each(lambda after: api.deliveries_page(webhook_id, page_size, after))

    def webhook_deliveries_page(self, webhook_id: str, limit: int = 20, after: str | None = None) -> Json:
        return self._call(api.deliveries_page(webhook_id, limit, after))

    # -- sweeps -----------------------------------------------------------------------------------
    def create_sweep(self, spec: Json, idempotency_key: str | None = None) -> Json:
        """Submit a SweepSpec (a dict: base, space, method, ...); returns the Sweep with its trials.
        Without ``idempotency_key`` the client makes one, so its own retries cannot start it twice."""
        return self._call(api.create_sweep(spec, idempotency_key))

    def get_sweep(self, sweep_id: str) -> Json:
        """The sweep, its trials (parameters, job, status, metric) and its best trial."""
        return self._call(api.get_sweep(sweep_id))

    def list_sweeps(self, status: str | None = None, page_size: int = PAGE_SIZE) -> Iterator[Json]:
        """Every sweep (of ``status``, if given), newest first, fetched a page at a time."""
        return self._each(lambda after: api.sweeps_page(status, page_size, after))

    def list_sweeps_page(self, status: str | None = None, limit: int = 20, after: str | None = None) -> Json:
        return self._call(api.sweeps_page(status, limit, after))

    def cancel_sweep(self, sweep_id: str) -> Json:
        """No trial starts any more; its queued trials are cancelled, running ones stop. Returns the Sweep."""
        return self._call(api.cancel_sweep(sweep_id))

    # -- health -----------------------------------------------------------------------------------
    def healthz(self) -> Json:
        """Liveness: ``{"status": "ok"}``."""
        return self._call(api.healthz())

    def readyz(self) -> Json:
        """Readiness: ``{"status": "ok" | "unavailable", "checks": {...}}`` (returned either way)."""
        return self._call(api.readyz())

    # -- plumbing ---------------------------------------------------------------------------------
    def _call(self, call: Call) -> Any:
        def read(response: httpx.Response) -> Any:
            response.read()
            return call.result(response.json() if response.content else None)  # 204: no body

        return self._run(call, read)

    def _run(self, call: Call, consume: Callable[[httpx.Response], Any]) -> Any:
        """Send ``call`` until it is answered (retrying what its policy allows), then read the
        answer with ``consume``; a connection lost while reading counts as a failed attempt."""
        attempts = self._attempts(call)
        while True:
            try:
                with self._http.stream(**call.request()) as response:
                    if response.is_success or response.status_code in call.answers:
                        return consume(response)
                    response.read()
                    delay = attempts.after_response(response)
            except httpx.TransportError as exc:
                delay = attempts.after_error(exc)
            self._sleep(delay)

    def _each(self, page: Callable[[str | None], Call]) -> Iterator[Json]:
        after = None
        while True:
            body = self._call(page(after))
            yield from body["data"]
            if not body["has_more"]:
                return
            after = body["next_after"]


def resumable(upload: Json | None) -> TypeGuard[Json]:
    """Whether a remembered upload can go on: pending, and not about to expire."""
    return (
        upload is not None
        and upload["status"] == UploadStatus.PENDING
        and parse_time(upload["expires_at"]) > time.time() + 60
    )


def parse_time(value: str) -> float:
    """An API timestamp (ISO 8601) as Unix time."""
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
