"""Sweeps on real Postgres and Redis with real worker processes: trials run as ordinary jobs,
ASHA pauses, promotes and stops the expected trials at a rung (both forms) with every decision
taken once by the database (also with two API processes and two workers), the best trial,
cancel, the tenant's job cap, the sweep.completed webhook, and the 422s of bad search spaces."""

from __future__ import annotations

import json
import secrets
import time
from collections import defaultdict

import httpx
import pytest
import yaml
from sqlalchemy import select

from app.db.models import Job, SweepRung
from app.db.session import transaction
from app.repositories.tenants import TenantRepository
from app.services import search
from contract.status import ACTIVE
from tests.support.api import key_of, new_key
from tests.support.cli import muonforge
from tests.support.http_stub import Reply, StubServer, scripted
from tests.support.net import wait_for
from tests.support.services import running_api
from tests.support.specs import tiny_spec

OK = Reply(200, b"")
BAD_FIRST = [1e-2, 1e-7, 2e-7, 3e-7, 4e-7, 1e-3]  # adamw lrs: 1e-2 and 1e-3 learn in 10 steps, 1e-7 does not


def base(steps: int = 20) -> dict:
    spec = tiny_spec(steps=steps)
    spec.pop("name")
    spec["optimizer"] = {"name": "adamw"}
    spec["telemetry"] = {"sample_tokens": 0}
    return spec


def sweep_body(**fields) -> dict:
    """The stop form unless ``asha`` says otherwise."""
    return {
        "name": "lr",
        "base": base(),
        "space": {"optimizer.lr": {"values": BAD_FIRST}},
        "method": "grid",
        "max_concurrent": 1,
        "asha": {"rungs": [10], "reduction_factor": 3, "stop_once": True},
        **fields,
    }


def get(client, auth, sweep_id: str) -> dict:
    r = client.get(f"/v1/sweeps/{sweep_id}", headers=auth)
    assert r.status_code == 200, r.text
    return r.json()


def rung_rows(settings, sweep_id: str) -> list[SweepRung]:
    with transaction(settings) as session:
        query = select(SweepRung).where(SweepRung.sweep_id == sweep_id).order_by(SweepRung.rung, SweepRung.position)
        return list(session.scalars(query))


def check_decisions(settings, sweep: dict) -> dict[str, list[SweepRung]]:
    """Exactly one decision per (trial, rung), positions 1..n at each rung, and every decision
    the rule's replay over the recorded order (the sweep's form); a trial that did not go on at
    a rung (and, in the promote form, was not promoted there) reached no later one and ended
    stopped_early; a promoted one was held back first; in the promote form every rung promoted
    at least its top floor(n / eta). Returns the decisions by rung."""
    rows = rung_rows(settings, sweep["id"])
    assert len({(r.job_id, r.rung) for r in rows}) == len(rows)
    by_rung: dict[int, list[SweepRung]] = defaultdict(list)
    for r in rows:
        by_rung[r.rung].append(r)
    asha = sweep["spec"]["asha"]
    eta, stop_once = asha["reduction_factor"], asha.get("stop_once", False)
    for rung, at in by_rung.items():
        assert [r.position for r in at] == list(range(1, len(at) + 1)), rung
        assert [r.go_on for r in at] == search.replay([r.value for r in at], eta, sweep["mode"], stop_once), rung
        went_on = [r for r in at if r.go_on or r.promoted_at is not None]
        if stop_once:
            assert not any(r.promoted_at for r in at)
        else:
            assert all(r.promoted_at is None or not r.go_on for r in at)
            ranked = sorted(at, key=lambda r: (search.rank_key(r.value, sweep["mode"]), r.position))
            assert set(ranked[: max(1, len(at) // eta)]) <= set(went_on), rung
    status = {t["job_id"]: t["status"] for t in sweep["trials"]}
    for r in rows:
        later = [x for x in rows if x.job_id == r.job_id and x.rung > r.rung]
        if not r.go_on and r.promoted_at is None:
            assert status[r.job_id] == "stopped_early" and not later
    stopped = {r.job_id for r in rows if not r.go_on and r.promoted_at is None}
    assert {j for j, s in status.items() if s == "stopped_early"} == stopped
    return by_rung


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"space": {"optimizer.lrr": {"values": [0.1]}}}, "space.optimizer.lrr"),
        ({"space": {"optimizer.lr": {"values": [0.1, -1.0]}}}, "space.optimizer.lr"),
        (
            {"space": {"optimizer.lr": {"log_uniform": [0.0, 0.1]}}, "method": "random", "max_trials": 2},
            "space.optimizer.lr",
        ),
        ({"space": {"optimizer.lr": {"log_uniform": [1e-3, 0.1]}}}, "space.optimizer.lr"),  # grid: values only
        ({"space": {"name.x": {"values": [1]}}}, "space.name.x"),
        ({"space": {"model.d_model": {"values": [16, 17]}}}, "space.model.d_model"),  # 17 % n_head
        ({"space": {"optimizer.lr": {"values": [0.1], "uniform": [0, 1]}}}, "space.optimizer.lr"),
        ({"space": {}}, "space"),
        ({"method": "random"}, None),  # random without max_trials
        ({"base": {**base(), "train": {"steps": 0}}}, "base.train.steps"),
        ({"asha": {"rungs": [10, 5]}}, "asha.rungs"),
        ({"asha": {"rungs": [20]}}, "asha.rungs"),  # not before the last step
        ({"base": {**base(), "resources": {"nproc": 2}}, "asha": {"rungs": [5]}}, "asha"),  # one process per trial
        ({"base": {**base(), "data": {"dataset_id": "ds_nope"}}}, "base.data.dataset_id"),
    ],
)
def test_a_bad_search_space_is_a_422_naming_the_field_and_nothing_is_stored(client, auth, change, param):
    r = client.post("/v1/sweeps", json=sweep_body(**change), headers=auth)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    if param is not None:
        assert error["param"] == param or error["param"].startswith(param), error
    assert client.get("/v1/sweeps", headers=auth).json()["data"] == []
    assert client.get("/v1/jobs", headers=auth).json()["data"] == []


