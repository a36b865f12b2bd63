"""The client commands as real processes (``python -m muonforge.cli``) against a real API process
and a real worker: output, files and exit statuses, errors included."""

from __future__ import annotations

import csv
import io
import json
import os
import pty
import shlex
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from app.db.session import transaction
from app.messaging.live_bus import NoBus
from app.services.job_journal import record_log
from app.services.metric_history import store_metrics
from contract.export import CONFIG_FILE, EXPORT_FILE, GENERATION_FILE
from muonforge import Client
from tests.engine.test_export import logits
from tests.service.test_client import stored_checkpoint
from tests.service.test_export import checkpoint_logits, exported_logits
from tests.support.api import new_key
from tests.support.cli import client_env, command, muonforge
from tests.support.net import closed_port_url, wait_for
from tests.support.services import ROOT, Worker
from tests.support.specs import tiny_spec
from tests.support.telemetry import stored_job, synthetic_run
from worker.engine.export import model_from_config

pytestmark = pytest.mark.system  # its tests start processes: the service's, torchrun's or a command's


def one_error_line(result: subprocess.CompletedProcess) -> str:
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert "Traceback" not in result.stderr
    return result.stderr.strip()


@pytest.fixture(scope="module")
def tenant(settings, api_url, tmp_path_factory):
    """A tenant's key, with a real worker running for this module's tests."""
    worker = Worker(settings, tmp_path_factory.mktemp("worker") / "worker.log")
    yield new_key(settings)
    worker.stop()


@pytest.fixture(scope="module")
def finished(tenant, api_url, tmp_path_factory) -> dict:
    """A job submitted with ``muonforge submit --follow`` and finished: the final Job."""
    spec = tmp_path_factory.mktemp("spec") / "tiny.yaml"
    spec.write_text(json.dumps(tiny_spec(steps=20)))
    result = muonforge("submit", spec, "--follow", url=api_url, key=tenant)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    summary = json.loads(lines[-1])
    assert summary["id"] == lines[0] and summary["status"] == "succeeded"
    assert summary["progress"] == {"step": 20, "total_steps": 20}
    with Client(api_url, tenant) as client:
        return client.get_job(lines[0])


def test_jobs_lists_a_table_and_json(finished, tenant, api_url):
    table = muonforge("jobs", url=api_url, key=tenant)
    assert table.returncode == 0, table.stderr
    assert [line for line in table.stdout.splitlines() if line != line.rstrip()] == [], "no padding when piped"
    header, row = table.stdout.splitlines()[:2]
    assert header.split() == ["id", "name", "status", "step", "loss", "val_loss", "age"]
    assert row.split()[:4] == [finished["id"], "tiny", "succeeded", "20/20"]
    assert row.split()[4] == f"{finished['summary']['loss']:.4f}"
    listed = json.loads(muonforge("jobs", "--json", "--limit", "1", url=api_url, key=tenant).stdout)
    assert listed == [finished]
    assert json.loads(muonforge("jobs", "--status", "queued", "--json", url=api_url, key=tenant).stdout) == []


def test_show_details_and_json(finished, tenant, api_url):
    shown = muonforge("show", finished["id"], url=api_url, key=tenant)
    assert shown.returncode == 0, shown.stderr
    assert [line for line in shown.stdout.splitlines() if line != line.rstrip()] == [], "no padding when piped"
    fields = {k: v.strip() for k, v in (line.split(None, 1) for line in shown.stdout.splitlines())}
    assert fields["status"] == "succeeded" and fields["progress"] == "20/20 steps, attempt 1"
    assert set(fields["model"].split()) == {"arch=gpt", "n_layer=1", "n_head=2", "d_model=16", "seq_len=16"}
    assert json.loads(muonforge("show", finished["id"], "--json", url=api_url, key=tenant).stdout) == finished


def test_logs_of_a_finished_job(finished, tenant, api_url):
    expected = [
        "status      queued (attempt 0)",
        "status      running (attempt 1)",
        "info        parameters: Muon takes 4 (",  # the routing, first of the run's log
        "sample      step 0: ",
        "sample      step 10: ",
        "checkpoint  step 10",
        "sample      step 20: ",
        "checkpoint  step 20",
        "status      succeeded (attempt 1)",
    ]
    for follow in ([], ["--follow"]):
        logs = muonforge("logs", finished["id"], *follow, url=api_url, key=tenant)
        assert logs.returncode == 0, logs.stderr
        lines = logs.stdout.splitlines()
        assert len(lines) == len(expected) and all(line.startswith(e) for line, e in zip(lines, expected)), lines


