"""GET /v1/jobs/{id}/routing: the parameter routing table a job's worker records, for a gpt job, a
transformers llama and a job of two processes; replaced by a resumed attempt; awaiting before the
model is built, unavailable for a job that ended without one; 404 for another tenant."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
from torch import nn

from app.db.base import utcnow
from app.db.session import transaction
from app.messaging.live_bus import NoBus
from app.services import lifecycle
from contract.spec import JobSpec
from tests.service.test_hf_jobs import LLAMA, hf_spec
from tests.support.api import job, new_key
from tests.support.net import wait_for
from tests.support.specs import group_spec, tiny_spec
from tests.support.telemetry import stored_job
from worker.engine import facts
from worker.engine.optimizer import routing_lines, routing_table
from worker.sink import JobSink, LeaseLost

ENDED = ("succeeded", "failed", "cancelled")


def finished(client, auth, spec: dict) -> dict:
    """Submit ``spec`` and wait until the job has succeeded."""
    created = client.post("/v1/jobs", json=spec, headers=auth)
    assert created.status_code == 201, created.text
    done = wait_for(lambda: (j := job(client, auth, created.json()["id"]))["status"] in ENDED and j, timeout=180)
    assert done["status"] == "succeeded", done["error"]
    return done


def routing(client, auth, job_id: str) -> dict:
    r = client.get(f"/v1/jobs/{job_id}/routing", headers=auth)
    assert r.status_code == 200, r.text
    return r.json()


def parameter_count(spec: dict) -> int:
    """The job's parameter count as the service's admission computes it (a tied head once)."""
    validated = JobSpec.model_validate(spec)
    return facts.parameter_count(validated.model, facts.vocabulary(validated.data))


def check_totals(table: dict, spec: dict) -> dict[str, dict]:
    """Every parameter once, the shares adding up to the model's parameter count; the rows by name."""
    rows = {p["name"]: p for p in table["parameters"]}
    assert len(rows) == len(table["parameters"])
    summary = table["summary"]
    for optimizer in ("muon", "adamw"):
        taken = [p for p in rows.values() if p["optimizer"] == optimizer]
        assert summary[optimizer] == {"parameters": len(taken), "values": sum(p["values"] for p in taken)}
    assert summary["total"]["parameters"] == len(rows)
    assert summary["total"]["values"] == summary["muon"]["values"] + summary["adamw"]["values"]
    assert summary["total"]["values"] == parameter_count(spec)
    return rows


def test_a_gpt_job_routes_its_hidden_matrices_to_muon_and_the_rest_to_adamw(client, settings, auth, worker):
    spec = tiny_spec(steps=2, eval_every=2, checkpoint_every=2)
    done = finished(client, auth, spec)
    table = routing(client, auth, done["id"])
    assert (table["job_id"], table["state"], table["message"]) == (done["id"], "recorded", None)
    assert (table["optimizer"], table["attempt"], table["warnings"]) == ("muon", done["attempt"], [])
    rows = check_totals(table, spec)
    assert rows["wte.weight"] | {"values": 0} == {
        "name": "wte.weight",
        "shape": [facts.vocabulary(JobSpec.model_validate(spec).data), 16],
        "optimizer": "adamw",
        "role": "embedding_or_norm",
        "reason": "embedding or norm",
        "values": 0,
        "warning": None,
    }
    muon = {name for name, p in rows.items() if p["optimizer"] == "muon"}
    assert muon == {f"blocks.0.{m}.weight" for m in ("attn.qkv", "attn.proj", "ffn.up", "ffn.down")}
    assert {p["role"] for p in rows.values() if p["optimizer"] == "muon"} == {"hidden_matrix"}
    assert all(p["role"] == "embedding_or_norm" for name, p in rows.items() if "ln" in name or name.startswith("w"))
    assert "lm_head.weight" not in rows  # tied to wte: routed once, under the embedding's name

    other = {"Authorization": f"Bearer {new_key(settings)}"}
    r = client.get(f"/v1/jobs/{done['id']}/routing", headers=other)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", r.text


def test_a_llama_routes_its_head_embeddings_and_norms_to_adamw(client, auth, worker):
    spec = hf_spec(LLAMA) | {"train": {"steps": 2, "batch_size": 2, "eval_every": 2, "checkpoint_every": 2}}
    done = finished(client, auth, spec)
    table = routing(client, auth, done["id"])
    assert table["optimizer"] == "muonclip"
    rows = check_totals(table, spec)
    assert rows["net.lm_head.weight"]["role"] == "output_head"
    assert rows["net.model.embed_tokens.weight"]["role"] == "embedding_or_norm"
    for name, p in rows.items():
        if name.endswith("_proj.weight"):  # attention and MLP projections
            assert (p["optimizer"], p["role"]) == ("muon", "hidden_matrix"), p
        else:
            assert p["optimizer"] == "adamw", p
        if name.endswith("norm.weight"):  # LlamaRMSNorm: a norm by its class name
            assert p["role"] == "embedding_or_norm", p
    assert table["summary"]["muon"]["parameters"] == 2 * 7  # q, k, v, o, gate, up, down per layer


