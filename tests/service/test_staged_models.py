"""Operator-staged models (MUONFORGE_MODEL_DIR) on real Postgres, Redis and a worker: tiny
transformers models saved with ``save_pretrained`` into a model directory are listed beside the
tenant's uploads as ``staged:<directory>``, shown, never deleted; directories that fail the upload's
checks are left out with a warning; a job trains from one on a worker whose own model directory
holds it, and fails with ``model_missing`` on a worker whose does not; an upload that a job uses is
not deleted until the job has ended."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from rich.console import Console

from app.db.session import transaction
from app.services.auth import authenticate
from app.services.intake import insert_submissions
from app.services.submission import prepare_submission
from contract import hf
from contract.spec import JobSpec
from muonforge.output import models_table
from tests.engine.test_uploaded_models import VOCAB, save_upload
from tests.service.test_datasets import settings_changed
from tests.service.test_model_jobs import from_model
from tests.service.test_models import files_in, fresh_tenant, tar_of, tiny_llama, upload
from tests.support.api import job
from tests.support.net import wait_for
from tests.support.services import launch, service_env, stop, wait_worker

TINY = "tiny-llama"  # staged on the API host and on the worker
API_ONLY = "not-on-workers"  # staged on the API host alone
FAST = {"steps": 4, "batch_size": 4, "eval_every": 2, "checkpoint_every": 4}
ENDED = ("succeeded", "failed", "cancelled")


@pytest.fixture(scope="module")
def staged(settings, tmp_path_factory) -> Iterator[tuple[Path, Path]]:
    """The API's model directory (TINY and API_ONLY) and a worker host's (TINY alone), the API's set
    in ``settings`` for the module."""
    api_dir, worker_dir = tmp_path_factory.mktemp("staged-api"), tmp_path_factory.mktemp("staged-worker")
    save_upload(api_dir / TINY, "llama")
    shutil.copytree(api_dir / TINY, worker_dir / TINY)
    shutil.copytree(api_dir / TINY, api_dir / API_ONLY)
    with settings_changed(settings, model_dir=api_dir):
        yield api_dir, worker_dir


@pytest.fixture(scope="module")
def staged_worker(settings, staged, shared_worker, tmp_path_factory) -> Iterator[None]:
    """A worker whose MUONFORGE_MODEL_DIR is the worker host's directory (the module's shared worker,
    which has none, stopped first)."""
    shared_worker.stop()
    log_path = tmp_path_factory.mktemp("staged-worker-log") / "worker.log"
    env = service_env(settings) | {"MUONFORGE_MODEL_DIR": str(staged[1])}
    proc = launch(["worker", "--queues", "default,cpu"], env, log_path)
    try:
        wait_worker(proc, log_path)
        yield
    finally:
        stop(proc)


def ended(client, auth, job_id: str) -> dict:
    return wait_for(lambda: (j := job(client, auth, job_id))["status"] in ENDED and j, timeout=180)


def test_staged_models_are_listed_after_the_uploads_shown_to_every_tenant_and_never_deleted(client, settings, staged):
    api_dir, _ = staged
    headers, _ = fresh_tenant(settings)
    mine = upload(client, headers, tar_of(files_in(api_dir / TINY)), name="mine")
    assert mine.status_code == 201, mine.text
    assert mine.json()["source"] == "upload"

    listed = client.get("/v1/models", headers=headers).json()
    ids = [m["id"] for m in listed["data"]]
    assert ids == [mine.json()["id"], f"staged:{API_ONLY}", f"staged:{TINY}"] and listed["has_more"] is False
    staged_one = listed["data"][2]
    files = sorted(p.name for p in (api_dir / TINY).iterdir())
    assert staged_one["source"] == "staged" and staged_one["name"] == TINY and staged_one["sha256"] is None
    assert staged_one["files"] == files and "tokenizer.json" in staged_one["tokenizer_files"]
    assert staged_one["parameters"] == mine.json()["parameters"] and staged_one["model_type"] == "llama"
    assert staged_one["bytes"] == sum((api_dir / TINY / f).stat().st_size for f in files)

    console = Console(width=200, record=True)  # what `muonforge models list` draws from the list
    console.print(models_table(listed["data"]))
    rows = [line.split()[:3] for line in console.export_text().splitlines()]
    assert rows[0] == ["id", "source", "name"] and rows[1:] == [
        [ids[0], "upload", "mine"],
        [ids[1], "staged", API_ONLY],
        [ids[2], "staged", TINY],
    ]

    pages, after = [], None  # a page at a time: the upload, then each staged model
    while True:
        page = client.get("/v1/models", params={"limit": 1} | ({"after": after} if after else {}), headers=headers)
        assert page.status_code == 200, page.text
        pages.append([m["id"] for m in page.json()["data"]])
        if not page.json()["has_more"]:
            break
        after = page.json()["next_after"]
    assert pages == [[i] for i in ids]

    shown = client.get(f"/v1/models/staged:{TINY}", headers=headers)
    assert shown.status_code == 200, shown.text
    assert shown.json()["config"] == json.loads((api_dir / TINY / "config.json").read_text())
    assert shown.json()["sizes"]["vocab"] == VOCAB and shown.json()["sizes"]["layers"] == 2
    other, _ = fresh_tenant(settings)  # staged models are every tenant's; uploads the uploader's
    assert [m["id"] for m in client.get("/v1/models", headers=other).json()["data"]] == ids[1:]
    missing = client.get("/v1/models/staged:nope", headers=headers)
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model_id", missing.text

    refused = client.delete(f"/v1/models/staged:{TINY}", headers=headers)
    assert refused.status_code == 409, refused.text
    error = refused.json()["error"]
    assert error["code"] == "conflict" and error["param"] == "model_id"
    assert "staged by the service's operators" in error["message"] and "MUONFORGE_MODEL_DIR" in error["message"]
    assert (api_dir / TINY / "model.safetensors").is_file()
    assert client.get(f"/v1/models/staged:{TINY}", headers=headers).status_code == 200


def test_staged_directories_that_fail_the_checks_are_left_out_with_a_warning(client, auth, settings, tmp_path, caplog):
    root = tmp_path / "models"
    for name in ("ok", "pickled", "mismatch", "link-out"):
        (root / name).mkdir(parents=True)
        tiny_llama(root / name)
    (root / "pickled" / "pytorch_model.bin").write_bytes(b"\x80\x04N.")
    config = json.loads((root / "mismatch" / "config.json").read_text())
    (root / "mismatch" / "config.json").write_text(json.dumps(config | {"intermediate_size": 48}))
    outside = tmp_path / "outside.json"
    (root / "link-out" / "tokenizer.json").rename(outside)
    (root / "link-out" / "tokenizer.json").symlink_to(outside)
    (root / "notes").mkdir()  # no config.json: not a model directory, passed over without a word
    (root / "README.md").write_text("the operators' notes")

    def listed() -> list[str]:
        r = client.get("/v1/models", headers=auth)
        assert r.status_code == 200, r.text
        return [m["id"] for m in r.json()["data"]]

    with settings_changed(settings, model_dir=root), caplog.at_level(logging.WARNING, logger="muonforge.models"):
        assert listed() == ["staged:ok"]
        warnings = {r.getMessage() for r in caplog.records if r.levelno == logging.WARNING}
        for name, reason in (
            ("pickled", "'pytorch_model.bin' is a pickled weight file: safetensors only"),
            ("mismatch", "the weights do not match config.json"),
            ("link-out", "'tokenizer.json' is a link that leaves the directory"),
        ):
            assert any(f"staged model staged:{name} " in w and reason in w for w in warnings), (name, warnings)
        assert not any("notes" in w for w in warnings)
        assert listed() == ["staged:ok"]  # checked once per state of a directory: no warning again
        assert {r.getMessage() for r in caplog.records if r.levelno == logging.WARNING} == warnings

        r = client.post("/v1/jobs", json=from_model("staged:mismatch"), headers=auth)
        assert r.status_code == 422 and r.json()["error"]["param"] == "model.hf.model_id", r.text
        assert "fails the checks a model passes (the API's log says why" in r.json()["error"]["message"]
        r = client.get("/v1/models/staged:pickled", headers=auth)
        assert r.status_code == 404 and r.json()["error"]["param"] == "model_id", r.text
        assert str(tmp_path) not in r.text  # the operators' paths stay in the log

        (root / "pickled" / "pytorch_model.bin").unlink()  # fixed: taken at the next look
        assert listed() == ["staged:ok", "staged:pickled"]


def test_an_upload_that_a_job_uses_is_deleted_only_once_the_job_has_ended(client, auth, settings, staged):
    model = upload(client, auth, tar_of(files_in(staged[0] / TINY)))  # a model a job trains from, not fails on
    assert model.status_code == 201, model.text
    model_id = model.json()["id"]
    long_run = from_model(model_id) | {"train": {"steps": 100_000, "batch_size": 4}}  # unfinished until cancelled
    using = client.post("/v1/jobs", json=long_run, headers=auth)
    assert using.status_code == 201, using.text
    job_id = using.json()["id"]

    refused = client.delete(f"/v1/models/{model_id}", headers=auth)
    assert refused.status_code == 409, refused.text
    error = refused.json()["error"]
    assert error["code"] == "model_in_use" and error["param"] == "model_id"
    assert f"used by job {job_id} (" in error["message"] and "cancel it" in error["message"]
    assert client.get(f"/v1/models/{model_id}", headers=auth).status_code == 200

    assert client.post(f"/v1/jobs/{job_id}/cancel", headers=auth).status_code == 200
    assert ended(client, auth, job_id)["status"] == "cancelled"
    assert client.delete(f"/v1/models/{model_id}", headers=auth).status_code == 204
    assert client.get(f"/v1/models/{model_id}", headers=auth).status_code == 404


def test_a_job_prepared_before_its_model_was_deleted_is_refused_at_insert(client, auth, settings, staged):
    model = upload(client, auth, tar_of(files_in(staged[0] / TINY)))
    assert model.status_code == 201, model.text
    model_id = model.json()["id"]
    spec = JobSpec.model_validate(from_model(model_id))
    with transaction(settings) as session:
        tenant = authenticate(session, auth["Authorization"])
        submission = prepare_submission(session, tenant, spec, None, settings)
    assert client.delete(f"/v1/models/{model_id}", headers=auth).status_code == 204
    with transaction(settings) as session:
        [result] = insert_submissions(session, [submission])
    assert isinstance(result, Exception) and result.param == "model.hf.model_id", result
    assert f"no model {model_id!r}" in str(result)
    assert client.get("/v1/jobs", headers=auth).json()["data"] == []


def test_a_job_trains_from_a_staged_model_and_fails_on_a_worker_that_lacks_it(
    client, auth, settings, staged, staged_worker
):
    api_dir, _ = staged
    spec = from_model(f"staged:{TINY}") | {"train": FAST}
    created = client.post("/v1/jobs", json=spec, headers=auth)
    assert created.status_code == 201, created.text
    stored = created.json()["spec"]
    config = hf.from_upload(json.loads((api_dir / TINY / "config.json").read_text()))
    assert stored["model"]["hf"] == {"config": config, "model_id": f"staged:{TINY}"}
    assert stored["data"]["tokenizer"] == {"type": "model", "vocab_size": VOCAB}
    lacking = client.post("/v1/jobs", json=from_model(f"staged:{API_ONLY}") | {"train": FAST}, headers=auth)
    assert lacking.status_code == 201, lacking.text

    done = ended(client, auth, created.json()["id"])
    assert done["status"] == "succeeded", done["error"]
    history = client.get(f"/v1/jobs/{done['id']}/metrics", params={"names": "val_loss"}, headers=auth).json()
    points = next(s["points"] for s in history["series"] if s["name"] == "val_loss")
    assert [p[0] for p in points] == [0, 2, 4]

    failed = ended(client, auth, lacking.json()["id"])
    assert failed["status"] == "failed" and failed["error"]["code"] == "model_missing", failed["error"]
    assert f"staged model staged:{API_ONLY}" in failed["error"]["message"]
    assert "MUONFORGE_MODEL_DIR on every worker host" in failed["error"]["message"]
