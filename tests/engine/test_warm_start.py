"""Warm start (init_from): a run that starts from another run's checkpoint."""

import pytest
import torch

from contract.spec import JobSpec
from tests.engine.test_trainer import ListSink, trainer
from worker.engine.checkpoints import checkpoint_path, load_checkpoint
from worker.engine.outcome import TrainingError
from worker.engine.request import RunRequest
from worker.engine.run import run_job


def spec(steps: int, init_from: dict | None = None, d_model: int = 16, optimizer: dict | None = None) -> dict:
    return JobSpec.model_validate(
        {
            "model": {"arch": "gpt", "n_layer": 2, "n_head": 2, "d_model": d_model, "seq_len": 16},
            "data": {"builtin": "synthetic"},
            "optimizer": optimizer or {"name": "muon"},
            "train": {"steps": steps, "batch_size": 8, "eval_every": steps, "checkpoint_every": steps},
            "telemetry": {"sample_tokens": 0},
            "init_from": init_from,
        }
    ).model_dump()


@pytest.fixture(scope="module")
def parent(tmp_path_factory):
    """A run of 60 steps: (its directory, its losses by step)."""
    out = tmp_path_factory.mktemp("parent")
    sink = ListSink()
    trainer(spec(60), out, sink).run()
    return out, {step: values["loss"] for step, values in sink.records if "loss" in values}


def parent_file(parent, step: int = 60):
    return checkpoint_path(parent[0] / "ckpt", step)


def test_warm_start_resumes_the_loss_curve_where_the_parent_left_it(parent, tmp_path):
    _, losses = parent
    sink = ListSink()
    child = trainer(spec(5, {"job_id": "parent", "step": 60}), tmp_path, sink)
    result = child.run(init_from=parent_file(parent))
    first = [values["loss"] for step, values in sink.records if "loss" in values]
    fresh = losses[0]  # an untrained model's, on the same batch as the child's first
    late = sum(losses[s] for s in range(55, 60)) / 5  # the parent's last five
    assert result.steps == 5 and sink.records[0][0] == 0  # a new run: its steps count from 0
    print(f"fresh {fresh:.3f}, parent's last five {late:.3f}, child's first {first}")
    assert abs(first[0] - late) < 0.25 * (fresh - late), (first[0], late, fresh)
    assert max(first) < late + 0.25 * (fresh - late)
    assert any(message.startswith("warm start: the weights of step_00000060.pt (step 60)") for _, message in sink.logs)


def test_the_optimizer_state_is_loaded_when_asked_with_this_runs_hyperparameters(parent, tmp_path):
    saved = load_checkpoint(parent_file(parent))["optimizer"]
    init = {"job_id": "parent", "step": 60, "optimizer_state": True}
    child = trainer(spec(1, init, optimizer={"name": "muon", "momentum": 0.9, "lr": 0.01}), tmp_path)
    child._warm_start(parent_file(parent))
    state = child.optimizer.state_dict()
    assert state["state"].keys() == saved["state"].keys()
    for index, values in saved["state"].items():
        for name, value in values.items():
            loaded = state["state"][index][name]
            assert torch.equal(loaded, value) if torch.is_tensor(value) else loaded == value, (index, name)
    assert {g["momentum"] for g in child.optimizer.param_groups} == {0.9}  # not the parent's 0.95
    without = trainer(spec(1, {"job_id": "parent", "step": 60}), tmp_path / "weights-only")
    without._warm_start(parent_file(parent))
    assert without.optimizer.state_dict()["state"] == {}


def test_a_run_with_a_checkpoint_of_its_own_resumes_from_it_not_from_the_parent(parent, tmp_path):
    """A warm-started job whose worker was lost resumes as any job does: exactly."""
    init = {"job_id": "parent", "step": 60}
    whole = trainer(spec(6, init), tmp_path / "whole")
    whole.run(init_from=parent_file(parent))
    cut = trainer(spec(6, init), tmp_path / "cut", cancel=lambda: cut.step == 3)
    assert cut.run(init_from=parent_file(parent)).status == "cancelled"
    sink = ListSink()
    resumed = trainer(spec(6, init), tmp_path / "cut", sink)
    assert resumed.run(init_from=parent_file(parent)).steps == 6
    assert [m for _, m in sink.logs if "warm start" in m] == [] and any("resumed from" in m for _, m in sink.logs)
    for (name, a), b in zip(whole.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name


def test_run_job_hands_the_file_to_the_trainer(parent, tmp_path):
    result = run_job(RunRequest(spec(2, {"job_id": "parent", "step": 60}), tmp_path, init_from=parent_file(parent)))
    assert result.loss < parent[1][0] - 1.0


def test_a_checkpoint_of_another_model_is_refused_with_the_reason(parent, tmp_path):
    child = trainer(spec(2, {"job_id": "parent"}, d_model=32), tmp_path)
    with pytest.raises(TrainingError, match=r"the warm start's checkpoint does not fit this model: .*size mismatch"):
        child.run(init_from=parent_file(parent))
