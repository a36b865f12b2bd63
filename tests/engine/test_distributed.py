"""A job of two processes: torchrun, DDP under gloo, rank 0's telemetry through the launcher."""

from __future__ import annotations

import json

import pytest
import torch

from contract.spec import JobSpec
from tests.engine.test_trainer import ListSink, trainer
from worker.engine.checkpoints import checkpoint_path
from worker.engine.data import synthetic_task
from worker.engine.request import RunRequest
from worker.engine.run import run_job

pytestmark = pytest.mark.system  # its tests start processes: the service's, torchrun's or a command's


def spec(nproc: int, init_from: dict | None = None, **train) -> dict:
    return JobSpec.model_validate(
        {
            "model": {"arch": "gpt", "n_layer": 2, "n_head": 2, "d_model": 16, "seq_len": 16},
            "data": {"builtin": "synthetic"},
            # fp32 Newton–Schulz: where `auto` picks bf16 (CPUs with AVX512-BF16, CUDA), its rounding
            # turns DDP's differently ordered gradient sums into differences of ~1e-3 after a few steps.
            "optimizer": {"name": "muonclip", "ns_dtype": "fp32"},
            "train": {"steps": 8, "batch_size": 4, "eval_every": 4, "checkpoint_every": 4, **train},
            "resources": {"nproc": nproc},
            "init_from": init_from,
        }
    ).model_dump()


class Verdict:
    """A stand-in for a rank's Group in Trainer._judge: Group.decide answers rank 0's choice."""

    def __init__(self, rank0: int) -> None:
        self.rank0, self.asked = rank0, []

    def decide(self, choice: int) -> int:
        self.asked.append(choice)
        return self.rank0


def test_the_ranks_shares_make_the_global_batch():
    data = synthetic_task(0)
    x, y = data.batch("train", 3, 6, 16, 0)
    shares = [data.batch("train", 3, 6, 16, 0, rank, 3) for rank in range(3)]
    assert torch.equal(torch.cat([s[0] for s in shares]), x) and torch.equal(torch.cat([s[1] for s in shares]), y)
    with pytest.raises(ValueError, match="does not split evenly over 4 ranks"):
        data.batch("train", 3, 6, 16, 0, 0, 4)


def test_two_ranks_follow_the_loss_curve_of_one_process(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    one, two = ListSink(), ListSink()
    run_job(RunRequest(spec(1), tmp_path / "one", sink=one))
    result = run_job(RunRequest(spec(2), tmp_path / "two", sink=two))
    assert result.status == "succeeded" and result.steps == 8
    # Rank 0 alone reports: each step once, with the global batch's loss and val_loss.
    assert [step for step, _ in two.records] == [step for step, _ in one.records] == list(range(9))
    for (step, a), (_, b) in zip(one.records, two.records):
        for name in ("loss", "val_loss", "attn_max_logit", "grad_norm"):
            if name in a:
                assert b[name] == pytest.approx(a[name], rel=1e-4, abs=1e-6), (step, name)
    assert [c[0] for c in two.checkpoints] == [4, 8] and len(two.samples) == 3
    lines = (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(9))
    weights = [torch.load(tmp_path / d / "checkpoints" / "step_00000008.pt")["model"] for d in ("one", "two")]
    for name, value in weights[0].items():
        assert torch.allclose(value, weights[1][name], rtol=1e-3, atol=1e-5), name


def test_a_cancel_stops_every_rank_at_one_step_with_a_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    sink = ListSink()
    result = run_job(
        RunRequest(
            spec(2, steps=100_000, checkpoint_every=100_000),
            tmp_path,
            sink=sink,
            should_cancel=lambda: len(sink.records) >= 5,
        )
    )
    assert result.status == "cancelled" and 5 <= result.steps < 100_000
    assert sink.checkpoints[-1][0] == result.steps
    assert sink.logs[-1] == ("info", f"cancelled before step {result.steps}")


def test_early_stopping_is_rank_0s_verdict_on_every_rank(tmp_path):
    """A rank's own judgement of an evaluation does not stop it: rank 0's, through Group.decide, does."""
    s = spec(1, steps=40, early_stop={"patience": 3, "min_delta": 10.0})
    follower = trainer(s, tmp_path / "a")
    follower.group, follower.lead = Verdict(rank0=1), False
    follower._judge(4, {"val_loss": 5.0})  # its own rule: the first evaluation, the best so far
    assert follower.group.asked == [0] and follower.stopped_at == 4
    holder = trainer(s, tmp_path / "b")
    holder.group, holder.lead = Verdict(rank0=0), False
    for step in (0, 4, 8, 12):  # its own rule runs out of patience at step 12
        holder._judge(step, {"val_loss": 5.0})
    assert holder.group.asked == [0, 0, 0, 1] and holder.stopped_at is None


def test_a_warm_started_group_stops_early_at_the_step_one_process_does(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    run_job(RunRequest(spec(1), tmp_path / "parent"))
    parent = checkpoint_path(tmp_path / "parent" / "checkpoints", 8)
    init = {"job_id": "parent", "step": 8, "optimizer_state": True}
    early = {"steps": 40, "checkpoint_every": 5, "early_stop": {"patience": 3, "min_delta": 10.0}}
    one, two = ListSink(), ListSink()
    alone = run_job(RunRequest(spec(1, init, **early), tmp_path / "one", sink=one, init_from=parent))
    group = run_job(RunRequest(spec(2, init, **early), tmp_path / "two", sink=two, init_from=parent))
    # No evaluation betters the first by 10 nats: both stop after 3 more, at step 12, every rank
    # with them (a rank that went on would wait in a collective for ever, and the group fail).
    assert alone.status == group.status == "succeeded" and alone.steps == group.steps == 12
    assert group.summary["stopped_at"] == 12 and group.summary["stop_reason"] == alone.summary["stop_reason"]
    assert [c[0] for c in two.checkpoints] == [c[0] for c in one.checkpoints] == [5, 10, 12]
    assert [step for step, _ in two.records] == [step for step, _ in one.records] == list(range(13))
    for (step, a), (_, b) in zip(one.records, two.records):
        for name in ("loss", "val_loss"):
            if name in a:  # the parent's weights and optimizer state, on every rank
                assert b[name] == pytest.approx(a[name], rel=1e-4, abs=1e-6), (step, name)
    assert any(
        message.startswith("warm start: the weights and optimizer state of step_00000008.pt") for _, message in two.logs
    )
    assert ("info", "stopped early at step 12: " + alone.summary["stop_reason"]) in two.logs
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert summary["stopped_at"] == 12 and summary["steps"] == 12