def test_a_repeated_idempotency_key_answers_with_the_sweep_it_created(client, auth, settings):
    """The same key and body: 200 with the same sweep and no second trial job; the same key with
    another body: 409 naming the header; another tenant's same key is its own."""
    keyed = {**auth, "Idempotency-Key": "sweep-once"}
    first = client.post("/v1/sweeps", json=sweep_body(), headers=keyed)
    assert first.status_code == 201, first.text
    again = client.post("/v1/sweeps", json=sweep_body(), headers=keyed)
    assert again.status_code == 200 and again.json()["id"] == first.json()["id"], again.text
    assert [t["job_id"] for t in again.json()["trials"]] == [t["job_id"] for t in first.json()["trials"]]
    other = client.post("/v1/sweeps", json=sweep_body(name="other"), headers=keyed)
    assert other.status_code == 409 and other.json()["error"]["param"] == "Idempotency-Key", other.text
    assert [s["id"] for s in client.get("/v1/sweeps", headers=auth).json()["data"]] == [first.json()["id"]]
    assert len(client.get("/v1/jobs", headers=auth).json()["data"]) == 1  # max_concurrent 1: one trial started
    theirs = {"Authorization": f"Bearer {new_key(settings)}", "Idempotency-Key": "sweep-once"}
    mine_too = client.post("/v1/sweeps", json=sweep_body(), headers=theirs)
    assert mine_too.status_code == 201 and mine_too.json()["id"] != first.json()["id"]
    for _ in range(2):  # an empty key is no key: refused, never stored (twice was a 500)
        empty = client.post("/v1/sweeps", json=sweep_body(), headers={**auth, "Idempotency-Key": ""})
        assert empty.status_code == 422 and empty.json()["error"]["param"] == "Idempotency-Key", empty.text
    for sweep_id, headers in ((first.json()["id"], auth), (mine_too.json()["id"], theirs)):
        assert client.post(f"/v1/sweeps/{sweep_id}/cancel", headers=headers).status_code == 200


