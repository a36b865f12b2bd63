"""The jobs and datasets API on real Postgres and Redis (no worker: jobs stay queued)."""

from __future__ import annotations

import copy
import hashlib
import re

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from app.errors import install_error_handlers
from tests.support.api import new_key
from tests.support.specs import tiny_spec


def cancel_all(client, auth):
    for job in client.get("/v1/jobs?limit=100", headers=auth).json()["data"]:
        if job["status"] == "queued":
            client.post(f"/v1/jobs/{job['id']}/cancel", headers=auth)


def test_auth_is_required(client):
    for headers in ({}, {"Authorization": "Bearer mf_wrong"}, {"Authorization": "Basic abc"}):
        r = client.get("/v1/jobs", headers=headers)
        assert r.status_code == 401
        assert r.json() == {"error": {"code": "unauthorized", "message": r.json()["error"]["message"], "param": None}}


def test_unknown_paths_and_methods_answer_in_the_error_shape(client, auth):
    missing = client.get("/v1/nothing-here", headers=auth)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    wrong = client.delete("/v1/jobs", headers=auth)
    assert wrong.status_code == 405
    assert wrong.json() == {"error": {"code": "method_not_allowed", "message": "Method Not Allowed", "param": None}}


def test_create_and_get_a_job(client, auth):
    r = client.post("/v1/jobs", json=tiny_spec(), headers=auth)
    assert r.status_code == 201, r.text
    job = r.json()
    assert job["status"] == "queued" and job["attempt"] == 0
    assert job["progress"] == {"step": 0, "total_steps": 20}
    assert job["spec"]["optimizer"]["lr"] == 0.02  # defaults are filled in
    assert client.get(f"/v1/jobs/{job['id']}", headers=auth).json()["id"] == job["id"]
    cancel_all(client, auth)


def test_pagination_newest_first(client, auth):
    ids = [client.post("/v1/jobs", json=tiny_spec(), headers=auth).json()["id"] for _ in range(7)]
    seen, after = [], None
    while True:
        page = client.get("/v1/jobs", params={"limit": 3, **({"after": after} if after else {})}, headers=auth).json()
        seen += [j["id"] for j in page["data"]]
        if not page["has_more"]:
            assert page["next_after"] is None
            break
        after = page["next_after"]
    assert seen == ids[::-1]
    cancel_all(client, auth)
    cancelled = client.get("/v1/jobs", params={"status": "cancelled", "limit": 100}, headers=auth).json()
    assert len(cancelled["data"]) == 7
    assert client.get("/v1/jobs", params={"limit": 101}, headers=auth).json()["error"]["param"] == "limit"


def test_another_tenants_job_is_not_found(client, settings, auth):
    job = client.post("/v1/jobs", json=tiny_spec(), headers=auth).json()
    other = {"Authorization": f"Bearer {new_key(settings)}"}
    for method, path in (("get", f"/v1/jobs/{job['id']}"), ("post", f"/v1/jobs/{job['id']}/cancel")):
        r = getattr(client, method)(path, headers=other)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert client.get("/v1/jobs", headers=other).json()["data"] == []
    cancel_all(client, auth)


def test_cancel_a_queued_job_then_409(client, auth):
    job = client.post("/v1/jobs", json=tiny_spec(), headers=auth).json()
    r = client.post(f"/v1/jobs/{job['id']}/cancel", headers=auth)
    assert r.status_code == 200 and r.json()["status"] == "cancelled" and r.json()["finished_at"]
    r = client.post(f"/v1/jobs/{job['id']}/cancel", headers=auth)
    assert r.status_code == 409 and r.json()["error"]["code"] == "conflict"


def test_idempotency_key(client, auth):
    headers = {**auth, "Idempotency-Key": "abc-123"}
    first = client.post("/v1/jobs", json=tiny_spec(), headers=headers)
    again = client.post("/v1/jobs", json=tiny_spec(), headers=headers)
    assert first.status_code == 201 and again.status_code == 200
    assert again.json()["id"] == first.json()["id"]
    other = client.post("/v1/jobs", json=tiny_spec(steps=21), headers=headers)
    assert other.status_code == 409 and other.json()["error"]["param"] == "Idempotency-Key"
    assert len(client.get("/v1/jobs", headers=auth).json()["data"]) == 1
    for _ in range(2):  # an empty key is no key: refused, never stored (twice was a 500)
        empty = client.post("/v1/jobs", json=tiny_spec(), headers={**auth, "Idempotency-Key": ""})
        assert empty.status_code == 422 and empty.json()["error"]["param"] == "Idempotency-Key", empty.text
    assert len(client.get("/v1/jobs", headers=auth).json()["data"]) == 1
    cancel_all(client, auth)


