"""The contract (contract/) is the one declaration of statuses, spec fields and defaults, and
metric names: no other module declares them again, and the engine's facts that the API computes
before a job runs are what the engine really builds and reports."""

from __future__ import annotations

import ast
import inspect
import itertools
import json
import re
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

import optim
from contract import metrics, status, webhooks
from contract import spec as contract_spec
from contract.spec import NORMUON, DataSpec, JobSpec, error_path
from worker.engine import data as engine_data
from worker.engine.config import ModelConfig, job_config
from worker.engine.facts import parameter_count, series_per_step, vocabulary
from worker.engine.models import ARCHITECTURES, build_model
from worker.engine.optimizer import NS_DTYPES
from worker.engine.request import RunRequest
from worker.engine.run import run_job

ROOT = Path(__file__).resolve().parents[1]
# The product. Not optim, a library of its own (torch only); not migrations, frozen at their revision;
# not bench and tests, which use the names as an outside client does.
SERVICE_CODE = ("app", "worker", "muonforge")
STATUS_WORDS = {
    s.value for e in (status.JobStatus, status.SweepStatus, status.TrialStatus, webhooks.DeliveryStatus) for s in e
}
METRIC_NAMES = {v for k, v in vars(metrics).items() if k.isupper() and isinstance(v, str)} - {metrics.OPTIM_PREFIX}
METRIC_FAMILIES = ("attn_max_logit/", "router/", "qk_clip/", "logits/", metrics.OPTIM_PREFIX)


def python_files(*roots: str) -> list[Path]:
    return sorted(p for root in roots for p in (ROOT / root).rglob("*.py"))


def web_files() -> list[Path]:
    return sorted((ROOT / "app/web/static").glob("*.js")) + sorted((ROOT / "app/web/templates").glob("*.html"))


def spelled(path: Path) -> list[tuple[int, str]]:
    """The string constants of a module that are code, not prose: no docstring, and no key read
    out of a mapping (``record["completed"]`` is a field, ``group["lr"]`` torch's own key)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            skip.add(id(body[0].value))  # a docstring (or a bare string statement)
        if isinstance(node, ast.Subscript):
            skip.add(id(node.slice))
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip
    ]


def test_statuses_are_spelled_only_in_the_contract():
    """A status written out anywhere else (a tuple of final states, a comparison with "paused")
    is a copy that can drift: every side imports contract.status, the pages get it embedded."""
    found = [
        f"{p.relative_to(ROOT)}:{line} {v!r}"
        for p in python_files(*SERVICE_CODE)
        for line, v in spelled(p)
        if v in STATUS_WORDS
    ]
    quoted = re.compile(r"""["'`](""" + "|".join(sorted(STATUS_WORDS)) + r""")["'`]""")
    found += [f"{p.relative_to(ROOT)} {m.group(0)}" for p in web_files() for m in quoted.finditer(p.read_text())]
    assert found == []


def test_metric_names_are_spelled_only_in_the_contract():
    found = [
        f"{p.relative_to(ROOT)}:{line} {v!r}"
        for p in python_files(*SERVICE_CODE)
        for line, v in spelled(p)
        if v in METRIC_NAMES or v.startswith(METRIC_FAMILIES)
    ]
    names = "|".join(re.escape(n) for n in sorted(METRIC_NAMES | set(METRIC_FAMILIES)))
    quoted = re.compile(r"""["'`](""" + names + ")")
    found += [f"{p.relative_to(ROOT)} {m.group(0)}" for p in web_files() for m in quoted.finditer(p.read_text())]
    assert found == []


def spec_sections() -> dict[str, set[str]]:
    return {
        name: set(obj.model_fields)
        for name, obj in vars(contract_spec).items()
        if inspect.isclass(obj)
        and issubclass(obj, contract_spec.BaseModel)
        and obj.__module__ == contract_spec.__name__
    }


