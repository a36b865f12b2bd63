"""arch hf through the service: a transformers llama trains with MuonClip on a real worker, its
spec is stored with every shape field filled in, and a config the engine cannot honour is a 422
at its field."""

from __future__ import annotations

from tests.support.api import job
from tests.support.net import wait_for

LLAMA = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def hf_spec(config: dict, **optimizer) -> dict:
    return {
        "name": "llama-muonclip",
        "model": {"arch": "hf", "seq_len": 32, "hf": {"config": config}},
        "data": {"builtin": "synthetic"},
        "optimizer": {"name": "muonclip", **optimizer},
        "train": {"steps": 20, "batch_size": 4, "eval_every": 10, "checkpoint_every": 20},
    }


def test_a_llama_trains_with_muonclip_and_reports_each_head(client, auth, worker):
    created = client.post("/v1/jobs", json=hf_spec(LLAMA, qk_clip_tau=50.0), headers=auth)
    assert created.status_code == 201, created.text
    body = created.json()
    model = body["spec"]["model"]
    assert (model["n_layer"], model["n_head"], model["d_model"]) == (2, 4, 32)
    assert model["hf"]["config"] == LLAMA | {
        "head_dim": 8,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "max_position_embeddings": 32,
    }
    ended = ("succeeded", "failed")
    done = wait_for(lambda: (j := job(client, auth, body["id"]))["status"] in ended and j, timeout=180)
    assert done["status"] == "succeeded", done["error"]
    assert 0 < done["summary"]["attn_max_logit"] <= 50.0 * 1.5
    series = client.get(f"/v1/jobs/{body['id']}/metrics", params={"name": "attn_max_logit/l1h3"}, headers=auth)
    points = series.json()["series"][0]["points"]
    assert len(points) == 20 and all(p[1] is not None for p in points)


def test_a_config_the_engine_cannot_honour_is_a_422_at_its_field(client, auth):
    for config, words in (
        (LLAMA | {"vocab_size": 1000}, "vocabulary comes from data.tokenizer"),
        (LLAMA | {"model_type": "bert"}, "model_type must be one of"),
        (LLAMA | {"auto_map": {"AutoModel": "evil.Model"}}, "no code is loaded"),
    ):
        r = client.post("/v1/jobs", json=hf_spec(config), headers=auth)
        assert r.status_code == 422, r.text
        error = r.json()["error"]
        assert error["param"] == "model.hf.config" and words in error["message"], error