def test_a_job_of_two_processes_records_its_table_once(client, auth, worker):
    spec = group_spec(2) | {"train": {"steps": 2, "batch_size": 4, "eval_every": 2, "checkpoint_every": 2}}
    done = finished(client, auth, spec)
    check_totals(routing(client, auth, done["id"]), spec)


def test_a_job_not_started_is_awaiting_and_a_resumed_attempt_replaces_the_table(client, settings, auth):
    job_id = stored_job(settings, auth["Authorization"].split()[1], tiny_spec())  # no task sent
    table = routing(client, auth, job_id)
    assert table | {"message": None} == {
        "job_id": job_id,
        "state": "awaiting",
        "message": None,
        "optimizer": "muon",
        "attempt": None,
        "parameters": [],
        "summary": None,
        "warnings": [],
    }
    assert "has not started" in table["message"]

    def claim() -> int:
        with transaction(settings) as session:
            return lifecycle.claim(session, NoBus(), job_id, "test", timedelta(minutes=1)).attempt

    first = claim()
    table = routing(client, auth, job_id)
    assert table["state"] == "awaiting" and "is starting" in table["message"], table
    row = {"name": "w", "shape": [2, 3], "optimizer": "muon", "role": "hidden_matrix", "reason": "hidden matrix"}
    stale = JobSink(settings, job_id, first, 0, {})
    stale.routing({"optimizer": "muon", "parameters": [row | {"warning": None}]})
    table = routing(client, auth, job_id)
    assert (table["state"], table["message"], table["attempt"]) == ("recorded", None, first)
    assert table["summary"]["muon"] == {"parameters": 1, "values": 6}

    with transaction(settings) as session:  # the attempt is lost; the next one resumes the job
        lifecycle.release(session, NoBus(), job_id, first, "test", utcnow())
    second = claim()
    with pytest.raises(LeaseLost):
        stale.routing({"optimizer": "muon", "parameters": []})
    stale.close()
    odd = row | {"shape": [4, 5], "optimizer": "adamw", "role": "unrecognized", "warning": "AdamW takes it"}
    resumed = JobSink(settings, job_id, second, 0, {})
    resumed.routing({"optimizer": "muon", "parameters": [odd]})
    resumed.close()
    table = routing(client, auth, job_id)
    assert (table["attempt"], table["warnings"]) == (second, ["AdamW takes it"])
    assert table["summary"]["adamw"] == table["summary"]["total"] == {"parameters": 1, "values": 20}
    with transaction(settings) as session:
        lifecycle.finish(session, NoBus(), job_id, second, "cancelled", 0, {})


def test_a_job_cancelled_before_it_started_has_no_table(client, settings, auth):
    job_id = stored_job(settings, auth["Authorization"].split()[1], tiny_spec())
    assert client.post(f"/v1/jobs/{job_id}/cancel", headers=auth).json()["status"] == "cancelled"
    table = routing(client, auth, job_id)
    assert (table["state"], table["parameters"], table["summary"]) == ("unavailable", [], None)
    assert "ended (cancelled)" in table["message"]


class Odd(nn.Module):
    """Two Linears (the last one the head) and a bare matrix no rule recognizes."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(4, 8, bias=False)
        self.down = nn.Linear(8, 4, bias=False)
        self.extra = nn.Parameter(torch.zeros(3, 5))


def test_the_table_warns_of_an_unrecognized_matrix_and_an_adamw_job_steps_all_with_adamw():
    muon = routing_table(Odd(), "muon")
    assert [(p["name"], p["optimizer"], p["role"]) for p in muon["parameters"]] == [
        ("extra", "adamw", "unrecognized"),
        ("up.weight", "muon", "hidden_matrix"),
        ("down.weight", "adamw", "output_head"),
    ]
    warning = "parameter extra [3x5] is a matrix of an unrecognized module: AdamW takes it, not Muon"
    assert [p["warning"] for p in muon["parameters"]] == [warning, None, None]
    assert ("warning", warning) in routing_lines(Odd())  # the job's log warns in the same words

    adamw = routing_table(Odd(), "adamw")
    assert {p["optimizer"] for p in adamw["parameters"]} == {"adamw"}
    assert [p["role"] for p in adamw["parameters"]] == [p["role"] for p in muon["parameters"]]
    assert all(p["warning"] is None for p in adamw["parameters"])  # nothing is kept from Muon
