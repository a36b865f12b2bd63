"""Trainer: exact resume, cancel, non-finite loss, schedules, telemetry names, and a real run."""

import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from contract.metrics import SUMMARY
from contract.spec import DataSpec, JobSpec, TrainSpec
from worker.engine.config import job_config
from worker.engine.data import SYNTHETIC_ALPHABET, load_corpus, synthetic_task
from worker.engine.optimizer import lr_factor
from worker.engine.outcome import TimeLimitReached, TrainingError
from worker.engine.request import RunRequest
from worker.engine.run import run_job
from worker.engine.sample import PROMPT_TOKENS
from worker.engine.telemetry import JsonlSink, Report
from worker.engine.tokenizer import Tokenizer
from worker.engine.trainer import Trainer


def spec(arch="gpt", optimizer="muon", **train) -> dict:
    train = {"steps": 12, "batch_size": 4, "eval_every": 4, "checkpoint_every": 5, **train}
    model = {"arch": arch, "n_layer": 2, "n_head": 2, "d_model": 16, "seq_len": 16}
    return JobSpec.model_validate(
        {"model": model, "data": {"builtin": "synthetic"}, "optimizer": {"name": optimizer}, "train": train}
    ).model_dump()


class ListSink:
    def __init__(self):
        self.reports, self.records, self.checkpoints, self.logs, self.samples = [], [], [], [], []

    def metrics(self, report):
        self.reports.append(report)
        self.records.append((report.step, report.values))

    def checkpoint(self, step, path, nbytes, metrics):
        self.checkpoints.append((step, path.name, nbytes))

    def log(self, level, message):
        self.logs.append((level, message))

    def sample(self, step, prompt, text):
        self.samples.append((step, prompt, text))


def trainer(s: dict, tmp_path: Path, sink=None, cancel=None) -> Trainer:
    job = job_config(s)
    return Trainer(job, synthetic_task(job.train.seed), tmp_path / "ckpt", sink or ListSink(), cancel)


