"""Early stopping: the rule on its own, and a run that stops early, also across a resume; a run
stopped at a rung by a decider outside it (a sweep's ASHA)."""

import math

import pytest
import torch
from pydantic import ValidationError

from contract.spec import EarlyStopSpec, JobSpec
from tests.engine.test_trainer import ListSink, spec, trainer
from worker.engine.early_stop import EarlyStop, RungCheck
from worker.engine.trainer import Trainer


def rule(mode="min", patience=3, min_delta=0.0) -> EarlyStop:
    return EarlyStop.of(EarlyStopSpec(mode=mode, patience=patience, min_delta=min_delta))


def judged(stop: EarlyStop, values: list[float], every: int = 100) -> list[bool]:
    return [stop.judge(i * every, v) for i, v in enumerate(values)]


def test_patience_counts_evaluations_without_an_improvement_beyond_min_delta():
    stop = rule(patience=3, min_delta=0.001)
    # 1.234 at step 200 is the best; 1.2335 betters it by less than min_delta, so it does not count.
    assert judged(stop, [2.0, 1.5, 1.234, 1.2335, 1.3, 1.234]) == [False] * 5 + [True]
    assert (stop.best, stop.best_step, stop.stale) == (1.234, 200, 3)
    assert stop.reason() == "val_loss did not improve by more than 0.001 for 3 evaluations (best 1.234 at step 200)"


def test_an_improvement_resets_the_count_and_max_mode_wants_higher_values():
    stop = rule(patience=2)
    assert judged(stop, [3.0, 3.0, 2.9, 2.95, 2.9]) == [False] * 4 + [True]  # equal is no improvement
    assert stop.reason() == "val_loss did not improve for 2 evaluations (best 2.9 at step 200)"
    high = rule(mode="max", patience=2)
    assert judged(high, [0.1, 0.5, 0.4, 0.6, 0.6, 0.2]) == [False] * 5 + [True]
    assert (high.best, high.best_step) == (0.6, 300)


def test_non_finite_values_are_never_the_best():
    stop = rule(patience=2)
    assert judged(stop, [math.nan, math.inf]) == [False, True]
    assert stop.reason() == "val_loss did not improve for 2 evaluations (no finite value)"


def test_an_evaluation_counts_once_and_the_state_round_trips():
    stop = rule(patience=2)
    judged(stop, [1.0, 1.1])
    assert not stop.judge(100, 1.1) and stop.stale == 1  # the resumed run's evaluation of its checkpoint's step
    again = rule(patience=2)
    again.load_state_dict(stop.state_dict())
    assert again == stop and again.judge(200, 1.2)


@pytest.mark.parametrize(
    ("early_stop", "accepted"),
    [({"patience": 2}, True), ({"patience": 3}, False), ({"patience": 1}, True)],
)
def test_the_spec_refuses_an_early_stop_with_too_few_evaluations_to_judge(early_stop, accepted):
    raw = {"model": {"arch": "gpt"}, "data": {"builtin": "synthetic"}, "train": {"steps": 30, "eval_every": 10}}
    raw["train"]["early_stop"] = early_stop
    if accepted:
        assert JobSpec.model_validate(raw).train.early_stop.patience == early_stop["patience"]
        return
    with pytest.raises(ValidationError) as caught:
        JobSpec.model_validate(raw)
    error = caught.value.errors()[0]
    assert error["loc"] == ("train", "early_stop") and "lower eval_every or patience" in error["msg"]


def plateau(**train) -> dict:
    """No evaluation betters the first by more than 10 nats: the run stops after `patience` more."""
    return spec(steps=40, eval_every=4, checkpoint_every=5, early_stop={"patience": 3, "min_delta": 10.0}, **train)


def test_a_run_stops_early_succeeded_with_a_checkpoint_and_the_reason(tmp_path):
    sink = ListSink()
    result = trainer(plateau(), tmp_path, sink).run()
    assert result.status == "succeeded" and result.steps == 12
    assert result.summary["stopped_at"] == 12
    assert result.summary["stop_reason"].startswith("val_loss did not improve by more than 10 for 3 evaluations (best ")
    assert result.summary["stop_reason"].endswith(" at step 0)")
    assert [step for step, _, _ in sink.checkpoints] == [5, 10, 12]
    assert max(step for step, _ in sink.records) == 12 and "val_loss" in sink.records[-1][1]
    assert sink.reports[-1].summary["stopped_at"] == 12 and sink.reports[-1].completed == 12
    assert ("info", f"stopped early at step 12: {result.summary['stop_reason']}") in sink.logs
    assert {"stopped_at": 12, "stop_reason": result.summary["stop_reason"]}.items() <= result.as_dict().items()


