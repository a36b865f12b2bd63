"""Jobs of two processes run by real Celery workers through torchrun: two processes on one worker
(resources.nproc: 2) and one on each of two workers (resources.nnodes: 2). End to end with one
telemetry record per step, a rank killed mid-run, cancel, a worker killed."""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import pytest

from app.db.base import utcnow
from app.db.session import transaction
from app.messaging.live_bus import NoBus
from app.repositories.leases import LeaseRepository
from app.services import lifecycle
from app.services.reaper import release_attempt
from muonforge.client import Client
from tests.support.api import events, job
from tests.support.net import wait_for
from tests.support.specs import group_spec
from worker.engine.launch import Meeting
from worker.gang import this_node
from worker.lease import GangBroken, Lease

pytestmark = pytest.mark.system  # its tests start processes: the service's, torchrun's or a command's


def follow(api_url, auth, job_id, until):
    """The job's events, as a client streamed them while ``until()`` ran."""
    with Client(api_url, auth["Authorization"].split()[1]) as follower, ThreadPoolExecutor(1) as pool:
        streamed = pool.submit(lambda: list(follower.events(job_id)))
        value = until()
        return value, streamed.result(timeout=60)


# A job whose first attempt was lost and whose second ran it to the end.
RESUMED_ONCE = ["queued", "running", "queued", "running", "succeeded"]


