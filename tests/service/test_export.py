"""GET /v1/jobs/{id}/checkpoints/{step}?format=safetensors | hf: a real worker's checkpoint, exported
by the API, reloads to the same logits as the checkpoint's own model (format=hf: in transformers
alone, with its tokenizer); a moe has no transformers export."""

from __future__ import annotations

import io
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from contract.export import CONFIG_FILE, EXPORT_FILE, GENERATION_FILE, TOKENIZER_FILES
from muonforge.transfer import extract_export
from tests.engine.test_export import logits
from tests.service.test_hf_jobs import LLAMA, hf_spec
from tests.support.api import job, new_key
from tests.support.net import wait_for
from tests.support.specs import tiny_spec
from worker.engine.config import ModelConfig
from worker.engine.export import load_safetensors
from worker.engine.models import build_model


def checkpoint_logits(content: bytes) -> torch.Tensor:
    """The logits of the model a downloaded checkpoint file holds, on the fixed input."""
    payload = torch.load(io.BytesIO(content), weights_only=True)
    model = build_model(ModelConfig(**payload["config"]["model"]))
    model.load_state_dict(payload["model"])
    return logits(model.eval(), model.cfg.vocab_size, model.cfg.seq_len)


def exported_logits(path: Path) -> torch.Tensor:
    model, config = load_safetensors(path)
    return logits(model, config["vocab_size"], config["seq_len"])


def test_the_exported_safetensors_reload_to_the_same_logits(client, settings, auth, worker, tmp_path):
    created = client.post("/v1/jobs", json=tiny_spec(steps=20), headers=auth).json()
    wait_for(lambda: job(client, auth, created["id"])["status"] == "succeeded", timeout=120)
    base = f"/v1/jobs/{created['id']}/checkpoints"
    for step in (10, 20):
        r = client.get(f"{base}/{step}", params={"format": "safetensors"}, headers=auth)
        assert r.status_code == 200 and r.headers["content-type"] == "application/octet-stream"
        assert r.headers["content-disposition"] == f'attachment; filename="{created["id"]}-step{step:08d}.safetensors"'
        assert int(r.headers["content-length"]) == len(r.content)
        exported = tmp_path / f"{step}.safetensors"
        exported.write_bytes(r.content)
        config = load_safetensors(exported)[1]
        assert {k: config[k] for k in ("arch", "n_layer", "d_model", "vocab_size")} == {
            "arch": "gpt",
            "n_layer": 1,
            "d_model": 16,
            "vocab_size": 64,
        }
        checkpoint = client.get(f"{base}/{step}", headers=auth).content  # format=pt, the default
        assert torch.allclose(exported_logits(exported), checkpoint_logits(checkpoint), rtol=0, atol=1e-6)
    assert list((settings.artifact_dir / "exports").iterdir()) == []  # each export deleted once sent
    assert client.get(f"{base}/15", params={"format": "safetensors"}, headers=auth).status_code == 404
    other = {"Authorization": f"Bearer {new_key(settings)}"}
    assert client.get(f"{base}/20", params={"format": "safetensors"}, headers=other).status_code == 404
    r = client.get(f"{base}/20", params={"format": "onnx"}, headers=auth)
    assert r.status_code == 422 and r.json()["error"]["param"] == "format"


def test_a_transformers_export_loads_with_transformers_alone(client, settings, auth, worker, tmp_path):
    spec = hf_spec(LLAMA) | {"data": {"builtin": "pysource", "tokenizer": "byte"}}  # GQA: 4 heads, 2 kv heads
    created = client.post("/v1/jobs", json=spec, headers=auth).json()
    done = wait_for(lambda: (j := job(client, auth, created["id"]))["status"] in ("succeeded", "failed") and j, 180)
    assert done["status"] == "succeeded", done["error"]
    r = client.get(f"/v1/jobs/{created['id']}/checkpoints/20", params={"format": "hf"}, headers=auth)
    assert r.status_code == 200 and r.headers["content-type"] == "application/x-tar"
    assert r.headers["content-disposition"] == f'attachment; filename="{created["id"]}-step00000020-hf.tar"'
    assert int(r.headers["content-length"]) == len(r.content)
    (tmp_path / "export.tar").write_bytes(r.content)
    written = extract_export(tmp_path / "export.tar", tmp_path / "model")
    assert sorted(p.name for p in written) == sorted([CONFIG_FILE, GENERATION_FILE, EXPORT_FILE, *TOKENIZER_FILES])
    assert list((settings.artifact_dir / "exports").iterdir()) == []  # the archive deleted once sent

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_key_value_heads == 2
    checkpoint = client.get(f"/v1/jobs/{created['id']}/checkpoints/20", headers=auth).content
    hf_logits = logits(lambda tokens: model(input_ids=tokens).logits, 256, 32)
    assert torch.allclose(hf_logits, checkpoint_logits(checkpoint), rtol=0, atol=1e-5)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "model")
    text = "def main(argv):\n    return 'héllo'\n"
    assert tokenizer(text)["input_ids"] == list(text.encode()) and tokenizer.decode(list(text.encode())) == text


def test_a_moe_has_no_transformers_export(client, auth, worker):
    spec = tiny_spec(steps=10)
    spec["model"] |= {"arch": "moe", "n_experts": 2, "top_k": 1}
    created = client.post("/v1/jobs", json=spec, headers=auth).json()
    wait_for(lambda: job(client, auth, created["id"])["status"] == "succeeded", timeout=120)
    r = client.get(f"/v1/jobs/{created['id']}/checkpoints/10", params={"format": "hf"}, headers=auth)
    assert r.status_code == 422, r.text
    assert r.json()["error"] == {
        "code": "validation_error",
        "message": "arch moe has no transformers equivalent: export its weights with format=safetensors",
        "param": "format",
    }
    safetensors = client.get(f"/v1/jobs/{created['id']}/checkpoints/10", params={"format": "safetensors"}, headers=auth)
    assert safetensors.status_code == 200
