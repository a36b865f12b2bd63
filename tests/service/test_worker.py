"""Jobs run by real Celery worker processes: success, cancel, redelivery, kill -9 and resume."""

from __future__ import annotations

import io
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch

from app.db.session import transaction
from app.messaging.broker import send_train_tasks
from app.messaging.live_bus import NoBus
from app.repositories.jobs import JobRepository
from app.services import lifecycle
from muonforge.client import Client
from tests.support.api import events, job, new_key
from tests.support.net import wait_for
from tests.support.specs import tiny_spec
from worker.engine.checkpoints import save_checkpoint
from worker.engine.run import checkpoint_dir
from worker.lease import Lease
from worker.sink import JobSink


def test_submit_run_succeed_with_summary(client, settings, auth, worker):
    created = client.post("/v1/jobs", json=tiny_spec(steps=30), headers=auth).json()
    done = wait_for(lambda: (j := job(client, auth, created["id"]))["status"] == "succeeded" and j, timeout=120)
    assert done["progress"] == {"step": 30, "total_steps": 30} and done["attempt"] == 1
    assert {"loss", "val_loss", "attn_max_logit", "tokens_per_s"} <= set(done["summary"])
    assert done["started_at"] and done["finished_at"] and done["error"] is None
    statuses = [p["status"] for kind, p in events(settings, created["id"]) if kind == "status"]
    assert statuses == ["queued", "running", "succeeded"]
    checkpoints = [p["step"] for kind, p in events(settings, created["id"]) if kind == "checkpoint"]
    assert checkpoints == [10, 20, 30]

    listed = client.get(f"/v1/jobs/{created['id']}/checkpoints", headers=auth).json()["data"]
    assert [c["step"] for c in listed] == [30, 20, 10] and all(c["bytes"] > 0 for c in listed)
    download = client.get(f"/v1/jobs/{created['id']}/checkpoints/20", headers=auth)
    assert download.status_code == 200 and len(download.content) == listed[1]["bytes"]
    state = torch.load(io.BytesIO(download.content), weights_only=False)
    assert state["step"] == 20 and "model" in state and "optimizer" in state
    assert client.get(f"/v1/jobs/{created['id']}/checkpoints/25", headers=auth).status_code == 404
    other = {"Authorization": f"Bearer {new_key(settings)}"}
    for path in (f"/v1/jobs/{created['id']}/checkpoints", f"/v1/jobs/{created['id']}/checkpoints/20"):
        assert client.get(path, headers=other).status_code == 404


def test_a_job_that_stops_early_succeeds_with_where_and_why(client, settings, auth, worker):
    # No evaluation betters the first by 10 nats: two more evaluations end the run at step 8 of 40.
    spec = tiny_spec(steps=40, eval_every=4, early_stop={"patience": 2, "min_delta": 10.0})
    created = client.post("/v1/jobs", json=spec, headers=auth).json()
    done = wait_for(lambda: (j := job(client, auth, created["id"]))["status"] == "succeeded" and j, timeout=120)
    assert done["progress"] == {"step": 8, "total_steps": 40} and done["summary"]["stopped_at"] == 8
    reason = done["summary"]["stop_reason"]
    assert reason.startswith("val_loss did not improve by more than 10 for 2 evaluations (best ")
    assert reason.endswith(" at step 0)")
    history = events(settings, created["id"])
    assert [p["step"] for kind, p in history if kind == "checkpoint"] == [8]
    assert ("log", {"level": "info", "message": f"stopped early at step 8: {reason}"}) in history


def test_cancel_while_running(client, settings, auth, worker):
    created = client.post("/v1/jobs", json=tiny_spec(steps=100_000, checkpoint_every=100_000), headers=auth).json()
    wait_for(lambda: job(client, auth, created["id"])["progress"]["step"] > 5, timeout=120)
    r = client.post(f"/v1/jobs/{created['id']}/cancel", headers=auth)
    assert r.status_code == 200 and r.json()["status"] in ("cancelling", "cancelled")
    done = wait_for(lambda: (j := job(client, auth, created["id"]))["status"] == "cancelled" and j, timeout=60)
    assert done["finished_at"] and 5 < done["progress"]["step"] < 100_000


