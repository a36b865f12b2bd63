"""The asynchronous Python client: ``from muonforge import AsyncClient``, Client's twin on asyncio.

Its methods are Client's (muonforge.client), awaited; its lists and events are async iterators.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import httpx

from contract.export import EXPORT_FILE, FORMATS
from contract.status import UploadStatus
from muonforge import api
from muonforge.api import FINISHED, Call, Event, SseParser
from muonforge.client import DEFAULT_RETRY, PAGE_SIZE, ClientBase, Json, resumable
from muonforge.errors import Conflict, ConnectionFailed, MuonforgeError, RateLimited, ServerError
from muonforge.errors import NotFound as NotFoundError
from muonforge.retry import Retry
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


async def in_thread(chunks: Iterator[bytes]) -> AsyncIterator[bytes]:
    """A blocking iterator's items, each read in a worker thread (a file read off the event loop)."""
    while (chunk := await asyncio.to_thread(next, chunks, None)) is not None:
        yield chunk


class AsyncClient(ClientBase):
    """Client's twin on httpx.AsyncClient: the same methods, awaited; ``list_jobs``,
    ``list_datasets``, ``list_models``, ``list_webhooks``, ``webhook_deliveries`` and ``events`` are async iterators."""

    def __init__(
        self,
        url: str | None = None,
        api_key: str | None = None,
        timeout: float = 30.0,
        *,
        retry: Retry = DEFAULT_RETRY,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        super().__init__(url, api_key, timeout, retry)
        self._sleep = sleep
        self._http = httpx.AsyncClient(**self._http_options)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    # -- jobs -------------------------------------------------------------------------------------
    async def create_job(self, spec: Json, idempotency_key: str | None = None) -> Json:
        return await self._call(api.create_job(spec, idempotency_key))

    async def get_job(self, job_id: str) -> Json:
        return await self._call(api.get_job(job_id))

    def list_jobs(self, status: str | None = None, page_size: int = PAGE_SIZE) -> AsyncIterator[Json]:
        return self._each(lambda after: api.jobs_page(status, page_size, after))

    async def list_jobs_page(self, status: str | None = None, limit: int = 20, after: str | None = None) -> Json:
        return await self._call(api.jobs_page(status, limit, after))

    async def cancel_job(self, job_id: str) -> Json:
        return await self._call(api.cancel_job(job_id))

    async def wait(self, job_id: str, poll: float = 1.0, on_update: Callable[[Json], None] | None = None) -> Json:
        while True:
            job = await self.get_job(job_id)
            if on_update:
                on_update(job)
            if job["status"] in FINISHED:
                return job
            await self._sleep(poll)

    async def events(
        self, job_id: str, last_event_id: str | None = None, reconnect: bool = True
    ) -> AsyncIterator[Event]:
        parser = SseParser(last_event_id)
        attempts = self._attempts(api.job_events(job_id, last_event_id), reconnect)
        while True:
            try:
                async with self._http.stream(**api.job_events(job_id, parser.last_event_id).request()) as response:
                    if not response.is_success:
                        await response.aread()
                        delay = attempts.after_response(response)
                    else:
                        parser.connect()
                        async for line in response.aiter_lines():
                            if (event := parser.feed(line)) is not None:
                                attempts.reset()
                                yield event
                                if event.event == "done":
                                    return
                        delay = attempts.after_error(httpx.ReadError("the stream ended before its done event"))
            except httpx.TransportError as exc:
                delay = attempts.after_error(exc)
            await self._sleep(delay)

    async def metrics(
        self,
        job_id: str,
        names: Iterable[str] | None = None,
        max_points: int = 1000,
        from_step: int | None = None,
        to_step: int | None = None,
    ) -> dict[str, list[list[float]]]:
        return await self._call(api.job_metrics(job_id, names, max_points, from_step, to_step))

    async def checkpoints(self, job_id: str) -> list[Json]:
        return [c async for c in self._each(lambda after: api.checkpoints_page(job_id, after))]

    async def download_checkpoint(
        self, job_id: str, step: int, path: str | Path, progress: Progress | None = None, format: str = "pt"
    ) -> Path:
        async def save(response: httpx.Response) -> Path:
            with Download(path, response.headers, progress) as out:
                async for chunk in response.aiter_bytes():
                    out.write(chunk)
            return out.path

        return await self._run(api.checkpoint_file(job_id, step, format), save)

    async def export_checkpoint(
        self,
        job_id: str,
        step: int,
        directory: str | Path,
        progress: Progress | None = None,
        format: str = "safetensors",
    ) -> Path:
        if format not in FORMATS:
            raise ValueError(f"format must be one of {', '.join(FORMATS)} (got {format!r})")
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        if format == "safetensors":
            weights = await self.download_checkpoint(job_id, step, directory / EXPORT_FILE, progress, format)
            return write_export_config(weights).parent
        with tempfile.TemporaryDirectory(prefix=".export-", dir=directory) as temp:
            archive = await self.download_checkpoint(job_id, step, Path(temp) / "hf.tar", progress, format)
            extract_export(archive, directory)
        return directory

    # -- datasets ---------------------------------------------------------------------------------
    async def upload_dataset(
        self, file: str | Path | BinaryIO, name: str | None = None, progress: Progress | None = None
    ) -> Json:
        if isinstance(file, str | os.PathLike) and os.path.getsize(file) > PART_BYTES:
            done = await self.upload_in_parts(file, "dataset", name, progress)
            return await self.get_dataset(done["dataset_id"])
        with open_upload(file, progress) as (filename, reader):
            return await self._call(api.upload_dataset(filename, reader, name or filename))

    def list_datasets(self, page_size: int = PAGE_SIZE) -> AsyncIterator[Json]:
        return self._each(lambda after: api.datasets_page(page_size, after))

    async def list_datasets_page(self, limit: int = 20, after: str | None = None) -> Json:
        return await self._call(api.datasets_page(limit, after))

    async def get_dataset(self, dataset_id: str) -> Json:
        return await self._call(api.get_dataset(dataset_id))

    async def delete_dataset(self, dataset_id: str) -> None:
        await self._call(api.delete_dataset(dataset_id))

    # -- models -----------------------------------------------------------------------------------
    async def upload_model(
        self,
        path: str | Path,
        name: str | None = None,
        progress: Progress | None = None,
        *,
        part_size: int = PART_BYTES,
    ) -> Json:
        path = Path(path)
        archive = await asyncio.to_thread(model_in_parts, path, part_size)
        if archive is None:
            with open_model_upload(path, progress) as (filename, reader):
                return await self._call(api.upload_model(filename, reader, name or path.name))
        done = await self.upload_in_parts(archive, "model", name or path.name, progress, part_size=part_size)
        if archive != path:
            shutil.rmtree(archive.parent, ignore_errors=True)  # the directory's kept tar
        return await self.get_model(done["model_id"])

    # -- resumable uploads ------------------------------------------------------------------------
    async def upload_in_parts(
        self,
        path: str | os.PathLike,
        purpose: str,
        name: str | None = None,
        progress: Progress | None = None,
        *,
        part_size: int = PART_BYTES,
        parallel: int = 4,
    ) -> Json:
        path = Path(path)
        size, state = path.stat().st_size, UploadState(self.url, path, purpose)
        upload = await self._resumable(state)
        if upload is None:
            upload = await self._call(api.create_upload(purpose, path.name, size, name or path.name))
            state.remember(upload["id"])
        received = {p["number"]: p for p in upload["parts"]}
        shared, gate = SharedProgress(progress, size), asyncio.Semaphore(max(1, parallel))

        async def send(part: Part) -> str:
            async with gate:
                have = received.get(part.number) or {}
                same = have.get("bytes") == part.length
                if same and await asyncio.to_thread(part_sha256, path, part) == have["sha256"]:
                    shared.add(part.length)
                    return have["sha256"]
                return await self._send_part(upload["id"], path, part, shared)

        tasks = [asyncio.ensure_future(send(part)) for part in parts_of(size, part_size)]
        try:
            digests = await asyncio.gather(*tasks)
        except BaseException:  # an interrupted upload sends nothing more: its other parts stop here
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        done = await self._complete(upload["id"], list(enumerate(digests, 1)), size)
        state.forget()
        return done

    async def _complete(self, upload_id: str, parts: list[tuple[int, str]], size: int) -> Json:
        """Complete an upload; where its answer does not come, read it until it is no longer
        ``completing`` and ask again while it is ``pending`` (as ``Client._complete``)."""
        deadline = None
        while True:
            try:
                return await self._call(api.complete_upload(upload_id, parts, size))
            except (ConnectionFailed, Conflict) as exc:
                if isinstance(exc, Conflict) and exc.code != api.UPLOAD_NOT_PENDING:
                    raise
                deadline = deadline or time.monotonic() + api.completion_seconds(size)
                while (upload := await self.get_upload(upload_id))["status"] == UploadStatus.COMPLETING:
                    if time.monotonic() > deadline:
                        raise
                    await self._sleep(api.COMPLETION_POLL_S)
                if upload["status"] == UploadStatus.COMPLETED:
                    return upload
                if upload["status"] != UploadStatus.PENDING or time.monotonic() > deadline:
                    raise

    async def _send_part(self, upload_id: str, path: Path, part: Part, shared: SharedProgress) -> str:
        for attempt in range(self.retry.max_retries + 1):
            digest, sent = hashlib.sha256(), shared.counter()
            chunks = in_thread(part_chunks(path, part, digest, sent.add))
            try:
                answer = await self._call(api.put_part(upload_id, part.number, chunks, part.length))
            except (ConnectionFailed, ServerError, RateLimited):
                sent.undo()
                if attempt == self.retry.max_retries:
                    raise
                await self._sleep(min(self.retry.backoff * 2**attempt, self.retry.max_backoff))
                continue
            if answer["sha256"] == digest.hexdigest():
                return answer["sha256"]
            sent.undo()  # changed on the way: sent again
        raise MuonforgeError(f"part {part.number} of {path} did not arrive intact in {attempt + 1} tries")

    async def get_upload(self, upload_id: str) -> Json:
        return await self._call(api.get_upload(upload_id))

    async def _resumable(self, state: UploadState) -> Json | None:
        upload_id = state.upload_id()
        if upload_id is None:
            return None
        try:
            upload = await self.get_upload(upload_id)
        except NotFoundError:
            upload = None
        if not resumable(upload):
            state.forget()
            return None
        return upload

    def list_models(self, page_size: int = PAGE_SIZE) -> AsyncIterator[Json]:
        return self._each(lambda after: api.models_page(page_size, after))

    async def list_models_page(self, limit: int = 20, after: str | None = None) -> Json:
        return await self._call(api.models_page(limit, after))

    async def get_model(self, model_id: str) -> Json:
        return await self._call(api.get_model(model_id))

    async def delete_model(self, model_id: str) -> None:
        await self._call(api.delete_model(model_id))

    # -- webhooks ---------------------------------------------------------------------------------
    async def create_webhook(self, url: str, events: Iterable[str]) -> Json:
        return await self._call(api.create_webhook(url, events))

    def list_webhooks(self, page_size: int = PAGE_SIZE) -> AsyncIterator[Json]:
        return self._each(lambda after: api.webhooks_page(page_size, after))

    async def get_webhook(self, webhook_id: str) -> Json:
        return await self._call(api.get_webhook(webhook_id))

    async def delete_webhook(self, webhook_id: str) -> None:
        await self._call(api.delete_webhook(webhook_id))

    def webhook_deliveries(self, webhook_id: str, page_size: int = PAGE_SIZE) -> AsyncIterator[Json]:
        return self._each(lambda after: api.deliveries_page(webhook_id, page_size, after))

    async def webhook_deliveries_page(self, webhook_id: str, limit: int = 20, after: str | None = None) -> Json:
        return await self._call(api.deliveries_page(webhook_id, limit, after))

    # -- sweeps -----------------------------------------------------------------------------------
    async def create_sweep(self, spec: Json, idempotency_key: str | None = None) -> Json:
        return await self._call(api.create_sweep(spec, idempotency_key))

    async def get_sweep(self, sweep_id: str) -> Json:
        return await self._call(api.get_sweep(sweep_id))

    def list_sweeps(self, status: str | None = None, page_size: int = PAGE_SIZE) -> AsyncIterator[Json]:
        return self._each(lambda after: api.sweeps_page(status, page_size, after))

    async def list_sweeps_page(self, status: str | None = None, limit: int = 20, after: str | None = None) -> Json:
        return await self._call(api.sweeps_page(status, limit, after))

    async def cancel_sweep(self, sweep_id: str) -> Json:
        return await self._call(api.cancel_sweep(sweep_id))

    # -- health -----------------------------------------------------------------------------------
    async def healthz(self) -> Json:
        return await self._call(api.healthz())

    async def readyz(self) -> Json:
        return await self._call(api.readyz())

    # -- plumbing ---------------------------------------------------------------------------------
    async def _call(self, call: Call) -> Any:
        async def read(response: httpx.Response) -> Any:
            await response.aread()
            return call.result(response.json() if response.content else None)  # 204: no body

        return await self._run(call, read)

    async def _run(self, call: Call, consume: Callable[[httpx.Response], Awaitable[Any]]) -> Any:
        attempts = self._attempts(call)
        while True:
            try:
                async with self._http.stream(**call.request()) as response:
                    if response.is_success or response.status_code in call.answers:
                        return await consume(response)
                    await response.aread()
                    delay = attempts.after_response(response)
            except httpx.TransportError as exc:
                delay = attempts.after_error(exc)
            await self._sleep(delay)

    async def _each(self, page: Callable[[str | None], Call]) -> AsyncIterator[Json]:
        after = None
        while True:
            body = await self._call(page(after))
            for item in body["data"]:
                yield item
            if not body["has_more"]:
                return
            after = body["next_after"]
