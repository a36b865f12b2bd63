"""Client and AsyncClient against a real API process on Postgres and Redis, with a real worker
for the telemetry of a finished job: every method, each test once with each client."""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import json
from collections.abc import Iterator

import httpx
import pytest

from app.db.session import transaction
from app.repositories.checkpoints import CheckpointRepository
from contract.export import CONFIG_FILE, EXPORT_FILE, GENERATION_FILE
from muonforge import AsyncClient, Client
from muonforge.errors import Conflict, NotFound, Unauthorized, ValidationError
from tests.service.test_models import files_in, tar_of, tiny_llama, zip_of
from tests.support.api import new_key
from tests.support.http_stub import DROP, Reply, StubServer
from tests.support.services import Worker
from tests.support.specs import tiny_spec

pytestmark = pytest.mark.system  # its tests start processes: the service's, torchrun's or a command's


async def done(value):
    """What a call of either client gives: an async client's awaited, an iterator of either read to
    its end."""
    if inspect.isawaitable(value):
        return await value
    if hasattr(value, "__aiter__"):
        return [item async for item in value]
    if isinstance(value, Iterator):
        return list(value)
    return value


async def raises(kind, call):
    """The ``kind`` of error that ``call()`` raises (a sync client's when called, an async
    client's when awaited)."""
    with pytest.raises(kind) as err:
        await done(call())
    return err.value


@pytest.fixture(params=["sync", "async"])
def run(request, api_url):
    """``run(key, scenario, url=api_url)``: ``await scenario(client)`` with a Client or an
    AsyncClient."""

    def run_scenario(key: str, scenario, url: str = api_url):
        async def main():
            if request.param == "sync":
                with Client(url, key) as client:
                    return await scenario(client)
            async with AsyncClient(url, key) as client:
                return await scenario(client)

        return asyncio.run(main())

    return run_scenario


@pytest.fixture(scope="module")
def trained(settings, api_url, tmp_path_factory) -> tuple[str, dict]:
    """A tenant's key and its 20-step job, finished by a real worker."""
    key = new_key(settings)
    worker = Worker(settings, tmp_path_factory.mktemp("worker") / "worker.log")
    try:
        with Client(api_url, key) as client:
            job = client.wait(client.create_job(tiny_spec(steps=20))["id"], poll=0.2)
    finally:
        worker.stop()
    assert job["status"] == "succeeded", job
    return key, job


def stored_checkpoint(settings, job_id: str, step: int) -> bytes:
    with transaction(settings) as session:
        row = next(c for c in CheckpointRepository(session).checkpoints(job_id) if c.step == step)
    return (settings.artifact_dir / row.path).read_bytes()


def test_jobs_create_get_list_cancel_wait(run, settings):
    async def scenario(client):
        a = await done(client.create_job(tiny_spec()))
        b = await done(client.create_job(tiny_spec(), idempotency_key="same"))
        assert (await done(client.create_job(tiny_spec(), idempotency_key="same")))["id"] == b["id"]  # replayed
        await raises(Conflict, lambda: client.create_job(tiny_spec(steps=21), idempotency_key="same"))
        c = await done(client.create_job(tiny_spec()))
        got = await done(client.get_job(a["id"]))
        # The one difference: a queued job's place in the queue, read when it is asked for.
        assert a["status"] == "queued" and a["queue_position"] is None and isinstance(got["queue_position"], int)
        assert got | {"queue_position": None} == a

        assert [j["id"] for j in await done(client.list_jobs(page_size=2))] == [c["id"], b["id"], a["id"]]
        first = await done(client.list_jobs_page(limit=2))
        assert [j["id"] for j in first["data"]] == [c["id"], b["id"]] and first["has_more"]
        rest = await done(client.list_jobs_page(limit=2, after=first["next_after"]))
        assert [j["id"] for j in rest["data"]] == [a["id"]] and not rest["has_more"]

        assert (await done(client.cancel_job(a["id"])))["status"] == "cancelled"
        assert (await raises(Conflict, lambda: client.cancel_job(a["id"]))).status == 409
        assert [j["id"] for j in await done(client.list_jobs(status="cancelled"))] == [a["id"]]
        assert (await done(client.wait(a["id"])))["status"] == "cancelled"
        for job in (b, c):
            await done(client.cancel_job(job["id"]))

        missing = await raises(NotFound, lambda: client.get_job("job_nope"))
        assert (missing.status, missing.code, missing.param) == (404, "not_found", "job_id")
        invalid = await raises(ValidationError, lambda: client.create_job(tiny_spec() | {"optimizer": {"lr": -1}}))
        assert (invalid.status, invalid.param) == (422, "optimizer.lr")

    run(new_key(settings), scenario)