def test_metrics_as_csv_read_back_and_as_a_table(finished, tenant, api_url):
    args = ("metrics", finished["id"], "--name", "loss", "--name", "val_loss", "--csv")
    result = muonforge(*args, url=api_url, key=tenant)
    assert result.returncode == 0, result.stderr
    rows = list(csv.DictReader(io.StringIO(result.stdout)))
    with Client(api_url, tenant) as client:
        history = client.metrics(finished["id"], names=["loss", "val_loss"])
    assert [[int(r["step"]), float(r["loss"])] for r in rows if r["loss"]] == history["loss"]
    assert [[int(r["step"]), float(r["val_loss"])] for r in rows if r["val_loss"]] == history["val_loss"]
    assert [int(r["step"]) for r in rows] == list(range(21))

    table = muonforge("metrics", finished["id"], "--name", "loss,nope", "--max-points", "6", url=api_url, key=tenant)
    assert table.returncode == 0 and table.stderr == f"note: {finished['id']} has no points of 'nope'\n"
    header, *lines = table.stdout.splitlines()
    assert header.split() == ["step", "loss", "nope"] and 0 < len(lines) <= 6


def test_metrics_without_a_name_has_the_main_curves(finished, tenant, api_url, settings):
    result = muonforge("metrics", finished["id"], "--csv", url=api_url, key=tenant)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    header, *rows = list(csv.reader(io.StringIO(result.stdout)))
    assert header == ["step", "loss", "val_loss", "attn_max_logit"]
    with Client(api_url, tenant) as client:
        history = client.metrics(finished["id"], names=header[1:])
    for column, name in enumerate(header[1:], 1):
        assert [[int(row[0]), float(row[column])] for row in rows if row[column]] == history[name]

    table = muonforge("metrics", finished["id"], url=api_url, key=tenant)
    assert table.returncode == 0, table.stderr
    assert table.stdout.splitlines()[0].split() == header

    key = new_key(settings)  # a job without the attention logit (an mlp has none): no such column
    job_id = stored_job(settings, key, tiny_spec())  # no task sent: no worker takes it
    with Client(api_url, key) as client:
        assert client.cancel_job(job_id)["status"] == "cancelled"
    with transaction(settings) as session:
        store_metrics(session, job_id, [(0, {"loss": 4.0, "val_loss": 4.1}), (1, {"loss": 3.0})], None)
    result = muonforge("metrics", job_id, "--csv", url=api_url, key=key)
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout.splitlines() == ["step,loss,val_loss", "0,4.0,4.1", "1,3.0,"]


def test_download_writes_the_servers_checkpoint(finished, tenant, api_url, settings, tmp_path):
    job_id = finished["id"]
    explicit = muonforge("download", job_id, "--step", "10", "--out", tmp_path / "ten.pt", url=api_url, key=tenant)
    assert explicit.returncode == 0, explicit.stderr
    assert explicit.stdout.strip() == str(tmp_path / "ten.pt")
    assert (tmp_path / "ten.pt").read_bytes() == stored_checkpoint(settings, job_id, 10)
    latest = muonforge("download", job_id, url=api_url, key=tenant, cwd=tmp_path)
    assert latest.returncode == 0, latest.stderr
    assert (tmp_path / f"{job_id}-step00000020.pt").read_bytes() == stored_checkpoint(settings, job_id, 20)
    missing = muonforge("download", job_id, "--step", "15", "--out", tmp_path, url=api_url, key=tenant)
    assert missing.returncode == 2
    assert one_error_line(missing) == f"error: job {job_id} has no checkpoint at step 15 (404 not_found)"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["ten.pt", f"{job_id}-step00000020.pt"])


