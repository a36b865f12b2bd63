"""The app never imports the worker, so facts and defaults it shares with the engine and the
optimizer are written twice; these tests tie every copy to the original."""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import json

import pytest
import torch

import optim
from app.job_status import FINISHED, JobStatus
from app.schemas import JobSpec
from app.schemas.api import Job
from app.schemas.job_spec import EarlyStopSpec
from app.services import caps, export, intake
from muonforge import client, transfer
from worker.engine import data as engine_data
from worker.engine import export as engine_export
from worker.engine.config import (
    EarlyStopConfig,
    ModelConfig,
    OptimizerConfig,
    ResourcesConfig,
    TelemetryConfig,
    TrainConfig,
    job_config_from_dict,
)
from worker.engine.models import attention as engine_attention
from worker.engine.models import build_model
from worker.engine.models import gpt as engine_gpt
from worker.engine.optimizer import NS_DTYPES
from worker.engine.run import run_job

SHAPES = {  # (n_layer, n_head, d_model, seq_len), a grid that crosses every term of the count
    "gpt": list(itertools.product((1, 3), (1, 4), (8, 48), (2, 9, 64))),
    "moe": list(itertools.product((1, 2), (2,), (8, 32), (16,))),
    "mlp": list(itertools.product((1, 3), (1,), (8, 40), (2, 8, 30))),
}
VOCABS = (64, 256, 97)


def engine_parameter_count(model: dict, vocab: int) -> int:
    cfg = dataclasses.replace(job_config_from_dict({"model": model, "data": {"builtin": "synthetic"}}).model,
                              vocab_size=vocab)  # fmt: skip
    return sum(p.numel() for p in build_model(cfg).parameters())  # a tied head is one parameter


@pytest.mark.parametrize("arch", ["gpt", "moe", "mlp"])
def test_parameter_count_of_the_caps_is_the_engines(arch):
    torch.manual_seed(0)
    for (n_layer, n_head, d_model, seq_len), vocab in itertools.product(SHAPES[arch], VOCABS):
        model = {"arch": arch, "n_layer": n_layer, "n_head": n_head, "d_model": d_model, "seq_len": seq_len}
        if arch == "moe":
            model |= {"n_experts": 3, "top_k": 2}
        dumped = JobSpec.model_validate({"model": model, "data": {"builtin": "synthetic"}}).model_dump()["model"]
        assert caps.parameter_count(dumped, vocab) == engine_parameter_count(dumped, vocab), (model, vocab)


def test_engine_facts_copied_into_the_app():
    assert caps.SYNTHETIC_VOCAB == engine_data.SYNTHETIC_VOCAB == engine_data.synthetic_task(0).vocab_size
    assert caps.MLP_CONTEXT == engine_gpt.MLP_CONTEXT
    assert caps.MLP_RATIO == ModelConfig(arch="gpt").mlp_ratio


def test_the_apps_pysource_vocabulary_is_the_engines(tmp_path):
    """The parameter cap counts exactly the vocabulary the engine builds for the builtin text."""
    for tokenizer in ("byte", "char"):
        data = {"builtin": "pysource", "tokenizer": tokenizer}
        spec = JobSpec.model_validate({"model": {"arch": "gpt"}, "data": data})
        engine = engine_data.load_data(job_config_from_dict(spec.model_dump()).data, 0, tmp_path).vocab_size
        assert (
            intake.data_facts(None, None, spec.model_dump()["data"])
            == (engine, 0)
            == (256 if tokenizer == "byte" else 128, 0)
        )
    assert caps.PYSOURCE_CHAR_VOCAB == len(engine_data.PYSOURCE_CHARS)
    assert caps.CHAR_VOCAB_MAX == engine_data.CHAR_VOCAB_MAX


def spec_defaults(section: str) -> dict:
    """A minimal spec's section, every default filled in by validation."""
    return JobSpec.model_validate({"model": {"arch": "gpt"}, "data": {"builtin": "synthetic"}}).model_dump()[section]


