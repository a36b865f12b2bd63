"""The clients' resumable uploads against a real API process: parts in parallel, an interrupted
upload resumed where it stopped (a file, and a model directory through its kept tar), a completion
whose answer does not come, and `muonforge datasets upload` of a file larger than one part."""

from __future__ import annotations

import asyncio
import hashlib
import os
import subprocess

import pytest

from muonforge import AsyncClient, Client, ValidationError, api
from muonforge.transfer import PART_BYTES, UploadState, model_archive, uploads_directory
from tests.service.test_models import tiny_llama
from tests.support.api import new_key
from tests.support.cli import client_env, command

pytestmark = pytest.mark.system


@pytest.fixture(autouse=True)
def cache_home(tmp_path, monkeypatch):
    """Where the client remembers interrupted uploads: this test's own."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache"


def corpus(tmp_path, size: int):
    path = tmp_path / "corpus.txt"
    line = b"all the world's a stage, and all the men and women merely players\n"
    path.write_bytes((line * (size // len(line) + 1))[:size])
    return path


def count_parts(client: Client) -> list[int]:
    """The numbers of the parts ``client`` sends from now on, in the order sent."""
    sent: list[int] = []
    send = client._send_part

    def counting(upload_id, path, part, shared):
        sent.append(part.number)
        return send(upload_id, path, part, shared)

    client._send_part = counting  # type: ignore[method-assign]
    return sent


def test_a_file_goes_up_in_parallel_parts_and_an_interrupted_upload_resumes(api_url, settings, tmp_path):
    key = new_key(settings)
    path = corpus(tmp_path, 1_000_000)
    seen: list[tuple[int, int | None]] = []

    class Interrupted(Exception):
        pass

    def stop_at_40_percent(done: int, total: int | None) -> None:
        seen.append((done, total))
        if done >= 400_000 and not interrupted:
            interrupted.append(done)
            raise Interrupted

    interrupted: list[int] = []
    with Client(api_url, key) as client:
        with pytest.raises(Interrupted):
            client.upload_in_parts(path, "dataset", progress=stop_at_40_percent, part_size=65_536, parallel=1)
        assert seen[-1][0] <= interrupted[0] + 65_536  # no more than the part its one thread had taken up
        state = UploadState(api_url, path, "dataset")
        upload_id = state.upload_id()
        assert upload_id is not None
        received = client.get_upload(upload_id)
        assert 0 < len(received["parts"]) < 16

        sent = count_parts(client)
        progress: list[int] = []
        done = client.upload_in_parts(path, "dataset", progress=lambda d, t: progress.append(d), part_size=65_536)
        assert done["id"] == upload_id and done["status"] == "completed"
        assert set(sent) == set(range(1, 17)) - {p["number"] for p in received["parts"]}  # only what it lacked
        assert progress[-1] == 1_000_000 == max(progress)
        dataset = client.get_dataset(done["dataset_id"])
        assert dataset["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
        assert state.upload_id() is None  # forgotten once completed


@pytest.fixture
def unanswered_completion(monkeypatch):
    """The first completion's answer is waited for 1 ms (the server's checks take longer: it times
    out, unanswered); the rest as usual. Counts how often the wait is asked for."""
    asked: list[float] = []

    def seconds(size: int) -> float:
        asked.append(0.001 if not asked else 30.0)
        return asked[-1]

    monkeypatch.setattr(api, "completion_seconds", seconds)
    return asked


def test_a_completion_whose_answer_does_not_come_is_read_from_the_upload(
    api_url, settings, tmp_path, unanswered_completion
):
    path = corpus(tmp_path, 300_000)
    with Client(api_url, new_key(settings)) as client:
        done = client.upload_in_parts(path, "dataset", part_size=65_536)
        assert unanswered_completion[0] == 0.001  # the completion's own answer did not come in time
        assert done["status"] == "completed"
        assert client.get_dataset(done["dataset_id"])["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
        assert len(list(client.list_datasets())) == 1  # completed once
    assert UploadState(api_url, path, "dataset").upload_id() is None


def test_a_failed_completion_whose_answer_did_not_come_is_asked_again(
    api_url, settings, tmp_path, unanswered_completion
):
    path = tmp_path / "corpus.txt"
    path.write_bytes(b"fine text\n" * 20_000 + b"\xff broken")
    with Client(api_url, new_key(settings)) as client:
        with pytest.raises(ValidationError, match="not UTF-8"):
            client.upload_in_parts(path, "dataset", part_size=65_536)
        # timed out, then a deadline for the wait, then asked again (more than once where a second
        # completion found the first still running)
        assert unanswered_completion[:2] == [0.001, 30.0] and len(unanswered_completion) >= 3
        upload_id = UploadState(api_url, path, "dataset").upload_id()
        assert upload_id is not None and client.get_upload(upload_id)["status"] == "pending"  # kept, to fix


def test_the_async_client_reads_a_completion_whose_answer_does_not_come(
    api_url, settings, tmp_path, unanswered_completion
):
    path = corpus(tmp_path, 300_000)

    async def upload():
        async with AsyncClient(api_url, new_key(settings)) as client:
            done = await client.upload_in_parts(path, "dataset", part_size=65_536)
            return done, await client.get_dataset(done["dataset_id"])

    done, dataset = asyncio.run(upload())
    assert unanswered_completion[0] == 0.001 and done["status"] == "completed"
    assert dataset["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_model_directory_larger_than_a_part_goes_up_in_parts_and_resumes(api_url, settings, tmp_path):
    directory = tmp_path / "llama"
    directory.mkdir()
    parameters = tiny_llama(directory)
    archive = model_archive(directory)
    size, part = archive.stat().st_size, 4096
    assert size > 4 * part

    class Interrupted(Exception):
        pass

    def stop_half_way(done: int, total: int | None) -> None:
        if done >= size // 2:
            raise Interrupted

    with Client(api_url, new_key(settings)) as client:
        with pytest.raises(Interrupted):
            client.upload_model(directory, "tiny", stop_half_way, part_size=part)
        assert model_archive(directory) == archive and archive.stat().st_size == size  # kept, to resume
        upload_id = UploadState(api_url, archive, "model").upload_id()
        assert upload_id is not None
        received = {p["number"] for p in client.get_upload(upload_id)["parts"]}
        sent = count_parts(client)
        model = client.upload_model(directory, "tiny", part_size=part)
        assert set(sent) == set(range(1, -(-size // part) + 1)) - received and received  # only what it lacked
        assert model["name"] == "tiny" and model["parameters"] == parameters
        assert client.get_upload(upload_id)["model_id"] == model["id"]
    assert list(uploads_directory().glob("*/*.tar")) == []  # the kept tar goes once the model is up


def test_the_async_client_uploads_in_parallel_parts_and_resumes(api_url, settings, tmp_path):
    key, path = new_key(settings), corpus(tmp_path, 500_000)
    directory = tmp_path / "llama"
    directory.mkdir()
    parameters = tiny_llama(directory)

    class Interrupted(Exception):
        pass

    after: list[int] = []  # progress reported after the interruption: parts that went on

    def stop_at(limit: int):
        def progress(done: int, total: int | None) -> None:
            if after or done >= limit:
                after.append(done)
            if len(after) == 1:
                raise Interrupted

        return progress

    async def run() -> tuple[dict, set[int], list[int], dict]:
        async with AsyncClient(api_url, key) as client:
            with pytest.raises(Interrupted):
                await client.upload_in_parts(path, "dataset", progress=stop_at(200_000), part_size=65_536, parallel=1)
            upload_id = UploadState(api_url, path, "dataset").upload_id()
            assert upload_id is not None
            received = {p["number"] for p in (await client.get_upload(upload_id))["parts"]}
            sent: list[int] = []
            send = client._send_part

            async def counting(upload_id, path, part, shared):
                sent.append(part.number)
                return await send(upload_id, path, part, shared)

            client._send_part = counting  # type: ignore[method-assign]
            done = await client.upload_in_parts(path, "dataset", part_size=65_536)
            assert done["id"] == upload_id
            resent = sorted(sent)
            model = await client.upload_model(directory, "tiny", part_size=4096)
            return await client.get_dataset(done["dataset_id"]), received, resent, model

    dataset, received, sent, model = asyncio.run(run())
    assert len(after) == 1  # the interrupted upload's other parts stopped with it
    assert dataset["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert received and sent == sorted(set(range(1, 9)) - received)  # only what it lacked
    assert model["name"] == "tiny" and model["parameters"] == parameters
    assert list(uploads_directory().glob("*/*.tar")) == []


def test_the_cli_uploads_a_file_larger_than_a_part(api_url, settings, tmp_path, cache_home):
    key = new_key(settings)
    path = corpus(tmp_path, PART_BYTES + 100_000)
    env = {**client_env(api_url, key), "XDG_CACHE_HOME": str(cache_home)}
    result = subprocess.run(command("datasets", "upload", path), env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    dataset_id = result.stdout.strip()
    assert f"uploaded {path} as {dataset_id} ({path.stat().st_size:,} bytes)" in result.stderr
    with Client(api_url, key) as client:
        assert client.get_dataset(dataset_id)["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert not any(os.scandir(cache_home / "muonforge" / "uploads"))