def test_asha_stops_the_trials_behind_at_the_first_rung_and_the_sweep_completes_once(client, auth, settings, worker):
    with StubServer(scripted(OK)) as receiver:
        hook = client.post("/v1/webhooks", json={"url": receiver.url, "events": ["sweep.completed"]}, headers=auth)
        assert hook.status_code == 201, hook.text
        r = client.post("/v1/sweeps", json=sweep_body(), headers=auth)
        assert r.status_code == 201, r.text
        sweep = r.json()
        assert sweep["status"] == "running" and [t["params"]["optimizer.lr"] for t in sweep["trials"]] == BAD_FIRST
        assert [t["status"] for t in sweep["trials"]] == ["queued"] + ["pending"] * 5  # max_concurrent 1
        assert sweep["trials"][3]["job_id"] is None
        done = wait_for(lambda: (s := get(client, auth, sweep["id"]))["status"] == "completed" and s, timeout=240)
        wait_for(lambda: len(receiver.requests) == 1, timeout=30)
        time.sleep(2)  # several reaper passes: still once
        assert len(receiver.requests) == 1
    statuses = [t["status"] for t in done["trials"]]
    # The order of arrival is the trials' order (one at a time): 1e-2 leads; each 1e-7 run is behind
    # it (top 1 of n < 6); the sixth (1e-3) is second of six, within the top 2.
    assert statuses == ["succeeded", "stopped_early", "stopped_early", "stopped_early", "stopped_early", "succeeded"]
    by_rung = check_decisions(settings, done)
    assert [r.go_on for r in by_rung[10]] == [True, False, False, False, False, True]
    assert [r.job_id for r in by_rung[10]] == [t["job_id"] for t in done["trials"]]
    for trial in done["trials"]:
        job = client.get(f"/v1/jobs/{trial['job_id']}", headers=auth).json()
        assert job["spec"]["optimizer"]["lr"] == trial["params"]["optimizer.lr"]
        if trial["status"] == "stopped_early":
            assert job["progress"]["step"] == 10 and job["summary"]["stopped_at"] == 10
            assert "rung 10" in job["summary"]["stop_reason"] and trial["rungs"][0]["continued"] is False
            checkpoints = client.get(f"/v1/jobs/{job['id']}/checkpoints", headers=auth).json()["data"]
            assert 10 in [c["step"] for c in checkpoints]
        else:
            assert job["progress"]["step"] == 20
    succeeded = [t for t in done["trials"] if t["status"] == "succeeded"]
    assert done["best"] == min(succeeded, key=lambda t: t["metric"])
    assert done["counts"] == {"total": 6, "by_status": {"succeeded": 2, "stopped_early": 4}}
    # stopped_early is a status like the others: in lists and their filter.
    listed = client.get("/v1/jobs", params={"status": "stopped_early"}, headers=auth).json()["data"]
    stopped = sorted(t["job_id"] for t in done["trials"] if t["status"] == "stopped_early")
    assert sorted(j["id"] for j in listed) == stopped
    sweeps = client.get("/v1/sweeps", params={"status": "completed"}, headers=auth).json()
    assert [s["id"] for s in sweeps["data"]] == [done["id"]] and sweeps["data"][0]["best"] == done["best"]
    delivered = client.get(f"/v1/webhooks/{hook.json()['id']}/deliveries", headers=auth).json()["data"]
    assert len(delivered) == 1 and delivered[0]["event_type"] == "sweep.completed"
    assert delivered[0]["payload"]["data"]["id"] == done["id"]
    assert delivered[0]["payload"]["data"]["status"] == "completed"