def test_datasets_upload_get_list(run, settings, tmp_path):
    first, second = tmp_path / "first.txt", tmp_path / "second.txt"
    first.write_text("to be or not to be " * 1000)
    second.write_text("all the world's a stage")
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    reports = []

    async def scenario(client):
        one = await done(client.upload_dataset(first, progress=lambda *r: reports.append(r)))
        assert (one["name"], one["bytes"]) == ("first.txt", first.stat().st_size)
        assert reports[-1] == (first.stat().st_size, first.stat().st_size)
        two = await done(client.upload_dataset(second, name="a stage"))
        assert two["name"] == "a stage" and (await done(client.get_dataset(two["id"]))) == two
        assert [d["id"] for d in await done(client.list_datasets(page_size=1))] == [two["id"], one["id"]]
        page = await done(client.list_datasets_page(limit=1))
        assert [d["id"] for d in page["data"]] == [two["id"]] and page["has_more"]
        assert (await raises(ValidationError, lambda: client.upload_dataset(tmp_path / "latin1.txt"))).param == "file"
        assert (await raises(NotFound, lambda: client.get_dataset("ds_nope"))).param == "dataset_id"

        job = await done(client.create_job(tiny_spec() | {"data": {"dataset_id": one["id"]}}))
        assert (await raises(Conflict, lambda: client.delete_dataset(one["id"]))).code == "dataset_in_use"
        await done(client.cancel_job(job["id"]))
        assert await done(client.delete_dataset(one["id"])) is None
        assert [d["id"] for d in await done(client.list_datasets())] == [two["id"]]
        assert (await raises(NotFound, lambda: client.delete_dataset(one["id"]))).param == "dataset_id"

    run(new_key(settings), scenario)


def test_models_upload_get_list_delete(run, settings, tmp_path):
    directory = tmp_path / "tiny"
    parameters = tiny_llama(directory)
    archive = tmp_path / "tiny.zip"
    archive.write_bytes(zip_of(files_in(directory)))
    pickled = tmp_path / "pickled.tar"
    pickled.write_bytes(tar_of(files_in(directory) | {"pytorch_model.bin": b"x"}))
    reports: list[tuple[int, int | None]] = []

    async def scenario(client):
        one = await done(client.upload_model(directory, progress=lambda *r: reports.append(r)))
        assert (one["name"], one["model_type"], one["parameters"]) == (directory.name, "llama", parameters)
        assert reports[-1][0] == reports[-1][1] and reports[-1][0] > one["bytes"]  # the tar sent, headers and all
        two = await done(client.upload_model(archive, name="zipped"))
        assert two["sha256"] == hashlib.sha256(archive.read_bytes()).hexdigest() and two["name"] == "zipped"
        assert (await done(client.get_model(two["id"]))) == two
        assert [m["id"] for m in await done(client.list_models(page_size=1))] == [two["id"], one["id"]]
        page = await done(client.list_models_page(limit=1))
        assert [m["id"] for m in page["data"]] == [two["id"]] and page["has_more"]
        refused = await raises(ValidationError, lambda: client.upload_model(pickled))
        assert refused.param == "file" and "safetensors only" in str(refused)
        assert await done(client.delete_model(one["id"])) is None
        assert (await raises(NotFound, lambda: client.get_model(one["id"]))).param == "model_id"

    run(new_key(settings), scenario)


def test_health_and_a_rejected_key(run):
    async def scenario(client):
        assert await done(client.healthz()) == {"status": "ok"}
        assert await done(client.readyz()) == {"status": "ok", "checks": {"database": "ok", "broker": "ok"}}
        rejected = await raises(Unauthorized, lambda: client.list_jobs_page())
        assert (rejected.status, rejected.code) == (401, "unauthorized")

    run("mf_not_a_key", scenario)