def test_export_writes_weights_that_reload_to_the_checkpoints_logits(finished, tenant, api_url, settings, tmp_path):
    job_id = finished["id"]
    latest = muonforge("export", job_id, "--out", tmp_path / "latest", url=api_url, key=tenant)
    assert latest.returncode == 0, latest.stderr
    directory = tmp_path / "latest"
    assert latest.stdout.splitlines() == [str(directory / "model.safetensors"), str(directory / "config.json")]
    config = json.loads((directory / "config.json").read_text())
    assert config["arch"] == "gpt" and config["vocab_size"] == 64 and config["tokenizer"] is None
    # As the docs load it: the model built from config.json, the weights from model.safetensors.
    model = model_from_config(config)
    model.load_state_dict(load_file(directory / "model.safetensors"))
    expected = checkpoint_logits(stored_checkpoint(settings, job_id, 20))  # the latest
    assert torch.allclose(logits(model.eval(), 64, 16), expected, rtol=0, atol=1e-6)
    ten = muonforge("export", job_id, "--step", "10", "--out", tmp_path / "ten", url=api_url, key=tenant)
    assert ten.returncode == 0, ten.stderr
    expected = checkpoint_logits(stored_checkpoint(settings, job_id, 10))
    assert torch.allclose(exported_logits(tmp_path / "ten" / "model.safetensors"), expected, rtol=0, atol=1e-6)
    missing = muonforge("export", job_id, "--step", "15", "--out", tmp_path / "none", url=api_url, key=tenant)
    assert missing.returncode == 2
    assert one_error_line(missing) == f"error: job {job_id} has no checkpoint at step 15 (404 not_found)"
    assert not list((tmp_path / "none").glob("*.safetensors"))


def test_export_format_hf_writes_a_directory_transformers_loads(finished, tenant, api_url, settings, tmp_path):
    job_id = finished["id"]
    result = muonforge("export", job_id, "--format", "hf", "--out", tmp_path / "hf", url=api_url, key=tenant)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [str(tmp_path / "hf")]
    # the synthetic task's token ids have no tokenizer; the archive itself is not left behind
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == [CONFIG_FILE, GENERATION_FILE, EXPORT_FILE]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    expected = checkpoint_logits(stored_checkpoint(settings, job_id, 20))  # the latest
    assert torch.allclose(logits(lambda x: model(input_ids=x).logits, 64, 16), expected, rtol=0, atol=1e-5)


def test_datasets_upload_and_list(settings, api_url, tmp_path):
    key = new_key(settings)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("to be or not to be " * 500)
    uploaded = muonforge("datasets", "upload", corpus, "--name", "hamlet", url=api_url, key=key)
    assert uploaded.returncode == 0, uploaded.stderr
    dataset_id = uploaded.stdout.strip()
    assert f"uploaded {corpus} as {dataset_id} ({corpus.stat().st_size:,} bytes)" in uploaded.stderr
    header, row = muonforge("datasets", "list", url=api_url, key=key).stdout.splitlines()
    assert header.split() == ["id", "name", "format", "bytes", "sha256", "age"]
    assert row.split()[:4] == [dataset_id, "hamlet", "text", f"{corpus.stat().st_size:,}"]
    listed = json.loads(muonforge("datasets", "list", "--json", url=api_url, key=key).stdout)
    assert [(d["id"], d["name"]) for d in listed] == [(dataset_id, "hamlet")]
    deleted = muonforge("datasets", "delete", dataset_id, url=api_url, key=key)
    assert deleted.returncode == 0, deleted.stderr
    assert deleted.stdout.strip() == f"{dataset_id}: deleted"
    again = muonforge("datasets", "delete", dataset_id, url=api_url, key=key)
    assert again.returncode == 2
    assert one_error_line(again) == f"error: no dataset {dataset_id!r} (404 not_found)"
    assert muonforge("datasets", "list", "--json", url=api_url, key=key).stdout.strip() == "[]"

    (tmp_path / "latin1.txt").write_bytes("café au lait".encode("latin-1"))
    invalid = muonforge("datasets", "upload", tmp_path / "latin1.txt", url=api_url, key=key)
    assert invalid.returncode == 2
    assert one_error_line(invalid) == "error: file: the file is not UTF-8 text (byte 3) (422 validation_error)"
    absent = muonforge("datasets", "upload", tmp_path / "absent.txt", url=api_url, key=key)
    assert absent.returncode == 2
    assert one_error_line(absent) == f"error: {tmp_path / 'absent.txt'}: No such file or directory"