def test_the_promote_form_holds_trials_at_the_rung_and_promotes_the_best_once_eta_results_are_in(
    client, auth, settings, worker
):
    body = sweep_body(asha={"rungs": [10], "reduction_factor": 3})  # stop_once false: the default
    r = client.post("/v1/sweeps", json=body, headers=auth)
    assert r.status_code == 201, r.text
    sweep = r.json()
    assert sweep["spec"]["asha"]["stop_once"] is False
    first = sweep["trials"][0]["job_id"]
    # 1e-2 reaches the rung first: one result of three needed, it waits there, off the job cap.
    paused = wait_for(lambda: (j := client.get(f"/v1/jobs/{first}", headers=auth).json())["status"] == "paused" and j)
    assert paused["progress"]["step"] == 10 and "waits at rung 10" in paused["summary"]["stop_reason"]
    listed = client.get("/v1/jobs", params={"status": "paused"}, headers=auth).json()["data"]
    assert first in [j["id"] for j in listed]
    done = wait_for(lambda: (s := get(client, auth, sweep["id"]))["status"] == "completed" and s, timeout=240)
    # The third result makes the rung's top 1 promotable: 1e-2 resumes from its checkpoint at the
    # rung and runs to the end; the 1e-7 runs never go on; 1e-3, second of six, goes on at once.
    statuses = [t["status"] for t in done["trials"]]
    assert statuses == ["succeeded", "stopped_early", "stopped_early", "stopped_early", "stopped_early", "succeeded"]
    by_rung = check_decisions(settings, done)
    rows = by_rung[10]
    assert [r.go_on for r in rows] == [False, False, False, False, False, True]
    assert [r.promoted_at is not None for r in rows] == [True, False, False, False, False, False]
    assert rows[0].promoted_at > rows[2].created_at  # promoted once the third result was in
    promoted = {"rung": 10, "value": rows[0].value, "position": 1, "continued": True, "promoted": True}
    assert done["trials"][0]["rungs"] == [promoted]
    job = client.get(f"/v1/jobs/{first}", headers=auth).json()
    assert job["progress"]["step"] == 20 and job["attempt"] == 2 and "stop_reason" not in job["summary"]
    events = client.get(f"/v1/jobs/{first}/events", headers=auth).text
    order = [
        json.loads(line[5:])["status"]
        for line in events.splitlines()
        if line.startswith("data:") and '"status"' in line and '"spec"' in line
    ]
    assert order == ["queued", "running", "paused", "queued", "running", "succeeded"]
    assert any("resumed from" in line and "step_00000010" in line for line in events.splitlines())
    for trial in done["trials"][1:5]:  # never promoted: stopped where they waited, when the sweep ran out of trials
        stopped = client.get(f"/v1/jobs/{trial['job_id']}", headers=auth).json()
        assert stopped["progress"]["step"] == 10 and stopped["summary"]["stopped_at"] == 10
        assert "did not promote it past rung 10" in stopped["summary"]["stop_reason"]
    assert done["counts"] == {"total": 6, "by_status": {"succeeded": 2, "stopped_early": 4}}


def test_a_paused_trial_is_cancelled_at_once(client, auth, worker):
    body = sweep_body(asha={"rungs": [10], "reduction_factor": 3}, max_concurrent=1)
    sweep = client.post("/v1/sweeps", json=body, headers=auth).json()
    first = sweep["trials"][0]["job_id"]
    wait_for(lambda: client.get(f"/v1/jobs/{first}", headers=auth).json()["status"] == "paused")
    r = client.post(f"/v1/jobs/{first}/cancel", headers=auth)
    assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text
    cancelled = client.post(f"/v1/sweeps/{sweep['id']}/cancel", headers=auth).json()
    assert cancelled["trials"][0]["status"] == "cancelled"
    assert all(t["status"] in ("cancelled", "cancelling", "pending", "stopped_early") for t in cancelled["trials"])


def test_two_apis_and_two_workers_decide_each_rung_once_under_the_tenants_job_cap(settings, start_worker, tmp_path):
    """The promote form: waiting trials are promoted by whichever process advances the sweep,
    once, and a promotion counts against the tenant's job cap like a new job."""
    tenant = f"tenant-{secrets.token_hex(4)}"
    headers = {"Authorization": f"Bearer {new_key(settings, tenant)}"}
    with transaction(settings) as session:
        repo = TenantRepository(session)
        tenant_id = repo.by_name(tenant).id
        repo.set_job_cap(tenant_id, 2)
    body = sweep_body(
        base=base(steps=16),
        space={"optimizer.lr": {"log_uniform": [1e-7, 3e-2]}},
        method="random",
        seed=3,
        max_trials=8,
        max_concurrent=3,
        asha={"rungs": [4, 8], "reduction_factor": 2},  # the promote form
    )
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    with running_api(settings, tmp_path / "a") as one, running_api(settings, tmp_path / "b") as two:
        for _ in range(2):
            start_worker()
        r = httpx.post(f"{one}/v1/sweeps", json=body, headers=headers, timeout=30)
        assert r.status_code == 201, r.text
        sweep_id = r.json()["id"]
        most = 0
        deadline = time.monotonic() + 300
        url = f"{two}/v1/sweeps/{sweep_id}"
        while (s := httpx.get(url, headers=headers, timeout=30).json())["status"] == "running":
            with transaction(settings) as session:
                active = session.scalars(select(Job.status).where(Job.sweep_id == sweep_id, Job.status.in_(ACTIVE)))
                most = max(most, len(list(active)))
            assert time.monotonic() < deadline, s
            time.sleep(0.1)
    assert 1 <= most <= 2  # the tenant's cap (2), under max_concurrent (3)
    assert s["counts"]["total"] == 8 and set(s["counts"]["by_status"]) <= {"succeeded", "stopped_early"}
    by_rung = check_decisions(settings, s)
    assert len(by_rung[4]) == 8  # every trial reached the first rung
    assert len(by_rung[8]) == sum(r.go_on or r.promoted_at is not None for r in by_rung[4])