@pytest.mark.parametrize(
    ("section", "config", "filled_by_the_spec"),
    [
        # The engine trusts a validated spec: n_experts / top_k are set for moe only, by the spec.
        ("model", ModelConfig, {"arch", "n_experts", "top_k"}),
        ("train", TrainConfig, set()),
        ("telemetry", TelemetryConfig, set()),
        ("resources", ResourcesConfig, set()),
        # lr: the spec's default depends on the optimizer (below); qk_clip_tau: muonclip only.
        ("optimizer", OptimizerConfig, {"qk_clip_tau"}),
    ],
)
def test_job_spec_defaults_are_the_engines(section, config, filled_by_the_spec):
    spec = spec_defaults(section)
    engine = {f.name: f.default for f in dataclasses.fields(config) if f.default is not dataclasses.MISSING}
    for name, value in spec.items():
        if name not in filled_by_the_spec:
            assert engine[name] == value, f"{section}.{name}"


def test_job_spec_optimizer_defaults_are_optims():
    muon = {k: p.default for k, p in inspect.signature(optim.Muon).parameters.items() if k != "params"}
    # Data parallelism is how a process runs the optimizer, not a job's hyper-parameter (a job trains in one process).
    process = {k: muon.pop(k) for k in ("distributed", "process_group", "shard_momentum")}
    assert process == {"distributed": False, "process_group": None, "shard_momentum": False}
    spec = spec_defaults("optimizer")
    for name, default in muon.items():
        if name == "ns_dtype":  # the spec names the dtype ("auto" for the device's choice, None)
            assert NS_DTYPES[spec[name]] == default, name
            continue
        assert spec[name] == default, name
    adamw = JobSpec.model_validate(
        {"model": {"arch": "gpt"}, "data": {"builtin": "synthetic"}, "optimizer": {"name": "adamw"}}
    ).model_dump()["optimizer"]
    assert adamw["lr"] == spec["adamw_lr"]  # the AdamW baseline at the lr of Muon's AdamW part
    clip = JobSpec.model_validate(
        {"model": {"arch": "gpt"}, "data": {"builtin": "synthetic"}, "optimizer": {"name": "muonclip"}}
    ).model_dump()["optimizer"]
    assert clip["qk_clip_tau"] == inspect.signature(optim.MuonClip).parameters["qk_clip_tau"].default


def test_the_clients_statuses_are_the_services():
    assert set(client.FINISHED) == {s.value for s in FINISHED}
    assert Job.model_json_schema()["$defs"]["JobStatus"]["enum"] == [s.value for s in JobStatus]


@pytest.mark.parametrize(
    ("arch", "optimizer", "per_head", "per_expert"),
    [("gpt", "muon", True, True), ("gpt", "muonclip", False, True), ("gpt", "adamw", True, True),
     ("moe", "muon", True, True), ("moe", "muonclip", True, False), ("moe", "adamw", False, False),
     ("mlp", "muon", True, True)],
)  # fmt: skip
def test_the_series_count_of_the_caps_is_what_the_engine_reports(tmp_path, arch, optimizer, per_head, per_expert):
    model = {"arch": arch, "n_layer": 3, "d_model": 16, "seq_len": 8} | ({} if arch == "mlp" else {"n_head": 2})
    spec = JobSpec.model_validate(
        {
            "model": model | ({"n_experts": 5, "top_k": 2} if arch == "moe" else {}),
            "data": {"builtin": "synthetic"},
            "optimizer": {"name": optimizer},
            "train": {"steps": 2, "batch_size": 2, "eval_every": 1},
            "telemetry": {"sample_tokens": 0, "per_head": per_head, "per_expert": per_expert},
        }
    ).model_dump(mode="json")
    run_job(spec, tmp_path)
    reported = [set(json.loads(line)["metrics"]) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert max(len(names) for names in reported) == caps.series_per_step(spec)
    assert any(name.count("h") and name.startswith("attn_max_logit/l") for name in set().union(*reported)) == (
        per_head and arch != "mlp"
    )


def test_the_memory_caps_max_logit_block_is_the_engines():
    assert caps.MAX_LOGIT_BLOCK == engine_attention.MAX_LOGIT_BLOCK


def test_early_stop_defaults_are_the_engines():
    engine = {f.name: f.default for f in dataclasses.fields(EarlyStopConfig)}
    assert EarlyStopSpec().model_dump() == engine


def test_the_export_metadata_key_is_the_engines_and_the_clients():
    assert export.EXPORT_KEY == engine_export.EXPORT_KEY == transfer.EXPORT_KEY