def test_cancel_and_cancelling_a_finished_job(tenant, api_url, tmp_path):
    spec = tmp_path / "long.yaml"
    spec.write_text(json.dumps(tiny_spec(steps=100_000, checkpoint_every=100_000)))
    job_id = muonforge("submit", spec, url=api_url, key=tenant).stdout.strip()
    cancelled = muonforge("cancel", job_id, url=api_url, key=tenant)
    assert cancelled.returncode == 0, cancelled.stderr
    assert cancelled.stdout.strip() in (f"{job_id}: cancelled", f"{job_id}: cancelling")
    with Client(api_url, tenant) as client:
        wait_for(lambda: client.get_job(job_id)["status"] == "cancelled", timeout=60)
    again = muonforge("cancel", job_id, url=api_url, key=tenant)
    assert again.returncode == 2
    assert one_error_line(again) == f"error: job {job_id} has already finished (cancelled) (409 conflict)"


def test_ctrl_c_detaches_from_a_followed_job_which_goes_on(tenant, api_url, tmp_path):
    spec = tmp_path / "long.yaml"
    spec.write_text(json.dumps(tiny_spec(steps=100_000, checkpoint_every=100_000)))
    env = client_env(api_url, tenant)
    pipes = {"env": env, "cwd": ROOT, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    submit = subprocess.Popen(command("submit", spec, "--follow"), **pipes)
    job_id = submit.stdout.readline().strip()
    with Client(api_url, tenant) as client:
        try:
            wait_for(lambda: client.get_job(job_id)["progress"]["step"] > 0, timeout=60)
            submit.send_signal(signal.SIGINT)
            assert submit.wait(timeout=30) == 130
            assert f"Re-attach: muonforge logs {job_id} --follow" in submit.stderr.read()

            logs = subprocess.Popen(command("logs", job_id, "--follow"), **pipes)
            assert logs.stdout.readline().startswith("status      queued")
            logs.send_signal(signal.SIGINT)
            assert logs.wait(timeout=30) == 130
            assert f"Re-attach: muonforge logs {job_id} --follow" in logs.stderr.read()
            assert client.get_job(job_id)["status"] == "running"

            so_far = muonforge("logs", job_id, url=api_url, key=tenant)  # ends once it has caught up
            assert so_far.returncode == 0, so_far.stderr
            lines = so_far.stdout.splitlines()
            assert lines[:2] == ["status      queued (attempt 0)", "status      running (attempt 1)"]
            assert lines[2].startswith("info        parameters: Muon takes")
            assert all(line.startswith("sample      step ") for line in lines[3:])  # at evaluations, so far
        finally:
            client.cancel_job(job_id)
            wait_for(lambda: client.get_job(job_id)["status"] == "cancelled", timeout=60)
    follow = muonforge("logs", job_id, "--follow", url=api_url, key=tenant)
    assert follow.returncode == 1, "a followed job that ends cancelled exits 1"
    assert follow.stdout.splitlines()[-1].startswith("status      cancelled")


def piped(args: list[object], reader: str, url: str, key: str) -> subprocess.CompletedProcess:
    """``muonforge ARGS | READER`` in bash with pipefail: its status is muonforge's unless that is 0."""
    line = f"{shlex.join(command(*args))} | {reader}"
    return subprocess.run(
        ["bash", "-o", "pipefail", "-c", line], env=client_env(url, key), cwd=ROOT, capture_output=True, timeout=60
    )


def test_a_reader_that_goes_away_ends_the_command_quietly_with_141(settings, api_url):
    """``| head`` closes the pipe after what it wants, long before the command has written all
    (more than a pipe holds): the command stops without a word, as git does (SIGPIPE: 141)."""
    key = new_key(settings)
    job_id = synthetic_run(settings, key, tiny_spec(steps=2))
    with transaction(settings) as session:
        for n in range(2000):
            record_log(session, NoBus(), job_id, "info", f"line {n} " + "x" * 100, step=None)
    for _ in range(60):
        synthetic_run(settings, key, tiny_spec(steps=2))
    for args, reader, kept in (
        (["logs", job_id], "head -2", lambda out: b"".join(out.splitlines(keepends=True)[:2])),
        (["jobs", "--json", "--limit", "100"], "head -c 50", lambda out: out[:50]),
    ):
        whole = muonforge(*args, url=api_url, key=key)
        assert whole.returncode == 0 and len(whole.stdout) > 2**17, "more than a pipe holds"
        cut = piped(args, reader, api_url, key)
        assert (cut.returncode, cut.stderr.decode(), cut.stdout) == (141, "", kept(whole.stdout.encode()))


def test_a_transfer_draws_a_progress_bar_on_a_terminal(settings, api_url, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("x" * 100_000)
    terminal, stderr = pty.openpty()
    upload = subprocess.Popen(
        command("datasets", "upload", corpus),
        env=client_env(api_url, new_key(settings)),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=stderr,
    )
    os.close(stderr)
    drawn = b""
    while chunk := read_terminal(terminal):
        drawn += chunk
    assert upload.wait(timeout=60) == 0
    assert b"corpus.txt" in drawn and b"100.0/100.0 kB" in drawn, drawn


def read_terminal(fd: int) -> bytes:
    try:
        return os.read(fd, 65536)
    except OSError:  # the other end closed
        return b""


# -- errors ---------------------------------------------------------------------------------------
def test_an_unreachable_server_exits_3_with_one_line_naming_it():
    url = closed_port_url()
    result = muonforge("jobs", url=url, key="mf_any")
    assert result.returncode == 3
    assert one_error_line(result) == (
        f"error: cannot reach the server at {url}: connection refused; start one with 'muonforge up', or point"
        " MUONFORGE_API_URL (or --url) at it"
    )
    debug = muonforge("--debug", "show", "job_x", url=url, key="mf_any")
    assert debug.returncode == 3 and "Traceback" in debug.stderr and "retry 2" in debug.stderr


def test_a_missing_or_rejected_key_exits_3(api_url):
    missing = muonforge("jobs", url=api_url, key=None)
    assert missing.returncode == 3
    assert one_error_line(missing) == "error: no API key: set MUONFORGE_API_KEY or pass --api-key"
    rejected = muonforge("jobs", url=api_url, key="mf_wrong")
    assert rejected.returncode == 3
    assert one_error_line(rejected) == (
        "error: the server refused the API key from MUONFORGE_API_KEY: unknown or revoked API key (401 unauthorized)"
    )
    typed = muonforge("jobs", "--api-key", "mf_typed", url=api_url, key=None)
    assert typed.returncode == 3
    assert one_error_line(typed) == (
        "error: the server refused the API key given with --api-key: unknown or revoked API key (401 unauthorized)"
    )


def test_options_before_or_after_the_command_override_the_environment(settings, api_url):
    key = new_key(settings)
    for args in (["--url", api_url, "--api-key", key, "jobs"], ["jobs", "--url", api_url, "--api-key", key]):
        result = muonforge(*args, url=closed_port_url(), key="mf_wrong")
        assert result.returncode == 0 and result.stderr == "no jobs\n", result.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["show", "job_nope"],
        ["logs", "job_nope"],
        ["cancel", "job_nope"],
        ["metrics", "job_nope"],
        ["download", "job_nope", "--step", "1"],
    ],
)
def test_an_unknown_job_exits_2(settings, api_url, args):
    result = muonforge(*args, url=api_url, key=new_key(settings))
    assert result.returncode == 2
    assert one_error_line(result) == "error: no job 'job_nope' (404 not_found)"


