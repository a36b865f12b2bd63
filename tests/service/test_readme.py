"""The README's client examples as a reader runs them: each Python block that imports muonforge
run as a script of its own against a real API and worker, with MUONFORGE_API_URL and
MUONFORGE_API_KEY set as `muonforge up` says to set them."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from muonforge import Client
from tests.service.test_client import stored_checkpoint
from tests.support.api import key_of
from tests.support.cli import client_env
from tests.support.services import ROOT

BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.DOTALL)
EXAMPLES = {
    "AsyncClient" if "AsyncClient" in block else "Client": block for block in BLOCKS if "from muonforge import" in block
}


def run_example(name: str, url: str, key: str, cwd: Path) -> subprocess.CompletedProcess:
    """The README's example of ``name`` as a script (a guard of 300 s: a few seconds on a CPU)."""
    env = client_env(url, key)
    return subprocess.run(
        [sys.executable, "-c", EXAMPLES[name]], env=env, cwd=cwd, capture_output=True, text=True, timeout=300
    )


def test_the_readme_shows_both_clients():
    assert sorted(EXAMPLES) == ["AsyncClient", "Client"]


def test_the_client_example_prints_the_loss_of_every_step(api_url, worker, auth, tmp_path):
    result = run_example("Client", api_url, key_of(auth), tmp_path)
    assert result.returncode == 0, result.stderr
    printed = [line.split() for line in result.stdout.splitlines()]
    with Client(api_url, key_of(auth)) as client:
        (job,) = client.list_jobs()
        history = client.metrics(job["id"], names=["loss"])
    assert job["status"] == "succeeded"
    assert [[int(step), float(loss)] for step, loss in printed] == history["loss"]


def test_the_async_example_downloads_the_latest_checkpoint(api_url, worker, auth, settings, tmp_path):
    result = run_example("AsyncClient", api_url, key_of(auth), tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["checkpoint at step 50", "checkpoint at step 100"]
    with Client(api_url, key_of(auth)) as client:
        (job,) = client.list_jobs()
        latest = client.checkpoints(job["id"])[0]["step"]
    assert job["status"] == "succeeded" and latest == job["progress"]["total_steps"]
    assert (tmp_path / "final.pt").read_bytes() == stored_checkpoint(settings, job["id"], latest)
