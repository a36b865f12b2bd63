"""Warm start (init_from) on the service: what intake refuses and resolves, and a real worker
running a parent and then a child that starts from its checkpoint."""

from __future__ import annotations

import threading
import time

import pytest

from app.db.session import transaction
from app.errors import ValidationFailed
from app.repositories.checkpoints import CheckpointRepository
from app.services.auth import authenticate
from app.services.intake import insert_submissions
from app.services.submission import prepare_submission
from contract.spec import JobSpec
from muonforge.client import Client
from tests.support.api import events, job, new_key
from tests.support.net import wait_for
from tests.support.specs import tiny_spec
from worker.sink import JobSink


def with_checkpoints(client, settings, auth, spec: dict, steps=(10, 20, 30)) -> str:
    """A cancelled job with checkpoint rows at ``steps`` (no worker, no files): a parent to resolve."""
    job_id = client.post("/v1/jobs", json=spec, headers=auth).json()["id"]
    client.post(f"/v1/jobs/{job_id}/cancel", headers=auth)
    with transaction(settings) as session:
        for step in steps:
            CheckpointRepository(session).add_checkpoint(
                job_id, 1, step, f"jobs/{job_id}/checkpoints/{step}.pt", 1, "0" * 64, {}
            )
    return job_id


def submit(client, auth, init_from: dict, **changes) -> dict:
    spec = tiny_spec() | {"init_from": init_from}
    for section, values in changes.items():
        spec[section] = {**spec.get(section, {}), **values}
    return client.post("/v1/jobs", json=spec, headers=auth)


def error(response) -> tuple[str, str]:
    assert response.status_code == 422, response.text
    body = response.json()["error"]
    assert body["code"] == "validation_error"
    return body["param"], body["message"]


def test_intake_resolves_the_latest_checkpoint_and_records_the_parent(client, settings, auth):
    parent = with_checkpoints(client, settings, auth, tiny_spec())
    r = submit(client, auth, {"job_id": parent})
    assert r.status_code == 201, r.text
    child = r.json()
    assert child["parent"] == {"job_id": parent, "step": 30}
    assert child["spec"]["init_from"] == {"job_id": parent, "step": 30, "optimizer_state": False}
    assert client.get(f"/v1/jobs/{child['id']}", headers=auth).json()["parent"] == child["parent"]
    explicit = submit(client, auth, {"job_id": parent, "step": 10, "optimizer_state": True}).json()
    assert explicit["parent"] == {"job_id": parent, "step": 10}
    assert client.get(f"/v1/jobs/{parent}", headers=auth).json()["parent"] is None
    for created in (child, explicit):
        client.post(f"/v1/jobs/{created['id']}/cancel", headers=auth)


def test_another_tenants_job_answers_as_a_missing_one(client, settings, auth):
    other = {"Authorization": f"Bearer {new_key(settings)}"}
    theirs = with_checkpoints(client, settings, other, tiny_spec())
    for job_id in (theirs, "job_nope"):
        assert error(submit(client, auth, {"job_id": job_id})) == (
            "init_from.job_id",
            f"no job {job_id!r} for this tenant",
        )


def test_a_step_without_a_checkpoint_lists_those_there_are(client, settings, auth):
    parent = with_checkpoints(client, settings, auth, tiny_spec())
    assert error(submit(client, auth, {"job_id": parent, "step": 15})) == (
        "init_from.step",
        f"job {parent} has no checkpoint at step 15; it has checkpoints at steps 10, 20, 30",
    )
    empty = with_checkpoints(client, settings, auth, tiny_spec(), steps=())
    assert error(submit(client, auth, {"job_id": empty})) == ("init_from.step", f"job {empty} has no checkpoint yet")


def test_another_model_vocabulary_or_optimizer_is_refused_naming_the_field(client, settings, auth):
    parent = with_checkpoints(client, settings, auth, tiny_spec())
    param, message = error(submit(client, auth, {"job_id": parent}, model={"d_model": 32}))
    assert param == "model.d_model" and message.startswith(f"model.d_model is 32 here and 16 in job {parent}")
    param, message = error(submit(client, auth, {"job_id": parent}, model={"arch": "mlp", "n_layer": 2}))
    assert param == "model.arch" and 'is "mlp" here and "gpt"' in message  # the first field that differs
    param, message = error(submit(client, auth, {"job_id": parent}, data={"builtin": "pysource"}))
    assert param == "data.tokenizer" and "a vocabulary of 256 tokens and job" in message and "had 64" in message
    init = {"job_id": parent, "optimizer_state": True}
    param, message = error(submit(client, auth, init, optimizer={"name": "adamw"}))
    assert param == "init_from.optimizer_state" and "set optimizer.name to 'muon'" in message
    assert submit(client, auth, {"job_id": parent}, optimizer={"name": "adamw"}).status_code == 201  # weights only
    for listed in client.get("/v1/jobs?status=queued", headers=auth).json()["data"]:
        client.post(f"/v1/jobs/{listed['id']}/cancel", headers=auth)


