"""A job that starts from an uploaded model, through the service: a tiny llama goes up with its
tokenizer, a job names it (``model.hf.model_id``, ``data.tokenizer: {type: model}``), its stored
spec holds the upload's config and vocabulary, and its first evaluation is the uploaded weights'
loss on the builtin text; every rule of such a spec is a 422 at its field."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from contract import hf
from contract.spec import JobSpec
from tests.engine.test_uploaded_models import VOCAB, save_upload
from tests.service.test_models import files_in, fresh_tenant, tar_of, tiny_llama, upload
from tests.support.api import events, job
from tests.support.net import wait_for
from worker.engine.config import EVAL_BATCHES
from worker.engine.data import load_data


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return save_upload(tmp_path_factory.mktemp("llama"), "llama")


def uploaded(client, auth, directory: Path) -> str:
    r = upload(client, auth, tar_of(files_in(directory)))
    assert r.status_code == 201, r.text
    return r.json()["id"]


def from_model(model_id: str, seq_len: int = 32, **tokenizer) -> dict:
    return {
        "model": {"arch": "hf", "seq_len": seq_len, "hf": {"model_id": model_id}},
        "data": {"builtin": "pysource", "tokenizer": {"type": "model", **tokenizer}},
        "optimizer": {"name": "muonclip"},
        "train": {"steps": 10, "batch_size": 4, "eval_every": 5, "checkpoint_every": 10},
        "telemetry": {"sample_tokens": 0},
    }


def expected_val_loss(directory: Path, spec: JobSpec, cache: Path) -> float:
    """The uploaded model's loss, computed by transformers, on the batches the engine evaluates."""
    from transformers import AutoModelForCausalLM

    data = load_data(spec.data, spec.train.seed, cache, model_dir=directory)
    model = AutoModelForCausalLM.from_pretrained(directory).eval()
    losses = []
    with torch.no_grad():
        for i in range(EVAL_BATCHES):
            x, y = data.batch("val", i, spec.train.batch_size, spec.model.seq_len, spec.train.seed)
            logits = model(input_ids=x).logits
            losses.append(F.cross_entropy(logits.flatten(0, 1), y.flatten()))
    return float(torch.stack(losses).mean())


def test_a_job_starts_from_an_uploaded_llama_and_its_tokenizer(client, auth, settings, worker, llama_dir, tmp_path):
    model_id = uploaded(client, auth, llama_dir)
    created = client.post("/v1/jobs", json=from_model(model_id), headers=auth)
    assert created.status_code == 201, created.text
    body = created.json()
    stored = body["spec"]
    config = hf.from_upload(files_config(llama_dir))
    assert stored["model"]["hf"] == {"config": config, "model_id": model_id}
    assert "vocab_size" not in stored["model"]["hf"]["config"]
    assert (stored["model"]["n_layer"], stored["model"]["n_head"], stored["model"]["d_model"]) == (2, 4, 32)
    assert stored["data"]["tokenizer"] == {"type": "model", "vocab_size": VOCAB}
    ended = ("succeeded", "failed")
    done = wait_for(lambda: (j := job(client, auth, body["id"]))["status"] in ended and j, timeout=180)
    assert done["status"] == "succeeded", done["error"]
    history = client.get(f"/v1/jobs/{body['id']}/metrics", params={"names": "val_loss"}, headers=auth).json()
    points = next(s["points"] for s in history["series"] if s["name"] == "val_loss")
    assert [p[0] for p in points] == [0, 5, 10]
    expected = expected_val_loss(llama_dir, JobSpec.model_validate(stored), tmp_path / "cache")
    assert points[0][1] == pytest.approx(expected, abs=1e-4)
    assert points[-1][1] < points[0][1]
    lines = [p.get("message", "") for kind, p in events(settings, body["id"]) if kind == "log"]
    assert any(line.startswith(f"starting from model {model_id} (") for line in lines), lines
    again = client.post("/v1/jobs", json=stored | {"name": "again"}, headers=auth)  # a stored spec submits as is
    assert again.status_code == 201, again.text


def files_config(directory: Path) -> dict:
    import json

    return json.loads((directory / "config.json").read_text())


def test_the_rules_of_a_spec_from_an_uploaded_model_are_422s_at_their_field(
    client, auth, settings, llama_dir, tmp_path
):
    model_id = uploaded(client, auth, llama_dir)
    bare = tmp_path / "bare"
    bare.mkdir()
    tiny_llama(bare)
    (bare / "tokenizer.json").unlink()
    without_tokenizer = uploaded(client, auth, bare)
    other_config = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1}
    other_config |= {"num_attention_heads": 4}
    cases = [
        (from_model("mdl_nope"), "model.hf.model_id", "no model 'mdl_nope' for this tenant"),
        (from_model(model_id) | {"data": {"builtin": "pysource"}}, "data.tokenizer", "set data.tokenizer to"),
        (
            {**from_model(model_id), "model": {"arch": "hf", "seq_len": 32, "hf": {"config": other_config}}},
            "data.tokenizer",
            "needs model.hf.model_id",
        ),
        (from_model(without_tokenizer), "data.tokenizer", "has no tokenizer.json"),
        (from_model(model_id, seq_len=128), "model.seq_len", "exceeds model"),
        (from_model(model_id, vocab_size=1000), "data.tokenizer.vocab_size", f"({VOCAB})"),
        (
            {
                **from_model(model_id),
                "model": {"arch": "hf", "seq_len": 32, "hf": {"model_id": model_id, "config": other_config}},
            },
            "model.hf.config",
            "leave it out",
        ),
    ]
    other_tenant, _ = fresh_tenant(settings)
    r = client.post("/v1/jobs", json=from_model(model_id), headers=other_tenant)  # another tenant's: as a missing one
    assert r.status_code == 422 and r.json()["error"]["param"] == "model.hf.model_id", r.text
    assert f"no model {model_id!r} for this tenant" in r.json()["error"]["message"]
    for spec, param, words in cases:
        r = client.post("/v1/jobs", json=spec, headers=auth)
        assert r.status_code == 422, r.text
        error = r.json()["error"]
        assert error["param"] == param and words in error["message"], (param, error)
