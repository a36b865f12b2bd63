"""`muonforge train`: validates a spec with JobSpec, runs it, writes metrics, checkpoints, summary."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from muonforge.cli import SpecError, load_spec

pytestmark = pytest.mark.system  # its tests start processes: the service's, torchrun's or a command's

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def muonforge(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "muonforge.cli", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_every_example_validates(example, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("hello world\n" * 100)
    spec = load_spec(example, corpus if example.stem == "pysource-adamw" else None)
    assert spec["model"]["arch"] in ("gpt", "moe", "mlp", "hf")


def test_train_runs_a_spec_and_writes_its_outputs(tmp_path):
    spec = yaml.safe_load((ROOT / "examples" / "synthetic-muon.yaml").read_text())
    spec["train"].update(steps=6, eval_every=3, checkpoint_every=3)
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    proc = muonforge("train", str(path), "--out", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["status"] == "succeeded" and summary["steps"] == 6
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == summary
    lines = (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(7))
    assert len(list((tmp_path / "out" / "checkpoints").glob("step_*.pt"))) == 2


def test_train_runs_a_two_process_spec_through_torchrun(tmp_path):
    spec = yaml.safe_load((ROOT / "examples" / "synthetic-muon-2proc.yaml").read_text())
    spec["model"].update(d_model=16, n_head=2, seq_len=16)
    spec["train"].update(steps=4, batch_size=4, eval_every=2, checkpoint_every=2)
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    proc = muonforge("train", str(path), "--out", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["steps"] == 4
    lines = (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(5))  # rank 0 alone writes them
    assert (tmp_path / "out" / "ranks.log").exists()


def test_data_flag_names_the_corpus(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    spec = yaml.safe_load((ROOT / "examples" / "pysource-adamw.yaml").read_text())
    spec["model"].update(d_model=16, n_head=2, seq_len=16)
    spec["train"].update(steps=3, batch_size=4, eval_every=3, checkpoint_every=3, warmup_steps=1)
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    proc = muonforge("train", str(path), "--out", str(tmp_path / "out"), "--data", str(corpus))
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["steps"] == 3


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ({"model": {"arch": "gpt", "n_head": 3}, "data": {"builtin": "synthetic"}}, "model.d_model"),
        ({"model": {"arch": "gpt"}, "data": {"builtin": "synthetic"}, "optimizer": {"name": "sgd"}}, "optimizer.name"),
        ({"model": {"arch": "gpt", "depth": 2}, "data": {"builtin": "synthetic"}}, "model.depth"),
        ({"model": {"arch": "gpt"}}, "data"),
        ([1, 2, 3], "mapping"),
        ({"model": {"arch": "gpt"}, "data": {"builtin": "synthetic"}, "init_from": {"job_id": "job_x"}}, "server"),
    ],
)
def test_bad_spec_exits_2_naming_the_field(tmp_path, spec, needle):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(spec))
    proc = muonforge("train", str(path), "--out", str(tmp_path / "out"))
    assert proc.returncode == 2 and needle in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()


def test_missing_spec_file_and_missing_corpus(tmp_path):
    with pytest.raises(SpecError, match="cannot read"):
        load_spec(tmp_path / "nope.yaml")
    spec = yaml.safe_load((ROOT / "examples" / "pysource-muon.yaml").read_text())
    del spec["data"]["builtin"]
    (tmp_path / "no-data.yaml").write_text(yaml.safe_dump(spec))
    proc = muonforge("train", str(tmp_path / "no-data.yaml"), "--out", str(tmp_path / "o"))
    assert proc.returncode == 2 and "dataset_id, builtin, path" in proc.stderr
    proc = muonforge(
        "train", str(ROOT / "examples" / "pysource-muon.yaml"), "--out", str(tmp_path / "o"), "--data", "/no/such"
    )
    assert proc.returncode == 1 and "does not exist" in proc.stderr