def test_warm_start_resumes_the_loss_curve_where_the_parent_left_it(client, settings, auth, api_url, worker):
    parent = client.post("/v1/jobs", json=tiny_spec(steps=60, eval_every=20, checkpoint_every=20), headers=auth).json()
    wait_for(lambda: job(client, auth, parent["id"])["status"] == "succeeded", timeout=180)
    r = client.post("/v1/jobs", json=tiny_spec(steps=5) | {"init_from": {"job_id": parent["id"]}}, headers=auth)
    assert r.status_code == 201, r.text
    child = r.json()
    assert child["parent"] == {"job_id": parent["id"], "step": 60}
    done = wait_for(lambda: (j := job(client, auth, child["id"]))["status"] == "succeeded" and j, timeout=180)
    assert done["progress"] == {"step": 5, "total_steps": 5} and done["parent"] == child["parent"]
    with Client(api_url, auth["Authorization"].split()[1]) as api:
        theirs = dict(api.metrics(parent["id"], names=["loss"])["loss"])
        ours = [loss for _, loss in api.metrics(child["id"], names=["loss"])["loss"]]
    fresh, late = theirs[0], sum(theirs[s] for s in range(55, 60)) / 5
    assert abs(ours[0] - late) < 0.25 * (fresh - late), (ours, late, fresh)
    logs = [p["message"] for kind, p in events(settings, child["id"]) if kind == "log"]
    assert any(m.startswith("warm start: the weights of step_00000060.pt (step 60)") for m in logs), logs


@pytest.mark.slow
def test_the_retention_policy_keeps_a_checkpoint_that_a_job_starts_from(client, settings, auth, worker):
    spec = tiny_spec(steps=5000, checkpoint_every=10, keep_checkpoints=1) | {"telemetry": {"sample_tokens": 0}}
    parent = client.post("/v1/jobs", json=spec, headers=auth).json()["id"]

    def checkpoint_steps() -> list[int]:
        return [c["step"] for c in client.get(f"/v1/jobs/{parent}/checkpoints", headers=auth).json()["data"]]

    def start_child() -> dict | None:
        # The checkpoint's row, not the progress: a step is reported before its checkpoint is
        # recorded. The parent's retention may remove the listed checkpoint before the intake
        # holds it: a 422 naming init_from.step, and the child is submitted again from a newer one.
        steps = checkpoint_steps()
        if not steps:
            return None
        r = submit(client, auth, {"job_id": parent, "step": max(steps)})
        if r.status_code == 201:
            return r.json()
        assert error(r)[0] == "init_from.step"
        return None

    child = wait_for(start_child, timeout=120)  # queued behind the parent
    pinned = child["parent"]["step"]
    wait_for(lambda: job(client, auth, parent)["progress"]["step"] >= pinned + 40, timeout=120)
    client.post(f"/v1/jobs/{child['id']}/cancel", headers=auth)
    client.post(f"/v1/jobs/{parent}/cancel", headers=auth)
    wait_for(lambda: job(client, auth, parent)["status"] == "cancelled", timeout=60)
    listed = client.get(f"/v1/jobs/{parent}/checkpoints", headers=auth).json()["data"]
    best = min((c["metrics"]["val_loss"], c["step"]) for c in listed)[1]
    # keep_checkpoints 1: the latest and the best val_loss, and the one the child starts from.
    assert {c["step"] for c in listed} == {listed[0]["step"], best, pinned}
    assert (settings.artifact_dir / "jobs" / parent / "checkpoints" / f"step_{pinned:08d}.pt").is_file()


@pytest.mark.parametrize("first", ["intake", "retention"])
def test_a_warm_start_and_its_parents_retention_at_once_never_leave_it_without_its_checkpoint(
    client, settings, auth, first
):
    """The intake inserts a child starting from checkpoint 10 while the parent's retention
    (keep 1) would delete it. Whichever takes the parent's row first, the other waits for its
    commit: the retention then keeps step 10, or the intake refuses the child with a 422."""
    if settings.sqlalchemy_url.startswith("sqlite"):
        pytest.skip("row locks: Postgres")
    parent = with_checkpoints(client, settings, auth, tiny_spec(), steps=(10, 20))
    with transaction(settings) as session:
        tenant = authenticate(session, auth["Authorization"])
    with transaction(settings) as session:
        sub = prepare_submission(
            session,
            tenant,
            JobSpec.model_validate(tiny_spec() | {"init_from": {"job_id": parent, "step": 10}}),
            None,
            settings,
        )
    sink = JobSink(settings, parent, 1, 20, {}, keep_checkpoints=1)
    holds, results = threading.Event(), {}

    def intake() -> None:
        with transaction(settings) as session:
            results["intake"] = insert_submissions(session, [sub])[0]
            holds.set()
            time.sleep(1.0 if first == "intake" else 0.0)

    def retention() -> None:
        with transaction(settings) as session:
            sink._prune(session)
            holds.set()
            time.sleep(1.0 if first == "retention" else 0.0)

    order = [intake, retention] if first == "intake" else [retention, intake]
    threads = [threading.Thread(target=f) for f in order]
    threads[0].start()
    assert holds.wait(30)
    threads[1].start()  # waits for the first one's commit
    for t in threads:
        t.join(60)
    with transaction(settings) as session:
        kept = {c.step for c in CheckpointRepository(session).checkpoints(parent)}
    if first == "intake":
        assert isinstance(results["intake"], tuple) and kept == {10, 20}
    else:
        assert isinstance(results["intake"], ValidationFailed) and results["intake"].param == "init_from.step"
        assert kept == {20}