def test_cancel_stops_the_queued_trials_and_starts_no_more(client, auth):
    sweep = client.post("/v1/sweeps", json=sweep_body(max_concurrent=2), headers=auth).json()
    queued = [t["job_id"] for t in sweep["trials"] if t["status"] == "queued"]
    assert len(queued) == 2
    r = client.post(f"/v1/sweeps/{sweep['id']}/cancel", headers=auth)
    assert r.status_code == 200, r.text
    cancelled = r.json()
    assert cancelled["status"] == "cancelled" and cancelled["finished_at"]
    assert [t["status"] for t in cancelled["trials"]] == ["cancelled"] * 2 + ["pending"] * 4
    time.sleep(2)  # several reaper passes
    after = get(client, auth, sweep["id"])
    assert after["trials"] == cancelled["trials"] and after["status"] == "cancelled"
    assert sorted(j["id"] for j in client.get("/v1/jobs", headers=auth).json()["data"]) == sorted(queued)
    assert client.post(f"/v1/sweeps/{sweep['id']}/cancel", headers=auth).json()["status"] == "cancelled"


def test_sweeps_are_listed_newest_first_in_pages_and_are_the_tenants_own(client, auth, settings):
    ids = [client.post("/v1/sweeps", json=sweep_body(max_concurrent=1), headers=auth).json()["id"] for _ in range(3)]
    for sweep_id in ids:
        client.post(f"/v1/sweeps/{sweep_id}/cancel", headers=auth)
    first = client.get("/v1/sweeps", params={"limit": 2}, headers=auth).json()
    assert [s["id"] for s in first["data"]] == ids[::-1][:2] and first["has_more"]
    rest = client.get("/v1/sweeps", params={"limit": 2, "after": first["next_after"]}, headers=auth).json()
    assert [s["id"] for s in rest["data"]] == ids[:1] and not rest["has_more"]
    other = {"Authorization": f"Bearer {new_key(settings)}"}
    assert client.get(f"/v1/sweeps/{ids[0]}", headers=other).status_code == 404
    assert client.post(f"/v1/sweeps/{ids[0]}/cancel", headers=other).status_code == 404
    assert client.get("/v1/sweeps", headers=other).json()["data"] == []


def test_the_cli_submits_a_sweep_file_follows_it_and_lists_and_shows_sweeps(api_url, auth, worker, tmp_path):
    key = key_of(auth)
    body = sweep_body(space={"optimizer.lr": {"values": [1e-2, 1e-7, 1e-3]}}, name="cli-sweep")
    spec = tmp_path / "sweep.yaml"
    spec.write_text(yaml.safe_dump(body))
    followed = muonforge("sweep", spec, "--follow", "--interval", "0.5", url=api_url, key=key)
    assert followed.returncode == 0, followed.stderr
    sweep_id = followed.stdout.splitlines()[0]
    assert sweep_id.startswith("swp_")
    shown = json.loads(muonforge("sweeps", "show", sweep_id, "--json", url=api_url, key=key).stdout)
    assert shown["status"] == "completed"
    assert [t["status"] for t in shown["trials"]] == ["succeeded", "stopped_early", "stopped_early"]  # 1e-3: 2nd of 3
    table = muonforge("sweeps", "show", sweep_id, url=api_url, key=key).stdout
    assert "optimizer.lr" in table and "stopped_early" in table and f"best #{shown['best']['number']}" in table
    assert "10:x" in table  # the rung's decision
    assert "completed" in followed.stdout and "stopped_early" in followed.stdout  # the live table's last frame
    listed = muonforge("sweeps", "list", "--status", "completed", url=api_url, key=key).stdout
    assert sweep_id in listed and "3/3" in listed
    as_json = json.loads(muonforge("sweeps", "list", "--json", url=api_url, key=key).stdout)
    assert [s["id"] for s in as_json] == [sweep_id]
    bad = muonforge("sweep", tmp_path / "missing.yaml", url=api_url, key=key)
    assert bad.returncode == 2