def test_tenant_job_cap_answers_429_with_retry_after(client, settings):
    tenant = f"capped-{hashlib.sha1(str(id(client)).encode()).hexdigest()[:6]}"
    headers = {"Authorization": f"Bearer {new_key(settings, tenant)}"}
    from app.db.session import transaction
    from app.repositories.tenants import TenantRepository

    with transaction(settings) as session:
        TenantRepository(session).by_name(tenant).job_cap = 2
    assert [client.post("/v1/jobs", json=tiny_spec(), headers=headers).status_code for _ in range(3)] == [
        201,
        201,
        429,
    ]
    r = client.post("/v1/jobs", json=tiny_spec(), headers=headers)
    assert r.json()["error"]["code"] == "rate_limited" and int(r.headers["Retry-After"]) > 0
    cancel_all(client, headers)
    assert client.post("/v1/jobs", json=tiny_spec(), headers=headers).status_code == 201
    cancel_all(client, headers)


def _with(path: str, value):
    spec = copy.deepcopy(tiny_spec())
    *parents, leaf = path.split(".")
    node = spec
    for p in parents:
        node = node.setdefault(p, {})
    if value is KeyError:
        node.pop(leaf, None)
    else:
        node[leaf] = value
    return spec


INVALID = [
    (_with("model.arch", "rnn"), "model.arch"),
    (_with("model.arch", KeyError), "model.arch"),
    (_with("model.n_layer", 0), "model.n_layer"),
    (_with("model.n_head", 3), "model.d_model"),
    (_with("model.d_model", 4), "model.d_model"),
    (_with("model.seq_len", 1), "model.seq_len"),
    (_with("model.top_k", 2), "model.top_k"),
    ({**_with("model.arch", "moe"), "model": {"arch": "moe", "n_experts": 2, "top_k": 3}}, "model.top_k"),
    (_with("model.depth", 3), "model.depth"),
    (_with("data.builtin", "imagenet"), "data.builtin"),
    ({**tiny_spec(), "data": {}}, "data"),
    ({**tiny_spec(), "data": {"builtin": "synthetic", "dataset_id": "ds_x"}}, "data"),
    (_with("data.tokenizer", "bpe"), "data.tokenizer"),
    (_with("data.tokenizer", {"type": "bpe", "vocab_size": 100}), "data.tokenizer.vocab_size"),
    (_with("data.val_fraction", 0.9), "data.val_fraction"),
    (_with("data.path", "/etc/passwd") | {"data": {"path": "/etc/passwd"}}, "data.path"),
    (_with("optimizer.name", "sgd"), "optimizer.name"),
    (_with("optimizer.lr", -1), "optimizer.lr"),
    (_with("optimizer.momentum", 1.0), "optimizer.momentum"),
    (_with("optimizer.ns_steps", 0), "optimizer.ns_steps"),
    (_with("optimizer.ns_coefficients", "cubic"), "optimizer.ns_coefficients"),
    (_with("optimizer.adjust_lr", "rms"), "optimizer.adjust_lr"),
    (_with("optimizer.qk_clip_tau", 50), "optimizer.qk_clip_tau"),
    (_with("optimizer.qk_clip_remeasure", True), "optimizer.qk_clip_remeasure"),
    (_with("optimizer.qk_clip_remeasure_batches", 2), "optimizer.qk_clip_remeasure_batches"),
    (_with("optimizer.adamw_betas", [0.9, 1.5]), "optimizer.adamw_betas.1"),
    (_with("optimizer.orthogonalize", "rows"), "optimizer.orthogonalize"),
    ({**tiny_spec(), "optimizer": {"name": "adamw", "orthogonalize": "per_head"}}, "optimizer.orthogonalize"),
    (
        {**tiny_spec(), "model": {"arch": "mlp", "n_layer": 1, "d_model": 16, "seq_len": 16}}
        | {"optimizer": {"orthogonalize": "per_head"}},
        "optimizer.orthogonalize",
    ),
    (_with("train.steps", 0), "train.steps"),
    (_with("train.batch_size", 0), "train.batch_size"),
    (_with("train.lr_schedule", "linear"), "train.lr_schedule"),
    (_with("train.warmup_steps", 20), "train.warmup_steps"),
    (_with("train.device", "tpu"), "train.device"),
    (_with("train.precision", "fp8"), "train.precision"),
    (_with("train.grad_clip", -1.0), "train.grad_clip"),
    (_with("telemetry.every", 0), "telemetry.every"),
    ({**tiny_spec(), "extra": 1}, "extra"),
    (_with("train.steps", 10_000_000), "train.steps"),  # over the server's step cap
    (_with("model.d_model", 8192) | {"model": {"arch": "gpt", "n_layer": 64, "d_model": 8192}}, "model"),
    (_with("train.batch_size", 4096) | {"model": {"arch": "gpt", "seq_len": 4096}}, "train.batch_size"),
    (_with("data.dataset_id", "ds_missing") | {"data": {"dataset_id": "ds_missing"}}, "data.dataset_id"),
    # Within the parameter and batch caps, over a worker's memory: 128 x 64 x 8192^2 attention scores.
    (_with("train.batch_size", 128) | {"model": {"arch": "gpt", "n_head": 64, "seq_len": 8192}}, "train.batch_size"),
    # 64 x 64 per-head series, then 64 x 256 per-expert series, over the 1,024 per step.
    ({**tiny_spec(), "model": {"arch": "gpt", "n_layer": 64, "n_head": 64, "d_model": 64}}, "telemetry.per_head"),
    (
        {**tiny_spec(), "model": {"arch": "moe", "n_layer": 64, "d_model": 16, "n_experts": 256}},
        "telemetry.per_expert",
    ),
    (_with("train.steps", 100_000) | {"train": {"steps": 100_000, "checkpoint_every": 10}}, "train.checkpoint_every"),
    (_with("train.max_minutes", 100_000), "train.max_minutes"),  # over the server's 1,440
    (_with("train.max_minutes", 0), "train.max_minutes"),
    (_with("train.early_stop", {"patience": 2}), "train.early_stop"),  # 2 x eval_every 10 is all of the 20 steps
    (_with("train.early_stop", {"mode": "median"}), "train.early_stop.mode"),
    (_with("train.early_stop", {"metric": "accuracy"}), "train.early_stop.metric"),
    (_with("resources.nproc", 0), "resources.nproc"),
    (_with("resources.nproc", 16) | {"train": {"batch_size": 16}}, "resources.nproc"),  # over the server's 8
    (_with("resources.nnodes", 8) | {"train": {"batch_size": 8}}, "resources.nnodes"),  # over the server's 4
    (_with("resources.nnodes", 0), "resources.nnodes"),
    (_with("resources.size", 2), "resources.size"),
    # The global batch of 4 does not split over 3 processes.
    (_with("resources.nproc", 3), "train.batch_size"),
]