def test_spec_defaults_are_declared_only_in_the_contract():
    """No class outside the contract gives defaults to three or more fields of a spec section
    (as the engine's dataclasses once did): the engine takes the spec's own sections. A None
    default (a field a network may not have: n_experts, hf) declares no value."""
    sections = {k: v for k, v in spec_sections().items() if len(v) >= 3}
    found = []
    for path in python_files(*SERVICE_CODE):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ClassDef):
                continue
            defaulted = {
                s.target.id
                for s in node.body
                if isinstance(s, ast.AnnAssign)
                and isinstance(s.target, ast.Name)
                and s.value is not None
                and not (isinstance(s.value, ast.Constant) and s.value.value is None)
            }
            found += [
                f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ~ {section}"
                for section, names in sections.items()
                if len(defaulted & names) >= 3
            ]
    assert found == []


def test_the_optimizers_defaults_are_the_specs():
    """optim imports torch only, so its signature's defaults are checked against the contract here,
    in one place."""
    muon = {k: p.default for k, p in inspect.signature(optim.Muon).parameters.items() if k != "params"}
    # Data parallelism is how a process runs the optimizer, not a job's hyper-parameter.
    process = {k: muon.pop(k) for k in ("distributed", "process_group", "shard_momentum")}
    assert process == {"distributed": False, "process_group": None, "shard_momentum": False}
    spec = JobSpec.model_validate({"model": {"arch": "gpt"}, "data": {"builtin": "synthetic"}}).optimizer
    assert muon.pop("normuon") is (spec.name in NORMUON) is False  # the spec names NorMuon by optimizer.name
    for name, default in muon.items():
        expected = NS_DTYPES[spec.ns_dtype] if name == "ns_dtype" else getattr(spec, name)
        assert expected == default, name
    for name, field in (("adamw", "lr"), ("muonclip", "qk_clip_tau")):
        section = JobSpec.model_validate(
            {"model": {"arch": "gpt"}, "data": {"builtin": "synthetic"}, "optimizer": {"name": name}}
        ).optimizer
        reference = spec.adamw_lr if name == "adamw" else inspect.signature(optim.MuonClip).parameters[field].default
        assert getattr(section, field) == reference, (name, field)


def test_every_status_is_reachable_and_a_finished_one_is_final():
    for rule in status.TRANSITIONS:
        assert rule.sources and rule.targets and not rule.sources & status.FINISHED, rule.name
    assert all(not status.ALLOWED[s] for s in status.FINISHED)
    reachable, frontier = {status.INITIAL}, [status.INITIAL]
    while frontier:
        for target in status.ALLOWED[frontier.pop()] - reachable:
            reachable.add(target)
            frontier.append(target)
    assert reachable == set(status.JobStatus)


def test_every_arch_of_the_spec_has_a_model_and_no_other():
    assert sorted(contract_spec.choices()["model.arch"]) == sorted(ARCHITECTURES)


SHAPES = {  # (n_layer, n_head, d_model, seq_len), a grid that crosses every term of the count
    "gpt": list(itertools.product((1, 3), (1, 4), (8, 48), (2, 9, 64))),
    "moe": list(itertools.product((1, 2), (2,), (8, 32), (16,))),
    "mlp": list(itertools.product((1, 3), (1,), (8, 40), (2, 8, 30))),
}
VOCABS = (64, 256, 97)


@pytest.mark.parametrize("arch", ["gpt", "moe", "mlp"])
def test_the_parameter_count_is_the_built_models(arch):
    torch.manual_seed(0)
    for (n_layer, n_head, d_model, seq_len), vocab in itertools.product(SHAPES[arch], VOCABS):
        model = {"arch": arch, "n_layer": n_layer, "n_head": n_head, "d_model": d_model, "seq_len": seq_len}
        if arch == "moe":
            model |= {"n_experts": 3, "top_k": 2}
        section = JobSpec.model_validate({"model": model, "data": {"builtin": "synthetic"}}).model
        built = build_model(ModelConfig.of(section, vocab))
        assert parameter_count(section, vocab) == sum(p.numel() for p in built.parameters()), model