def test_an_invalid_spec_exits_2_naming_each_field(settings, api_url, tmp_path):
    spec = tmp_path / "bad.yaml"
    spec.write_text(json.dumps(tiny_spec() | {"optimizer": {"lr": -1}}))
    result = muonforge("submit", spec, url=api_url, key=new_key(settings))
    assert result.returncode == 2
    assert one_error_line(result) == "error: optimizer.lr: Input should be greater than 0 (422 validation_error)"
    spec.write_text(json.dumps(tiny_spec(steps=0) | {"optimizer": {"lr": -1}, "extra": 1}))
    result = muonforge("submit", spec, url=api_url, key=new_key(settings))
    assert result.returncode == 2
    assert one_error_line(result) == (
        "error: optimizer.lr: Input should be greater than 0; train.steps: Input should be greater than 0; extra:"
        " Extra inputs are not permitted (422 validation_error)"
    )


def test_client_commands_import_neither_app_worker_nor_torch():
    probe = (
        "import sys\n"
        "from muonforge.cli import main\n"
        f"main(['--url', {closed_port_url()!r}, '--api-key', 'mf_any', 'jobs'])\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'app', 'worker', 'torch', 'optim'}))\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "[]", result.stdout + result.stderr
    assert "cannot reach the server" in result.stderr