@pytest.mark.parametrize(
    ("arch", "optimizer"),
    [("gpt", "muonclip"), ("moe", "muon"), ("mlp", "adamw"), ("gpt", "normuonclip"), ("moe", "normuon")],
)
def test_resume_from_checkpoint_is_bitwise_identical(tmp_path, arch, optimizer):
    s = spec(arch, optimizer, lr_schedule="cosine", warmup_steps=2)
    full_sink = ListSink()
    full = trainer(s, tmp_path / "a", full_sink)
    full.run()
    cut_sink = ListSink()
    cut = trainer(s, tmp_path / "b", cut_sink, cancel=lambda: cut.step == 7)  # stops before step 7
    assert cut.run().status == "cancelled"
    resumed_sink = ListSink()
    resumed = trainer(s, tmp_path / "b", resumed_sink)
    result = resumed.run()
    assert result.status == "succeeded" and result.steps == 12
    for (name, a), b in zip(full.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name
    tail = [r for r in full_sink.records if r[0] >= 7]
    assert [r[0] for r in resumed_sink.records] == [r[0] for r in tail]
    for (_, a), (_, b) in zip(tail, resumed_sink.records):
        assert a.get("loss") == b.get("loss") and a.get("val_loss") == b.get("val_loss")
    assert resumed_sink.records[0][1]["elapsed_s"] > cut_sink.records[-1][1]["elapsed_s"]  # the clock goes on
    normuon = optimizer.startswith("normuon")
    assert any(g.get("normuon") for g in resumed.optimizer.param_groups) == normuon
    assert any("second_moment" in state for state in resumed.optimizer.state.values()) == normuon
    clipped = any("qk_clip/heads_clipped" in values for _, values in full_sink.records)
    assert clipped == optimizer.endswith("clip")


def test_per_head_orthogonalization_resumes_bitwise_identical(tmp_path):
    s = spec("gpt", "normuonclip", lr_schedule="cosine", warmup_steps=2)
    s["optimizer"]["orthogonalize"] = "per_head"
    s = JobSpec.model_validate(s).model_dump()
    full = trainer(s, tmp_path / "a")
    full.run()
    cut = trainer(s, tmp_path / "b", cancel=lambda: cut.step == 7)
    assert cut.run().status == "cancelled"
    resumed = trainer(s, tmp_path / "b")
    assert resumed.run().status == "succeeded"
    for (name, a), b in zip(full.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name
    split = [g for g in resumed.optimizer.param_groups if g.get("row_blocks")]
    assert [tuple(g["row_blocks"]) for g in split] == [(8,) * 4 + (16,)]  # 2 heads of 8: Q, K; V whole
    whole = trainer(
        JobSpec.model_validate({**s, "optimizer": {**s["optimizer"], "orthogonalize": "matrix"}}).model_dump(),
        tmp_path / "c",
    )
    whole.run()
    assert any(not torch.equal(a, b) for a, b in zip(full.model.parameters(), whole.model.parameters()))


@pytest.mark.parametrize(("arch", "optimizer"), [("mlp", "adamw"), ("gpt", "normuon")])
def test_cautious_weight_decay_reaches_every_group_and_changes_the_run(tmp_path, arch, optimizer):
    finals = {}
    for mode in ("decoupled", "cautious"):
        s = spec(arch, optimizer, steps=4)
        s["optimizer"] |= {"weight_decay": 0.1, "adamw_weight_decay": 0.1, "weight_decay_mode": mode}
        t = trainer(JobSpec.model_validate(s).model_dump(), tmp_path / mode)
        assert t.run().status == "succeeded"
        groups = t.optimizer.param_groups
        assert all(g.get("weight_decay_mode", "decoupled") == mode for g in groups)
        assert isinstance(t.optimizer, torch.optim.AdamW) == (optimizer == "adamw" and mode == "decoupled")
        finals[mode] = [p.detach().clone() for p in t.model.parameters()]
    assert any(not torch.equal(a, b) for a, b in zip(finals["decoupled"], finals["cautious"]))


def test_cancel_stops_at_the_next_step_and_checkpoints(tmp_path):
    sink = ListSink()
    t = trainer(spec(), tmp_path, sink, cancel=lambda: t.step == 3)
    result = t.run()
    assert result.status == "cancelled" and result.steps == 3
    assert sink.checkpoints[-1][0] == 3
    assert max(step for step, _ in sink.records) == 2


def test_max_minutes_stops_the_run_with_its_state_checkpointed_and_a_resume_goes_on(tmp_path, monkeypatch):
    clock = itertools.count(0.0, 7.0)  # every reading of the clock is 7 s later than the one before
    monkeypatch.setattr("worker.engine.trainer.time.perf_counter", lambda: next(clock))
    sink = ListSink()
    t = trainer(spec(steps=40, checkpoint_every=25, max_minutes=1.0), tmp_path, sink)
    with pytest.raises(TimeLimitReached, match=r"train.max_minutes \(1\) after (\d+) of 40 steps; its state") as stop:
        t.run()
    stopped = t.step
    assert 0 < stopped < 25 and stop.value.code == "time_limit"
    assert sink.checkpoints[-1][0] == stopped  # the work is kept, between two checkpoint steps
    assert all(values["elapsed_s"] < 60.0 for _, values in sink.records[:-1])  # no step begun past the limit
    # elapsed_s goes on from the checkpoint: with a larger limit the run ends, from where it stopped.
    again = ListSink()
    t2 = trainer(spec(steps=40, checkpoint_every=25, max_minutes=1000.0), tmp_path, again)
    assert t2.run().steps == 40
    assert again.records[0][0] == stopped and again.records[0][1]["elapsed_s"] > sink.records[-1][1]["elapsed_s"]


def test_nonfinite_loss_stops_with_the_step(tmp_path):
    t = trainer(spec(steps=10), tmp_path)
    original = t.train_step

    def poisoned(report):
        if t.step == 4:
            with torch.no_grad():
                t.model.wte.weight.fill_(float("nan"))
        return original(report)

    t.train_step = poisoned
    with pytest.raises(TrainingError, match=r"non-finite loss .* at step 4"):
        t.run()


@pytest.mark.parametrize("arch", ["gpt", "moe"])
def test_bf16_autocast_run(tmp_path, arch):
    # precision "auto" is bf16 autocast on CUDA; "bf16" runs the same autocast on the CPU.
    result = trainer(spec(arch, "muonclip", steps=4, precision="bf16"), tmp_path).run()
    assert result.status == "succeeded" and math.isfinite(result.loss) and math.isfinite(result.attn_max_logit)


def test_telemetry_names_and_steps(tmp_path):
    sink = ListSink()
    s = spec("moe", "muonclip", steps=8, eval_every=4)
    trainer(s, tmp_path, sink).run()
    steps = [step for step, _ in sink.records]
    assert steps == list(range(9))  # loss at 0..7, val_loss at 0, 4 and 8
    assert [step for step, v in sink.records if "val_loss" in v] == [0, 4, 8]
    first = sink.records[0][1]
    for name in [
        "loss",
        "lr",
        "grad_norm",
        "update_rms",
        "tokens_per_s",
        "step_time_ms",
        "attn_max_logit",
        "attn_max_logit/l0",
        "attn_max_logit/l1h1",
        "qk_clip/heads_clipped",
        "qk_clip/min_gamma",
        "logits/max_abs",
        "logits/std",
        "router/aux_loss",
        "router/load/l1e3",
        "elapsed_s",
    ]:
        assert name in first, name
    assert first["attn_max_logit"] == max(first["attn_max_logit/l0"], first["attn_max_logit/l1"])
    elapsed = [v["elapsed_s"] for _, v in sink.records]
    assert all(v["elapsed_s"] >= 0 for _, v in sink.records) and elapsed == sorted(elapsed)


def test_reports_carry_the_steps_completed_and_the_run_summary(tmp_path):
    sink = ListSink()
    result = trainer(spec(steps=6, eval_every=3), tmp_path, sink).run()
    assert [(r.step, r.completed) for r in sink.reports] == [(s, s + 1) for s in range(6)] + [(6, 6)]
    for report in sink.reports:
        assert set(report.summary) <= set(SUMMARY)
        assert all(report.summary[k] == v for k, v in report.values.items() if k in SUMMARY)
    last = sink.reports[-1]
    assert last.summary == result.summary and last.summary["val_loss"] == last.values["val_loss"]
    assert last.summary["loss"] == sink.reports[-2].values["loss"]  # the last training step's


def test_samples_at_every_evaluation_are_text_and_reproducible(tmp_path):
    runs = []
    for name in ("a", "b"):
        sink = ListSink()
        trainer(spec(steps=8, eval_every=4), tmp_path / name, sink).run()
        runs.append(sink.samples)
    assert [step for step, _, _ in runs[0]] == [0, 4, 8]
    assert runs[0] == runs[1]
    for _, prompt, text in runs[0]:
        assert len(prompt) == PROMPT_TOKENS and len(text) == 120
        assert set(prompt + text) <= set(SYNTHETIC_ALPHABET)
    assert runs[0][0][2] != runs[0][-1][2]  # the model changed in between


def test_no_samples_when_sample_tokens_is_zero(tmp_path):
    sink = ListSink()
    trainer(spec(steps=4) | {"telemetry": {"sample_tokens": 0}}, tmp_path, sink).run()
    assert sink.samples == []


def test_telemetry_every_k_steps(tmp_path):
    sink = ListSink()
    trainer(spec(steps=9, eval_every=100) | {"telemetry": {"every": 3}}, tmp_path, sink).run()
    assert [step for step, _ in sink.records] == [0, 3, 6, 9]


@pytest.mark.parametrize(
    ("schedule", "expected"),
    [
        ("constant", [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]),
        ("wsd", [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.5]),
    ],
)
def test_lr_schedules(schedule, expected):
    cfg = TrainSpec(steps=10, warmup_steps=2, lr_schedule=schedule)
    assert [lr_factor(s, cfg) for s in range(10)] == pytest.approx(expected)


def test_cosine_schedule_decays_to_zero():
    cfg = TrainSpec(steps=101, warmup_steps=1, lr_schedule="cosine")
    values = [lr_factor(s, cfg) for s in range(101)]
    assert values[1] == pytest.approx(1.0) and values[51] == pytest.approx(0.5) and values[-1] < 1e-3
    assert all(a >= b for a, b in itertools.pairwise(values))


@pytest.mark.parametrize("kind", ["byte", "char"])
def test_tokenizers_round_trip(kind):
    text = "To be, or not to be: that is the question.\nÆsop — naïve café 🙂"
    tok = Tokenizer.fit(kind, text)
    assert tok.decode(tok.encode(text)) == text
    assert tok.vocab_size == (256 if kind == "byte" else len(set(text)))


def test_corpus_is_memory_mapped_split_and_cached(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("abcdefghij" * 100)
    data = load_corpus(DataSpec(path=str(corpus), tokenizer="char", val_fraction=0.1), corpus, tmp_path / "cache")
    assert isinstance(data.train.base, np.memmap) or isinstance(data.train, np.memmap)
    assert len(data.train) == 900 and len(data.val) == 100 and data.vocab_size == 10
    again = load_corpus(DataSpec(path=str(corpus), tokenizer="char", val_fraction=0.1), corpus, tmp_path / "cache")
    assert np.array_equal(again.train, data.train)
    (entry,) = (tmp_path / "cache").iterdir()  # one entry: the token array and its description
    assert sorted(p.name for p in entry.iterdir()) == ["meta.json", "tokens.bin"]


def test_batches_are_deterministic_and_seeded():
    data = synthetic_task(0)
    a, b = data.batch("train", 5, 4, 16, seed=1), data.batch("train", 5, 4, 16, seed=1)
    assert torch.equal(a[0], b[0]) and torch.equal(a[0][:, 1:], a[1][:, :-1])
    assert not torch.equal(a[0], data.batch("train", 6, 4, 16, seed=1)[0])
    assert not torch.equal(a[0], data.batch("train", 5, 4, 16, seed=2)[0])


def test_non_utf8_corpus_is_refused(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe\x00abc")
    with pytest.raises(ValueError, match="not UTF-8"):
        load_corpus(DataSpec(path=str(bad)), bad, tmp_path / "cache")


def test_run_job_writes_metrics_checkpoints_and_summary(tmp_path):
    result = run_job(RunRequest(spec(steps=6, checkpoint_every=3), tmp_path))
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(7))
    assert set(lines[0]) == {"step", "metrics"}
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000003.pt", "step_00000006.pt"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "succeeded" and summary["steps"] == 6 == result.steps
    assert set(summary) >= {"status", "steps", "loss", "val_loss", "attn_max_logit", "tokens_per_s", "wall_s"}


def test_jsonl_sink_appends_on_resume(tmp_path):
    sink = JsonlSink(tmp_path)
    sink.metrics(Report(0, {"loss": 1.0}, completed=1, summary={"loss": 1.0}))
    sink.sample(0, "ab", "cd")
    sink.close()
    sink = JsonlSink(tmp_path, append=True)
    sink.metrics(Report(1, {"loss": 0.5}, completed=2, summary={"loss": 0.5}))
    sink.close()
    assert [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [
        {"step": 0, "metrics": {"loss": 1.0}},
        {"step": 1, "metrics": {"loss": 0.5}},
    ]
    assert json.loads((tmp_path / "samples.jsonl").read_text()) == {"step": 0, "prompt": "ab", "text": "cd"}


@pytest.mark.slow
def test_real_run_on_the_builtin_text_learns_it(tmp_path):
    s = JobSpec.model_validate(
        {
            "model": {"arch": "gpt", "n_layer": 2, "n_head": 4, "d_model": 64, "seq_len": 64},
            "data": {"builtin": "pysource", "tokenizer": "byte"},
            "optimizer": {"name": "muon"},
            "train": {"steps": 300, "batch_size": 32, "eval_every": 100, "checkpoint_every": 300, "seed": 0},
            "telemetry": {"every": 10},
        }
    ).model_dump()
    result = run_job(RunRequest(s, tmp_path))
    print(f"pysource byte-level gpt, Muon, 300 steps: val_loss {result.val_loss:.3f}")
    # 1.942 on Python 3.11.7's text; its byte frequencies alone (no context) give 3.118
    assert result.status == "succeeded" and result.val_loss < 2.15


def test_a_resume_after_the_last_step_keeps_the_summary(tmp_path):
    s = spec(steps=8, checkpoint_every=4)
    first = run_job(RunRequest(s, tmp_path))
    again = run_job(RunRequest(s, tmp_path))  # resumes at step 8 and trains nothing
    assert again.steps == 8 and again.status == "succeeded"
    assert again.loss == first.loss and again.attn_max_logit == first.attn_max_logit
    assert again.val_loss == first.val_loss


class _Planted:
    """What a planted checkpoint would run when unpickled: here, create a marker file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_checkpoints_load_tensors_and_plain_values_only(tmp_path):
    import pickle

    from worker.engine.checkpoints import load_checkpoint

    marker = tmp_path / "ran"
    planted = tmp_path / "step_00000010.pt"
    torch.save({"model": {}, "x": _Planted(str(marker))}, planted, pickle_protocol=pickle.HIGHEST_PROTOCOL)
    with pytest.raises(pickle.UnpicklingError):
        load_checkpoint(planted)
    assert not marker.exists()


def test_checkpoint_temp_files_are_unique_and_stale_ones_are_removed(tmp_path):
    from worker.engine.checkpoints import checkpoints_in, remove_stale_temp_files, save_checkpoint

    (tmp_path / "step_00000010.pt.123-dead.tmp").write_bytes(b"torn")  # an attempt that died mid-write
    save_checkpoint(tmp_path, 10, {"model": {}})
    save_checkpoint(tmp_path, 10, {"model": {"w": torch.ones(2)}})  # the same step again: no collision
    assert [step for step, _ in checkpoints_in(tmp_path)] == [10]
    assert remove_stale_temp_files(tmp_path) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000010.pt"]


def test_the_retention_rule_keeps_the_latest_and_the_best():
    from worker.engine.checkpoints import to_prune

    kept = [(10, 3.0), (20, 2.0), (30, None), (40, 2.5), (50, float("nan")), (60, 2.6)]
    assert to_prune(kept, 3) == [10, 30]  # latest three: 40, 50, 60; best val_loss: 20
    assert to_prune(kept, 1) == [10, 30, 40, 50]
    assert to_prune([(10, None), (20, None)], 1) == [10]
    assert to_prune([(10, 1.0)], 3) == []


def test_a_re_measured_muonclip_runs_one_more_forward_per_step_and_clips_from_it(tmp_path):
    def run(remeasure: bool):
        s = spec("gpt", "muonclip", steps=6, eval_every=6)
        s["optimizer"].update(qk_clip_tau=1e-6, qk_clip_remeasure=remeasure)  # a tau every head passes
        t = trainer(s, tmp_path / str(remeasure))
        forwards = []
        original = t.model.forward
        t.model.forward = lambda *a, **k: forwards.append(torch.is_grad_enabled()) or original(*a, **k)
        sink = ListSink()
        t.sink = sink
        result = t.run()
        return t, result, forwards, sink

    plain, plain_result, plain_forwards, _ = run(False)
    again, result, forwards, sink = run(True)
    assert result.status == plain_result.status == "succeeded"
    # The same training forwards and evaluations, plus one forward with no grad after each update.
    assert len(forwards) - len(plain_forwards) == 6 and forwards.count(True) == plain_forwards.count(True) == 6
    clipped = [r["qk_clip/heads_clipped"] for _, r in sink.records if "qk_clip/heads_clipped" in r]
    assert clipped and all(n > 0 for n in clipped)
    differs = any(not torch.equal(a, b) for a, b in zip(plain.model.parameters(), again.model.parameters()))
    assert differs  # clipped from other maxima


def test_a_muonclip_re_measured_on_n_batches_clips_from_the_max_over_them(tmp_path):
    """With qk_clip_remeasure_batches = 3 the clip reads the running max over the step's batch and
    the 2 before it (measured after the update), and every first-layer head ends at or below tau
    on all three."""
    tau = 0.05  # under the heads' maxima, so that every step clips
    s = spec("gpt", "muonclip", steps=6, eval_every=6)
    s["optimizer"].update(qk_clip_tau=tau, qk_clip_remeasure=True, qk_clip_remeasure_batches=3)
    t = trainer(s, tmp_path)
    layers = t.model.attention_layers()
    measure, earlier_binding, forwards = t._measure_max_logits, [], []

    def first_layer_maxima(indices) -> torch.Tensor:  # [batches, heads]: layer 0 on each, weights as they are
        out = []
        for i in indices:
            layers[0].reset_qk_max_logits()
            with torch.no_grad():
                t.model(t._batch("train", i)[0])
            out.append(layers[0].qk_max_logits().clone())
        return torch.stack(out)

    def spy(x):
        indices = range(max(0, t.step - 2), t.step + 1)
        each = first_layer_maxima(indices)
        for layer in layers:
            layer.reset_qk_max_logits()
        original = t.model.forward
        t.model.forward = lambda *a, **k: forwards.append(t.step) or original(*a, **k)
        try:
            measure(x)
        finally:
            t.model.forward = original
        assert torch.equal(layers[0].qk_max_logits(), each.amax(0))  # what the clip then reads
        earlier_binding.append(len(each) > 1 and bool((each[:-1].amax(0) > each[-1]).any()))

    t._measure_max_logits = spy
    assert t.run().status == "succeeded"
    assert [forwards.count(step) for step in range(6)] == [1, 2, 3, 3, 3, 3]
    assert any(earlier_binding)  # a batch before the step's own raised some head's maximum
    assert first_layer_maxima(range(3, 6)).max() <= tau * (1 + 1e-5)


def test_qk_clip_remeasure_batches_needs_the_re_measure():
    s = spec("gpt", "muonclip")
    s["optimizer"].update(qk_clip_remeasure_batches=2)
    with pytest.raises(ValueError, match="qk_clip_remeasure_batches applies only with qk_clip_remeasure"):
        JobSpec.model_validate(s)