@pytest.mark.parametrize("cut", [6, 8])  # between evaluations; at one (its checkpoint's step is evaluated again)
def test_a_resumed_run_goes_on_counting_and_stops_where_an_uninterrupted_one_does(tmp_path, cut):
    whole = trainer(plateau(), tmp_path / "whole")
    expected = whole.run()
    parted = trainer(plateau(), tmp_path / "parted", cancel=lambda: parted.step == cut)
    assert parted.run().status == "cancelled"
    resumed = trainer(plateau(), tmp_path / "parted")
    result = resumed.run()
    # Restarting the count at the resume would stop it at step 8 + 12 = 20 or later.
    assert result.steps == 12 and result.summary["stop_reason"] == expected.summary["stop_reason"]
    for (name, a), b in zip(whole.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name


def test_a_run_resumed_from_its_stop_checkpoint_stops_there_again(tmp_path):
    first = trainer(plateau(), tmp_path).run()
    again = trainer(plateau(), tmp_path).run()  # a worker lost after the stop's checkpoint
    assert again.steps == 12 and again.summary["stopped_at"] == 12
    assert again.summary["stop_reason"] == first.summary["stop_reason"]


class Decider:
    """A rung decider that ends the run at ``stop_at`` (stopped_early, or paused to wait with
    ``pause``) and records every question (a stored decision answers the same each time, as the
    service's does)."""

    def __init__(self, stop_at: int | None, pause: bool = False):
        self.stop_at, self.pause, self.asked = stop_at, pause, []

    def __call__(self, step: int, value: float) -> tuple[str, str] | None:
        self.asked.append((step, value))
        if step != self.stop_at:
            return None
        return ("paused", f"waits at rung {step}") if self.pause else ("stopped_early", f"behind at rung {step}")


def with_rungs(tmp_path, decider: Decider, rungs=(3, 6), sink=None, cancel=None) -> Trainer:
    t = trainer(spec(steps=12, eval_every=4, checkpoint_every=5), tmp_path, sink, cancel)
    t.rungs = RungCheck(steps=rungs, metric="val_loss", decide=decider)
    return t


def test_a_rung_is_evaluated_and_asked_and_a_stop_there_is_stopped_early_with_a_checkpoint(tmp_path):
    sink, decider = ListSink(), Decider(stop_at=6)
    result = with_rungs(tmp_path, decider, sink=sink).run()
    assert result.status == "stopped_early" and result.steps == 6
    assert [step for step, _ in decider.asked] == [3, 6]  # rungs evaluated off the eval_every grid
    assert decider.asked[1][1] == sink.records[-1][1]["val_loss"]
    assert result.summary["stopped_at"] == 6 and result.summary["stop_reason"] == "behind at rung 6"
    assert [step for step, _, _ in sink.checkpoints] == [5, 6]
    assert ("info", "stopped early at step 6: behind at rung 6") in sink.logs


def test_a_run_that_passes_its_rungs_succeeds_and_a_resumed_one_asks_its_checkpoints_rung_again(tmp_path):
    assert with_rungs(tmp_path / "through", Decider(stop_at=None)).run().status == "succeeded"
    first = with_rungs(tmp_path / "stopped", Decider(stop_at=6)).run()
    again_decider = Decider(stop_at=6)
    again = with_rungs(tmp_path / "stopped", again_decider).run()  # a worker lost after the stop's checkpoint
    assert again_decider.asked == [(6, again_decider.asked[0][1])] and again.status == "stopped_early"
    assert again.steps == 6 and again.summary["stop_reason"] == first.summary["stop_reason"] == "behind at rung 6"


def test_a_run_paused_at_a_rung_and_then_promoted_ends_as_an_uninterrupted_one(tmp_path):
    paused_sink = ListSink()
    paused = with_rungs(tmp_path / "paused", Decider(stop_at=6, pause=True), sink=paused_sink).run()
    assert paused.status == "paused" and paused.steps == 6 and paused.summary["stop_reason"] == "waits at rung 6"
    assert [step for step, _, _ in paused_sink.checkpoints] == [5, 6]  # its state at the rung, to resume from
    assert ("info", "paused at step 6: waits at rung 6") in paused_sink.logs
    promoted = Decider(stop_at=None)  # the service's answer once it promoted the trial
    resumed_trainer = with_rungs(tmp_path / "paused", promoted)
    resumed = resumed_trainer.run()
    assert resumed.status == "succeeded" and resumed.steps == 12 and "stop_reason" not in resumed.summary
    assert [step for step, _ in promoted.asked] == [6]  # the rung asked again, at the checkpoint's step
    whole_trainer = with_rungs(tmp_path / "whole", Decider(stop_at=None))
    whole = whole_trainer.run()
    assert resumed.summary["val_loss"] == whole.summary["val_loss"]
    for (name, a), b in zip(whole_trainer.model.state_dict().items(), resumed_trainer.model.state_dict().values()):
        assert torch.equal(a, b), name