def test_a_second_delivery_does_not_run_the_job_twice(client, settings, auth, start_worker):
    created = client.post("/v1/jobs", json=tiny_spec(steps=40), headers=auth).json()
    send_train_tasks(settings, [(created["id"], "default")])  # the same task delivered again
    send_train_tasks(settings, [(created["id"], "default")])
    start_worker()
    done = wait_for(lambda: (j := job(client, auth, created["id"]))["status"] == "succeeded" and j, timeout=120)
    assert done["attempt"] == 1
    statuses = [p["status"] for kind, p in events(settings, created["id"]) if kind == "status"]
    assert statuses.count("running") == 1


def test_a_job_whose_corpus_is_gone_fails_with_the_reason(client, settings, auth, worker):
    ds = client.post("/v1/datasets", files={"file": ("c.txt", b"some text " * 200)}, headers=auth).json()
    for path in (settings.artifact_dir / "datasets").rglob(f"{ds['id']}.txt"):
        path.unlink()
    spec = tiny_spec() | {"data": {"dataset_id": ds["id"]}}
    created = client.post("/v1/jobs", json=spec, headers=auth).json()
    done = wait_for(lambda: (j := job(client, auth, created["id"]))["status"] == "failed" and j, timeout=120)
    assert done["error"] == {
        "code": "dataset_missing",
        "message": f"the file of dataset {ds['id']} is missing from the service's storage; upload the corpus again",
    }
    assert done["attempt"] == 1 and done["finished_at"]


@pytest.mark.slow
def test_kill_9_mid_job_then_a_fresh_worker_resumes_from_the_checkpoint(client, api_url, settings, auth, start_worker):
    first = start_worker()
    spec = tiny_spec(steps=600, checkpoint_every=50, eval_every=100)
    created = client.post("/v1/jobs", json=spec, headers=auth).json()
    follower = Client(api_url, auth["Authorization"].split()[1])
    with ThreadPoolExecutor(1) as pool:  # follows the job's events across the kill and the resume
        streamed = pool.submit(lambda: list(follower.events(created["id"])))
        _kill_and_resume(client, settings, auth, start_worker, first, created)
        received = streamed.result(timeout=120)
    follower.close()
    # The resumed attempt sent the steps after its checkpoint again: each was streamed once, stored once.
    assert [e.data["step"] for e in received if e.event == "metrics"] == list(range(601))
    with Client(api_url, auth["Authorization"].split()[1]) as c:
        history = c.metrics(created["id"], names=["loss", "val_loss"], max_points=1000)
    assert [p[0] for p in history["loss"]] == list(range(600))
    assert [p[0] for p in history["val_loss"]] == list(range(0, 601, 100))
    # Retention (keep_checkpoints 3): the latest three and the best val_loss, in rows and on disk.
    listed = client.get(f"/v1/jobs/{created['id']}/checkpoints", headers=auth).json()["data"]
    best = min((c["metrics"]["val_loss"], c["step"]) for c in listed if "val_loss" in c["metrics"])[1]
    assert {c["step"] for c in listed} == {600, 550, 500, best}
    on_disk = {p.name for p in checkpoint_dir(settings.artifact_dir / "jobs" / created["id"]).iterdir()}
    assert on_disk == {f"step_{c['step']:08d}.pt" for c in listed}