def test_a_finished_jobs_events_metrics_and_checkpoints(run, trained, settings, tmp_path):
    key, job = trained
    reports = []
    progress = lambda *report: reports.append(report)  # noqa: E731

    async def scenario(client):
        events = await done(client.events(job["id"]))
        assert [e.data["status"] for e in events if e.event == "status"] == ["queued", "running", "succeeded"]
        assert [e.data["step"] for e in events if e.event == "metrics"] == list(range(21))
        assert [e.data["step"] for e in events if e.event == "checkpoint"] == [10, 20]
        assert events[-1].event == "done" and events[-1].id is None
        resumed = await done(client.events(job["id"], last_event_id=events[4].id))
        assert [(e.event, e.id) for e in resumed] == [(e.event, e.id) for e in events[5:]]

        history = await done(client.metrics(job["id"], names=["loss", "val_loss"]))
        streamed = {e.data["step"]: e.data["metrics"] for e in events if e.event == "metrics"}
        assert history["loss"] == [[s, streamed[s]["loss"]] for s in range(20)]
        assert [p[0] for p in history["val_loss"]] == [0, 10, 20]
        assert len((await done(client.metrics(job["id"], names=["loss"], max_points=6)))["loss"]) <= 6

        checkpoints = await done(client.checkpoints(job["id"]))
        assert [c["step"] for c in checkpoints] == [20, 10]
        path = await done(client.download_checkpoint(job["id"], 20, tmp_path / "step20.pt", progress))
        assert path == tmp_path / "step20.pt" and path.read_bytes() == stored_checkpoint(settings, job["id"], 20)
        assert reports[-1] == (checkpoints[0]["bytes"], checkpoints[0]["bytes"])
        await raises(NotFound, lambda: client.download_checkpoint(job["id"], 15, tmp_path / "step15.pt"))
        assert not list(tmp_path.glob("step15*")), "nothing left behind by a failed download"

        exported = await done(client.export_checkpoint(job["id"], 20, tmp_path / "export"))
        assert sorted(p.name for p in exported.iterdir()) == [CONFIG_FILE, EXPORT_FILE]
        hf = await done(client.export_checkpoint(job["id"], 20, tmp_path / "hf", format="hf"))
        assert hf == tmp_path / "hf" and sorted(p.name for p in hf.iterdir()) == [
            CONFIG_FILE,
            GENERATION_FILE,
            EXPORT_FILE,
        ]
        assert json.loads((hf / CONFIG_FILE).read_text())["architectures"] == ["GPT2LMHeadModel"]
        await raises(NotFound, lambda: client.export_checkpoint(job["id"], 15, tmp_path / "none", format="hf"))
        assert list((tmp_path / "none").iterdir()) == [], "nothing left behind by a failed export"
        await raises(ValueError, lambda: client.export_checkpoint(job["id"], 20, tmp_path / "onnx", format="onnx"))

    run(key, scenario)


def test_create_job_whose_answer_is_lost_creates_one_job(run, settings, api_url):
    """A proxy passes the first POST to the server and drops its answer: the client's retry
    carries the same Idempotency-Key, and the server answers it with the job it created."""
    forwarded = []

    def proxy(request):
        headers = {
            k: v for k, v in request.headers.items() if k in ("authorization", "content-type", "idempotency-key")
        }
        answer = httpx.request(request.method, api_url + request.path, headers=headers, content=request.body)
        forwarded.append((request.method, answer.status_code))
        if forwarded == [("POST", 201)]:
            return DROP
        return Reply(answer.status_code, answer.content, {"Content-Type": answer.headers["content-type"]})

    async def create(client):
        return await done(client.create_job(tiny_spec()))

    key = new_key(settings)
    with StubServer(proxy) as server:
        job = run(key, create, url=server.url)
    assert forwarded == [("POST", 201), ("POST", 200)]
    assert server.requests[0].headers["idempotency-key"] == server.requests[1].headers["idempotency-key"]
    with Client(api_url, key) as client:
        assert [j["id"] for j in client.list_jobs()] == [job["id"]]
        client.cancel_job(job["id"])
