"""How the launcher reads a group's end: stand-in ranks (real processes on the launcher's socket,
in place of torchrun's) that say they are done or not, and exit as a teardown fault does."""

from __future__ import annotations

import sys
from dataclasses import asdict

import pytest

from worker.engine.launch import Launch, RankFailed
from worker.engine.outcome import RunResult
from worker.engine.request import RunRequest

pytestmark = pytest.mark.system  # its tests start processes: the service's, torchrun's or a command's

ABORTED = 134  # the exit status of a process that aborted (SIGABRT), as a gloo teardown fault can

# One stand-in rank: argv = rank, whether it says done, whether it reports a result, exit status.
RANK = """
import json, os, sys
from worker.engine.channel import ADDRESS_ENV, TOKEN_ENV, RankChannel
rank, done, result, status = int(sys.argv[1]), sys.argv[2] == "done", sys.argv[3] == "result", int(sys.argv[4])
channel = RankChannel(os.environ[ADDRESS_ENV], os.environ[TOKEN_ENV], rank)
if result:
    channel._send({"kind": "result", **json.loads(os.environ["RESULT"])})
if done:
    channel.done()
channel.close()
os._exit(status)
"""

# torchrun's stand-in: starts the ranks given as "rank:done:result" and exits with the given status
# once they have.
GROUP = """
import subprocess, sys
status, ranks = int(sys.argv[1]), [r.split(":") for r in sys.argv[2:]]
procs = [subprocess.Popen([sys.executable, "-c", RANK, r, d, res, "0"]) for r, d, res in ranks]
sys.exit(max([p.wait() for p in procs] + [status]))
"""

RESULT = RunResult("succeeded", 10, {"loss": 1.0}, 100.0, 1.0)


def follow(tmp_path, monkeypatch, ranks: list[str], status: int, reports: bool) -> RunResult | None:
    monkeypatch.setenv("RESULT", __import__("json").dumps(asdict(RESULT)))
    group = Launch("127.0.0.1", tmp_path / "ranks.log", nproc=len(ranks))
    try:
        group.start([sys.executable, "-c", f"RANK = {RANK!r}\n" + GROUP, str(status), *ranks])
        return group.follow(None, lambda: False, None, reports)
    finally:
        group.kill()


def test_a_node_whose_ranks_were_all_done_ends_well_whatever_torchrun_exits_with(tmp_path, monkeypatch):
    assert follow(tmp_path, monkeypatch, ["1:done:-", "2:done:-"], ABORTED, reports=False) is None


def test_a_node_with_a_rank_not_done_lost_that_rank(tmp_path, monkeypatch):
    with pytest.raises(RankFailed, match=f"exit status {ABORTED}"):
        follow(tmp_path, monkeypatch, ["1:done:-", "2:-:-"], ABORTED, reports=False)


def test_a_node_whose_ranks_all_ended_well_needs_no_done(tmp_path, monkeypatch):
    """torchrun's own verdict: exit status 0 is every rank's."""
    assert follow(tmp_path, monkeypatch, ["1:-:-"], 0, reports=False) is None


def test_the_reporting_node_returns_rank_0s_result_after_a_teardown_fault(tmp_path, monkeypatch):
    assert follow(tmp_path, monkeypatch, ["0:done:result", "1:done:-"], ABORTED, reports=True) == RESULT


def test_the_reporting_node_without_rank_0s_outcome_lost_a_rank(tmp_path, monkeypatch):
    """Done is not an outcome: the reporting node needs rank 0's."""
    with pytest.raises(RankFailed):
        follow(tmp_path, monkeypatch, ["0:done:-", "1:done:-"], ABORTED, reports=True)


def test_a_cuda_group_with_more_ranks_than_the_node_has_gpus_fails_before_it_starts(tmp_path, monkeypatch):
    """The node's GPUs are the outer boundary here: one is what this worker reports."""
    import torch

    from tests.engine.test_distributed import spec
    from worker.engine.launch import run_group
    from worker.engine.outcome import NotEnoughGpus

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    job = spec(2, device="cuda")
    with pytest.raises(NotEnoughGpus, match=r"resources\.nproc is 2: .* this worker has 1") as raised:
        run_group(RunRequest(job, tmp_path / "run"))
    assert raised.value.code == "not_enough_gpus"
    assert not (tmp_path / "run").exists()  # nothing launched, nothing written