def test_the_builtin_vocabularies_are_the_loaded_datas(tmp_path):
    """The parameter cap counts exactly the vocabulary the engine builds for the builtin tasks."""
    assert vocabulary(DataSpec(builtin="synthetic")) == engine_data.synthetic_task(0).vocab_size
    for tokenizer, size in (("byte", 256), ("char", 128)):
        spec = JobSpec.model_validate(
            {"model": {"arch": "gpt"}, "data": {"builtin": "pysource", "tokenizer": tokenizer}}
        )
        loaded = engine_data.load_data(job_config(spec).data, 0, tmp_path).vocab_size
        assert vocabulary(spec.data) == loaded == size


@pytest.mark.parametrize(
    ("arch", "optimizer", "per_head", "per_expert"),
    [
        ("gpt", "muon", True, True),
        ("gpt", "muonclip", False, True),
        ("gpt", "adamw", True, True),
        ("moe", "muon", True, True),
        ("moe", "muonclip", True, False),
        ("moe", "adamw", False, False),
        ("mlp", "muon", True, True),
    ],
)
def test_the_series_are_what_the_engine_reports(tmp_path, arch, optimizer, per_head, per_expert):
    """The count the API caps is the engine's, and every name it reports is the contract's."""
    model = {"arch": arch, "n_layer": 3, "d_model": 16, "seq_len": 8} | ({} if arch == "mlp" else {"n_head": 2})
    spec = JobSpec.model_validate(
        {
            "model": model | ({"n_experts": 5, "top_k": 2} if arch == "moe" else {}),
            "data": {"builtin": "synthetic"},
            "optimizer": {"name": optimizer},
            "train": {"steps": 2, "batch_size": 2, "eval_every": 1},
            "telemetry": {"sample_tokens": 0, "per_head": per_head, "per_expert": per_expert},
        }
    )
    run_job(RunRequest(spec, tmp_path))
    reported = [set(json.loads(line)["metrics"]) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert max(len(names) for names in reported) == series_per_step(spec)
    layers, heads, experts = range(3), range(2), range(5)
    declared = {*metrics.GLOBAL, *metrics.OPTIMIZER[optimizer]}
    if arch != "mlp":
        declared |= {metrics.ATTN_MAX_LOGIT, *map(metrics.layer_max_logit, layers)}
        declared |= {metrics.head_max_logit(i, j) for i in layers for j in heads} if per_head else set()
    if arch == "moe":
        declared |= set(metrics.ROUTER)
        declared |= {metrics.expert_load(i, j) for i in layers for j in experts} if per_expert else set()
    assert set().union(*reported) == declared


def test_a_spec_names_an_uploaded_model_without_its_config_and_with_its_tokenizer():
    spec = {
        "model": {"arch": "hf", "seq_len": 32, "hf": {"model_id": "mdl_x"}},
        "data": {"builtin": "pysource", "tokenizer": {"type": "model"}},
    }
    parsed = JobSpec.model_validate(spec)
    assert parsed.model.hf is not None and parsed.model.hf.config is None
    assert parsed.data.model_dump()["tokenizer"] == {"type": "model", "vocab_size": None}
    for changed, where, words in (
        ({"data": {"builtin": "pysource"}}, "data.tokenizer", "set data.tokenizer to {type: model}"),
        (
            {"model": {"arch": "gpt"}},
            "data.tokenizer",
            "tokenizer {type: model} is the tokenizer of an uploaded model",
        ),
        ({"model": {"arch": "hf", "hf": {}}}, "model.hf", "give model.hf.config"),
        ({"model": spec["model"] | {"n_layer": 2}}, "model", "comes from the uploaded model's config"),
    ):
        with pytest.raises(ValidationError) as caught:
            JobSpec.model_validate(spec | changed)
        error = caught.value.errors()[0]
        assert error_path(error["loc"]) == where and words in error["msg"], error