@pytest.mark.parametrize(("spec", "param"), INVALID, ids=[p for _, p in INVALID])
def test_invalid_specs_answer_422_with_the_offending_param(client, auth, spec, param):
    r = client.post("/v1/jobs", json=spec, headers=auth)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "validation_error" and error["param"] == param and error["message"]
    assert client.get("/v1/jobs", headers=auth).json()["data"] == []  # nothing stored


def test_the_limits_named_by_a_refusal_are_in_its_message(client, auth, settings):
    wide = {**tiny_spec(), "model": {"arch": "gpt", "n_layer": 64, "n_head": 64, "d_model": 64}}
    error = client.post("/v1/jobs", json=wide, headers=auth).json()["error"]
    assert "4,173 telemetry series per step" in error["message"] and "cap is 1,024" in error["message"]
    # The way out the message gives is taken: the per-layer series stay, the per-head ones go.
    r = client.post("/v1/jobs", json={**wide, "telemetry": {"per_head": False}}, headers=auth)
    assert r.status_code == 201, r.text
    huge = _with("train.batch_size", 128) | {"model": {"arch": "gpt", "n_head": 64, "seq_len": 8192}}
    error = client.post("/v1/jobs", json=huge, headers=auth).json()["error"]
    budget = f"{settings.worker_memory_bytes / 2**30:,.2f} GiB"
    assert re.search(r"needs about [\d,.]+ GiB", error["message"]) and budget in error["message"]
    every = _with("train.steps", 100_000) | {"train": {"steps": 100_000, "checkpoint_every": 10}}
    assert (
        "use checkpoint_every 100 or more"
        in client.post("/v1/jobs", json=every, headers=auth).json()["error"]["message"]
    )
    cancel_all(client, auth)