def _kill_and_resume(client, settings, auth, start_worker, first, created):
    wait_for(lambda: job(client, auth, created["id"])["progress"]["step"] >= 120, timeout=120, interval=0.02)
    first.kill()  # SIGKILL: no cleanup, the lease just stops being renewed
    killed_at = job(client, auth, created["id"])["progress"]["step"]
    assert job(client, auth, created["id"])["status"] == "running"
    start_worker()
    done = wait_for(lambda: (j := job(client, auth, created["id"]))["status"] == "succeeded" and j, timeout=180)
    assert done["attempt"] == 2 and done["progress"]["step"] == 600
    history = events(settings, created["id"])
    resumed = [p["message"] for kind, p in history if kind == "log" and "resumed from" in p["message"]]
    assert len(resumed) == 1
    resumed_step = int(resumed[0].split("at step ")[1])
    assert resumed_step % 50 == 0 and 100 <= resumed_step <= killed_at
    statuses = [p["status"] for kind, p in history if kind == "status"]
    assert statuses == ["queued", "running", "queued", "running", "succeeded"]


def test_a_checkpoint_written_but_not_recorded_is_adopted_by_the_next_attempt(settings, auth, client):
    """An attempt that dies between writing a checkpoint file and recording it: the next attempt,
    which resumes from that file, records it (once) with the metrics saved in it. A file past the
    stored metrics is deleted instead: resuming from it would leave the steps before it without
    metrics."""
    created = client.post("/v1/jobs", json=tiny_spec(), headers=auth).json()
    with transaction(settings) as session:
        attempt = lifecycle.claim(session, NoBus(), created["id"], "test", timedelta(minutes=1)).attempt
    directory = checkpoint_dir(settings.artifact_dir / "jobs" / created["id"])
    save_checkpoint(directory, 20, {"model": {}, "last_metrics": {"loss": 1.25, "val_loss": 1.5}})
    save_checkpoint(directory, 30, {"model": {}, "last_metrics": {"loss": 1.0}})
    for _ in range(2):
        sink = JobSink(settings, created["id"], attempt, 25, {})  # metrics stored up to step 25
        sink.adopt_checkpoints()
        sink.close()
    listed = client.get(f"/v1/jobs/{created['id']}/checkpoints", headers=auth).json()["data"]
    assert [(c["step"], c["metrics"]) for c in listed] == [(20, {"loss": 1.25, "val_loss": 1.5})]
    assert [p for kind, p in events(settings, created["id"]) if kind == "checkpoint"] == [
        {"step": 20, "bytes": (directory / "step_00000020.pt").stat().st_size}
    ]
    assert not (directory / "step_00000030.pt").exists()


def test_a_stalled_attempt_stops_renewing_its_lease_and_a_live_one_renews(client, settings, auth):
    """The lease thread renews only while the trainer pulses (before every step): once no step has
    begun for stall_seconds it lets the lease lapse, so the reaper can give the job to another worker."""
    quick = settings.model_copy(update={"heartbeat_seconds": 0.1, "stall_seconds": 1.0})
    ids = [client.post("/v1/jobs", json=tiny_spec(), headers=auth).json()["id"] for _ in range(2)]
    with transaction(settings) as session:
        lease = timedelta(seconds=30)
        attempts = [lifecycle.claim(session, NoBus(), job_id, "test:0:0", lease).attempt for job_id in ids]

    def expiry(job_id):
        with transaction(settings) as session:
            return JobRepository(session).get(job_id).lease_expires_at

    stalled_id, live_id = ids
    with Lease(quick, stalled_id, attempts[0]) as stalled, Lease(quick, live_id, attempts[1]) as live:
        wait_for(lambda: live.pulse() or stalled.stalled.is_set(), timeout=30)  # the live one pulses meanwhile
        frozen = expiry(stalled_id)
        renewed = expiry(live_id)
        for _ in range(20):  # 2 s: about 20 heartbeats
            live.pulse()
            time.sleep(0.1)
        assert expiry(stalled_id) == frozen  # no renewal after the stall
        assert expiry(live_id) > renewed and not live.stalled.is_set() and not live.lost.is_set()
