"""GET /v1/jobs/{id}/checkpoints/{step}?format=safetensors: a real worker's checkpoint, exported by
the API, reloads to the same logits as the checkpoint's own model."""

from __future__ import annotations

import io
from pathlib import Path

import torch

from tests.engine.test_export import logits
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