def test_a_job_runs_under_the_servers_time_limit_unless_its_spec_sets_a_lower_one(client, auth, settings):
    default = client.post("/v1/jobs", json=tiny_spec(), headers=auth).json()
    assert default["spec"]["train"]["max_minutes"] == settings.max_job_minutes
    own = client.post("/v1/jobs", json=_with("train.max_minutes", 2.5), headers=auth).json()
    assert own["spec"]["train"]["max_minutes"] == 2.5
    cancel_all(client, auth)


def test_a_422_lists_every_invalid_field(client, auth):
    spec = _with("optimizer.lr", -1.0) | {"train": {"steps": 0}, "extra": 1}
    error = client.post("/v1/jobs", json=spec, headers=auth).json()["error"]
    assert error["errors"] == [
        {"param": "optimizer.lr", "message": "Input should be greater than 0"},
        {"param": "train.steps", "message": "Input should be greater than 0"},
        {"param": "extra", "message": "Extra inputs are not permitted"},
    ]
    assert (error["param"], error["message"]) == ("optimizer.lr", "Input should be greater than 0")


def test_an_unexpected_error_answers_500_with_the_request_id_its_log_line_has(caplog):
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/boom")
    def boom():
        raise RuntimeError("boom")

    with TestClient(app, raise_server_exceptions=False) as c:
        made, given = c.get("/boom"), c.get("/boom", headers={"X-Request-ID": "edge-42"})
    assert made.status_code == 500
    assert made.json() == {"error": {"code": "internal", "message": "internal error", "param": None}}
    request_id = made.headers["x-request-id"]
    assert re.fullmatch(r"req_[0-9a-f]{16}", request_id) and given.headers["x-request-id"] == "edge-42"
    assert f"unhandled error (request {request_id})" in caplog.text
    assert "unhandled error (request edge-42)" in caplog.text


def test_non_json_body(client, auth):
    r = client.post("/v1/jobs", content=b"{not json", headers={**auth, "Content-Type": "application/json"})
    assert r.status_code == 422 and r.json()["error"]["code"] == "validation_error"


def test_dataset_upload_list_get_and_use(client, settings, auth):
    text = "First Citizen:\nBefore we proceed any further, hear me speak.\n" * 50
    r = client.post("/v1/datasets", files={"file": ("corpus.txt", text.encode())}, data={"name": "bard"}, headers=auth)
    assert r.status_code == 201, r.text
    ds = r.json()
    assert ds["name"] == "bard" and ds["bytes"] == len(text.encode())
    assert ds["sha256"] == hashlib.sha256(text.encode()).hexdigest()
    assert client.get(f"/v1/datasets/{ds['id']}", headers=auth).json() == ds
    assert client.get("/v1/datasets", headers=auth).json()["data"] == [ds]
    spec = tiny_spec() | {"data": {"dataset_id": ds["id"], "tokenizer": "char"}}
    assert client.post("/v1/jobs", json=spec, headers=auth).status_code == 201
    other = {"Authorization": f"Bearer {new_key(settings)}"}
    assert client.get(f"/v1/datasets/{ds['id']}", headers=other).status_code == 404
    r = client.post("/v1/jobs", json=spec, headers=other)
    assert r.status_code == 422 and r.json()["error"]["param"] == "data.dataset_id"
    cancel_all(client, auth)


def test_char_tokenizer_refuses_a_dataset_of_more_than_65536_characters(client, auth):
    text = "".join(chr(c) for c in range(0x10000 + 0x800 + 1) if not 0xD800 <= c < 0xE000)  # 65,537
    r = client.post("/v1/datasets", files={"file": ("wide.txt", text.encode())}, headers=auth)
    assert r.status_code == 201, r.text
    spec = tiny_spec() | {"data": {"dataset_id": r.json()["id"], "tokenizer": "char"}}
    r = client.post("/v1/jobs", json=spec, headers=auth)
    assert r.status_code == 422 and r.json()["error"]["param"] == "data.tokenizer"
    assert "more than 65,536 distinct characters" in r.json()["error"]["message"]
    spec["data"]["tokenizer"] = "byte"
    assert client.post("/v1/jobs", json=spec, headers=auth).status_code == 201
    cancel_all(client, auth)