def descendants(pid: int) -> dict[int, str]:
    """{pid: command line} of every process below ``pid``."""
    parents, commands = {}, {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
                commands[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
    found, frontier = {}, [pid]
    while frontier:
        children = [p for p, parent in parents.items() if parent in frontier]
        found.update({p: commands[p] for p in children})
        frontier = children
    return found


def group_processes(worker) -> dict[str, list[int]]:
    """The worker's torchrun and the ranks it started: {"torchrun": [pid], "ranks": [pid of rank 0, 1, ...]}."""
    below = descendants(worker.proc.pid)
    ranks = sorted(
        (p for p, cmd in below.items() if "worker.engine.rank" in cmd and "torch.distributed" not in cmd), key=rank_of
    )
    return {"torchrun": [p for p, cmd in below.items() if "torch.distributed.run" in cmd], "ranks": ranks}


def rank_of(pid: int) -> int:
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return int(next(v for v in environ if v.startswith(b"RANK=")).split(b"=")[1])


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def test_a_two_process_job_runs_end_to_end_with_one_record_per_step(client, api_url, settings, auth, start_worker):
    start_worker()
    # Nothing listens there: a delivery is recorded once per event whether or not it is delivered.
    hook = client.post(
        "/v1/webhooks", json={"url": "http://127.0.0.1:9/hook", "events": ["job.succeeded"]}, headers=auth
    ).json()
    created = client.post("/v1/jobs", json=group_spec(30), headers=auth).json()
    assert created["spec"]["resources"] == {"nproc": 2, "nnodes": 1}
    with Client(api_url, auth["Authorization"].split()[1]) as follower, ThreadPoolExecutor(1) as pool:
        streamed = pool.submit(lambda: list(follower.events(created["id"])))
        done = wait_for(lambda: (j := job(client, auth, created["id"]))["status"] == "succeeded" and j, timeout=240)
        received = streamed.result(timeout=60)
    assert done["progress"] == {"step": 30, "total_steps": 30} and done["attempt"] == 1
    assert {"loss", "val_loss", "attn_max_logit", "tokens_per_s"} <= set(done["summary"])
    # Rank 0 alone reports: each step once on the live stream, in the database, in metrics.jsonl.
    assert [e.data["step"] for e in received if e.event == "metrics"] == list(range(31))
    history = client.get(f"/v1/jobs/{created['id']}/metrics?names=loss,val_loss", headers=auth).json()["series"]
    assert [p[0] for p in history[0]["points"]] == list(range(30))
    assert [p[0] for p in history[1]["points"]] == [0, 10, 20, 30]
    out = settings.artifact_dir / "jobs" / created["id"]
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 31
    kinds = events(settings, created["id"])
    assert [p["step"] for kind, p in kinds if kind == "checkpoint"] == [10, 20, 30]
    assert [p["step"] for kind, p in kinds if kind == "sample"] == [0, 10, 20, 30]
    assert [p["status"] for kind, p in kinds if kind == "status"] == ["queued", "running", "succeeded"]
    # The attempt alone records the job's end: one webhook delivery, not one per rank.
    sent = client.get(f"/v1/webhooks/{hook['id']}/deliveries", headers=auth).json()["data"]
    assert [(d["event_type"], d["payload"]["data"]["id"]) for d in sent] == [("job.succeeded", created["id"])]


def test_a_rank_killed_mid_run_makes_the_job_resume_from_its_checkpoint(client, api_url, settings, auth, start_worker):
    worker = start_worker()
    created = client.post("/v1/jobs", json=group_spec(300, checkpoint_every=50, eval_every=100), headers=auth).json()
    with Client(api_url, auth["Authorization"].split()[1]) as follower, ThreadPoolExecutor(1) as pool:
        streamed = pool.submit(lambda: list(follower.events(created["id"])))
        wait_for(lambda: job(client, auth, created["id"])["progress"]["step"] >= 80, timeout=240, interval=0.05)
        first = group_processes(worker)
        assert len(first["torchrun"]) == 1 and len(first["ranks"]) == 2, first
        os.kill(first["ranks"][1], signal.SIGKILL)  # rank 1: no cleanup, no word to anyone
        killed_at = job(client, auth, created["id"])["progress"]["step"]
        done = wait_for(lambda: (j := job(client, auth, created["id"]))["status"] == "succeeded" and j, timeout=240)
        received = streamed.result(timeout=60)
    assert done["attempt"] == 2 and done["progress"]["step"] == 300
    assert "lost a process or a node of its group" in worker.log_path.read_text()  # given back at once
    assert not any(running(pid) for pid in first["torchrun"] + first["ranks"])
    history = events(settings, created["id"])
    assert [p["status"] for kind, p in history if kind == "status"] == RESUMED_ONCE
    resumed = [p["message"] for kind, p in history if kind == "log" and "resumed from" in p["message"]]
    assert len(resumed) == 1
    resumed_step = int(resumed[0].split("at step ")[1])
    assert resumed_step % 50 == 0 and 50 <= resumed_step <= killed_at + 50
    # The steps redone after the checkpoint were streamed once and stored once.
    assert [e.data["step"] for e in received if e.event == "metrics"] == list(range(301))
    points = client.get(f"/v1/jobs/{created['id']}/metrics?names=loss", headers=auth).json()["series"][0]["points"]
    assert [p[0] for p in points] == list(range(300))


def test_cancel_of_a_running_group_ends_every_process_of_it(client, settings, auth, start_worker):
    worker = start_worker()
    created = client.post("/v1/jobs", json=group_spec(100_000, checkpoint_every=100_000), headers=auth).json()
    wait_for(lambda: job(client, auth, created["id"])["progress"]["step"] > 5, timeout=240)
    processes = group_processes(worker)
    assert len(processes["torchrun"]) == 1 and len(processes["ranks"]) == 2, processes
    assert client.post(f"/v1/jobs/{created['id']}/cancel", headers=auth).status_code == 200
    done = wait_for(lambda: (j := job(client, auth, created["id"]))["status"] == "cancelled" and j, timeout=120)
    assert 5 < done["progress"]["step"] < 100_000
    assert not any(running(pid) for pid in processes["torchrun"] + processes["ranks"])
    # Every rank stopped before the same step, and rank 0 checkpointed it.
    checkpoints = [p["step"] for kind, p in events(settings, created["id"]) if kind == "checkpoint"]
    assert checkpoints == [done["progress"]["step"]]


def test_a_killed_worker_leaves_no_process_of_its_group_behind(client, auth, start_worker):
    worker = start_worker()
    created = client.post("/v1/jobs", json=group_spec(100_000, checkpoint_every=100_000), headers=auth).json()
    wait_for(lambda: job(client, auth, created["id"])["progress"]["step"] > 5, timeout=240)
    processes = group_processes(worker)
    assert len(processes["ranks"]) == 2, processes
    worker.kill()  # SIGKILL: the attempt's socket closes with it
    wait_for(lambda: not any(running(pid) for pid in processes["torchrun"] + processes["ranks"]), timeout=30)
    client.post(f"/v1/jobs/{created['id']}/cancel", headers=auth)  # the reaper ends it once the lease lapses
    wait_for(lambda: job(client, auth, created["id"])["status"] == "cancelled", timeout=60)


def test_a_two_node_job_runs_on_two_workers_with_one_record_per_step(client, api_url, settings, auth, start_worker):
    workers = [start_worker(), start_worker()]
    created = client.post("/v1/jobs", json=group_spec(30, nnodes=2), headers=auth).json()
    done, received = follow(
        api_url,
        auth,
        created["id"],
        lambda: wait_for(lambda: (j := job(client, auth, created["id"]))["status"] == "succeeded" and j, timeout=240),
    )
    assert done["progress"] == {"step": 30, "total_steps": 30} and done["attempt"] == 1
    assert [e.data["step"] for e in received if e.event == "metrics"] == list(range(31))
    kinds = events(settings, created["id"])
    assert [p["step"] for kind, p in kinds if kind == "checkpoint"] == [10, 20, 30]
    assert [p["status"] for kind, p in kinds if kind == "status"] == ["queued", "running", "succeeded"]
    # Each worker held one node of the gang.
    with transaction(settings) as session:
        owners = [n.owner for n in LeaseRepository(session).nodes(created["id"], 1)]
    assert sorted(int(owner.split(":")[1]) for owner in owners) == sorted(w.proc.pid for w in workers)


def test_a_worker_lost_mid_run_fails_the_attempt_on_all_nodes_and_the_job_resumes(
    client, api_url, settings, auth, start_worker
):
    workers = {w.proc.pid: w for w in (start_worker(), start_worker())}
    created = client.post(
        "/v1/jobs", json=group_spec(300, nnodes=2, checkpoint_every=50, eval_every=100), headers=auth
    ).json()

    def kill_a_node_and_wait():
        wait_for(lambda: job(client, auth, created["id"])["progress"]["step"] >= 80, timeout=240, interval=0.05)
        with transaction(settings) as session:
            owner = LeaseRepository(session).nodes(created["id"], 1)[1].owner
        lost = workers[int(owner.split(":")[1])]  # node 1's worker
        group = group_processes(lost)
        assert len(group["torchrun"]) == 1 and len(group["ranks"]) == 1, group
        lost.kill()  # SIGKILL: its ranks go with it, node 0's group fails
        start_worker()  # the resumed attempt needs two workers again
        done = wait_for(lambda: (j := job(client, auth, created["id"]))["status"] == "succeeded" and j, timeout=300)
        return done, group

    (done, group), received = follow(api_url, auth, created["id"], kill_a_node_and_wait)
    assert done["attempt"] == 2 and done["progress"]["step"] == 300
    assert not any(running(pid) for pid in group["torchrun"] + group["ranks"])
    history = events(settings, created["id"])
    assert [p["status"] for kind, p in history if kind == "status"] == RESUMED_ONCE
    resumed = [p["message"] for kind, p in history if kind == "log" and "resumed from" in p["message"]]
    assert len(resumed) == 1 and int(resumed[0].split("at step ")[1]) % 50 == 0
    assert [e.data["step"] for e in received if e.event == "metrics"] == list(range(301))


def test_the_gang_gathers_through_the_database_or_gives_the_job_back(client, settings, auth):
    """Node 0's claim opens the slots; each other worker takes a free one; node 0 waits for all of
    them (MUONFORGE_GANG_WAIT_SECONDS) and the others for node 0's meeting point."""
    quick = settings.model_copy(update={"gang_wait_seconds": 1.0})
    created = client.post("/v1/jobs", json=group_spec(30, nnodes=2), headers=auth).json()
    lease = timedelta(seconds=30)
    with transaction(settings) as session:
        attempt = lifecycle.claim(session, NoBus(), created["id"], "w0", lease).attempt  # node 0: opens the slots
    mine = Meeting("127.0.0.1:1", "run", "127.0.0.1:2", "token")

    def meet(index, lease, meeting):
        return this_node(quick, created["id"], attempt, index, lease, 2).meet(meeting)

    with pytest.raises(GangBroken, match="1 of the job's 2 nodes joined within 1 s"):
        meet(0, Lease(quick, created["id"], attempt, nnodes=2), mine)
    with transaction(settings) as session:
        repo = LeaseRepository(session)
        assert repo.claim_node(created["id"], "w1", lease) == (attempt, 1)
        assert repo.claim_node(created["id"], "w2", lease) is None  # the gang is full
    assert meet(0, Lease(quick, created["id"], attempt, nnodes=2), mine) == mine
    assert meet(1, Lease(quick, created["id"], attempt, node=1, owner="w1"), None) == mine
    with transaction(settings) as session:
        repo = LeaseRepository(session)
        assert repo.heartbeat_node(created["id"], attempt, 1, "w1", lease)
        assert not repo.heartbeat_node(created["id"], attempt, 1, "w2", lease)  # not its slot
        repo.leave_node(created["id"], attempt, 1, "w1")  # node 1 cannot go on
    wait_for(lambda: transaction_lost_nodes(settings, created["id"], attempt) == [1], timeout=5)
    assert release_attempt(settings, created["id"], attempt, "node 1 stopped renewing its lease") == "queued"
    with transaction(settings) as session:
        repo = LeaseRepository(session)
        assert not repo.heartbeat_node(created["id"], attempt, 1, "w1", lease)  # the attempt is over
    assert client.post(f"/v1/jobs/{created['id']}/cancel", headers=auth).json()["status"] == "cancelled"


def transaction_lost_nodes(settings, job_id, attempt):
    with transaction(settings) as session:
        return LeaseRepository(session).lost_nodes(job_id, attempt, utcnow())