def test_dataset_rejects_non_utf8_empty_and_too_large(client, settings, auth):
    r = client.post("/v1/datasets", files={"file": ("x.bin", b"abc\xff\xfe")}, headers=auth)
    assert r.status_code == 422 and r.json()["error"]["param"] == "file"
    r = client.post("/v1/datasets", files={"file": ("e.txt", b"")}, headers=auth)
    assert r.status_code == 422
    limit = settings.upload_limit_bytes
    settings.upload_limit_bytes = 1000
    try:
        r = client.post("/v1/datasets", files={"file": ("big.txt", b"a" * 1001)}, headers=auth)
    finally:
        settings.upload_limit_bytes = limit
    assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"
    assert client.get("/v1/datasets", headers=auth).json()["data"] == []
    leftovers = (
        list((settings.artifact_dir / "datasets").rglob("*.part"))
        if (settings.artifact_dir / "datasets").exists()
        else []
    )
    assert leftovers == []


def test_health_readiness_metrics_and_openapi(client, auth):
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["checks"] == {"database": "ok", "broker": "ok"}
    client.get("/v1/jobs", headers=auth)
    text = client.get("/metrics").text
    assert 'muonforge_jobs{status="queued"}' in text and "muonforge_queue_depth" in text
    assert 'muonforge_http_requests_total{method="GET",route="/v1/jobs",status="200"}' in text
    schema = client.get("/openapi.json").json()
    assert {"JobSpec", "Job", "JobList", "ErrorBody", "Dataset"} <= set(schema["components"]["schemas"])
    assert schema["components"]["schemas"]["JobSpec"]["examples"]
    assert client.get("/docs").status_code == 200


def test_restarts_and_retention_are_bounded(client, auth):
    for train, param in (
        ({"max_restarts": 11}, "train.max_restarts"),
        ({"keep_checkpoints": 0}, "train.keep_checkpoints"),
    ):
        r = client.post("/v1/jobs", json=tiny_spec(**train), headers=auth)
        assert r.status_code == 422 and r.json()["error"]["param"] == param, r.text


def test_what_schema_fuzzing_found_answers_as_documented(client, auth):
    # 405 lists every method of the path, not only those of the first route that matched it.
    r = client.request("OPTIONS", "/v1/jobs", headers=auth)
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    assert set(r.headers["allow"].split(", ")) >= {"GET", "POST"}
    # A body that is not JSON at all (not even UTF-8) is a 422 naming the body, not a 400 "internal".
    r = client.post("/v1/jobs", content=b"\xff\xfe{", headers={**auth, "Content-Type": "application/json"})
    assert r.status_code == 422 and r.json()["error"]["code"] == "validation_error", r.text
    # Text Postgres cannot hold (a NUL character) is refused by the schema, before any query.
    for path in ("/v1/jobs?after=job_%00x", "/v1/datasets?after=%00", "/v1/jobs/job_%00/metrics?names=loss"):
        r = client.get(path, headers=auth)
        assert r.status_code == 422 and r.json()["error"]["code"] == "validation_error", (path, r.text)
    r = client.post("/v1/jobs", json=tiny_spec() | {"name": "a\x00b"}, headers=auth)
    assert r.status_code == 422 and r.json()["error"]["param"] == "name"
    r = client.get("/v1/jobs/job_x/checkpoints/99999999999", headers=auth)
    assert r.status_code == 422 and r.json()["error"]["param"] == "step"


def test_checkpoints_come_a_page_at_a_time(client, settings, auth):
    from app.db.session import transaction
    from app.repositories.checkpoints import CheckpointRepository

    job_id = client.post("/v1/jobs", json=tiny_spec(), headers=auth).json()["id"]
    with transaction(settings) as session:
        for step in (10, 20, 30, 40, 50):
            CheckpointRepository(session).add_checkpoint(job_id, 1, step, f"jobs/{job_id}/x{step}.pt", 1, "0" * 64, {})
    steps, after = [], None
    for _ in range(5):
        params = {"limit": 2, **({"after": after} if after else {})}
        page = client.get(f"/v1/jobs/{job_id}/checkpoints", params=params, headers=auth).json()
        steps += [c["step"] for c in page["data"]]
        if not page["has_more"]:
            break
        after = page["next_after"]
    assert steps == [50, 40, 30, 20, 10]
    r = client.get(f"/v1/jobs/{job_id}/checkpoints", params={"limit": 101}, headers=auth)
    assert r.status_code == 422 and r.json()["error"]["param"] == "limit"
    client.post(f"/v1/jobs/{job_id}/cancel", headers=auth)
    # A cursor past the int32 steps is refused by the schema (it was a 500 from Postgres).
    r = client.get(f"/v1/jobs/{job_id}/checkpoints", params={"after": 2484402288}, headers=auth)
    assert r.status_code == 422 and r.json()["error"]["param"] == "after"
