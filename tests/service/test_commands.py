"""`muonforge migrate`, `keys create` and `up` (on the embedded default), as processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import psycopg
import pytest
from alembic import command

from app.db.migrate import alembic_config, downgrade, upgrade
from app.settings import Settings
from muonforge.client import Client
from tests.support.net import free_port
from tests.support.services import PG_ADMIN, ROOT, create_database, drop_database, service_env
from tests.support.specs import tiny_spec

pytestmark = pytest.mark.system  # its tests start processes: the service's, torchrun's or a command's


def tables(name: str) -> set[str]:
    url = PG_ADMIN.rsplit("/", 1)[0] + f"/{name}"
    with psycopg.connect(url) as conn:
        rows = conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'").fetchall()
    return {r[0] for r in rows}


def test_migrations_upgrade_and_downgrade_cleanly():
    name = create_database()
    try:
        base = PG_ADMIN.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://")
        s = Settings(database_url=f"{base}/{name}")
        upgrade(s, "0001")
        with psycopg.connect(f"{PG_ADMIN.rsplit('/', 1)[0]}/{name}", autocommit=True) as conn:  # events of 0001
            conn.execute("INSERT INTO tenants (id, name, created_at) VALUES ('ten_1', 't', now())")
            for job in ("job_a", "job_b"):
                conn.execute(
                    "INSERT INTO jobs (id, tenant_id, status, spec, queue, attempt, max_restarts, cancel_requested,"
                    " progress_step, total_steps, summary, created_at) VALUES (%s, 'ten_1', 'queued', '{}', 'cpu',"
                    " 0, 3, false, 0, 10, '{}', now())",
                    (job,),
                )
            for job in ("job_a", "job_b", "job_a", "job_a"):
                conn.execute(
                    "INSERT INTO job_events (job_id, kind, payload, created_at) VALUES (%s, 'log', '{}', now())", (job,)
                )
        upgrade(s)
        with psycopg.connect(f"{PG_ADMIN.rsplit('/', 1)[0]}/{name}") as conn:
            seqs = conn.execute("SELECT job_id, seq FROM job_events ORDER BY id").fetchall()
            counters = dict(conn.execute("SELECT id, event_seq FROM jobs").fetchall())
        assert seqs == [("job_a", 1), ("job_b", 1), ("job_a", 2), ("job_a", 3)]
        assert counters == {"job_a": 3, "job_b": 1}
        expected = {
            "tenants",
            "api_keys",
            "datasets",
            "jobs",
            "job_events",
            "checkpoints",
            "metric_series",
            "metric_chunks",
            "webhook_endpoints",
            "webhook_deliveries",
            "webhook_attempts",
            "sweeps",
            "sweep_trials",
            "sweep_rungs",
            "job_nodes",
            "models",
            "uploads",
            "upload_parts",
            "alembic_version",
        }
        assert tables(name) == expected
        command.check(alembic_config(s.sqlalchemy_url))  # the models and the migrations agree
        downgrade(s)
        assert tables(name) == {"alembic_version"}
        upgrade(s)
        assert tables(name) == expected
    finally:
        drop_database(name)


def test_keys_create_prints_a_working_key_alone_on_the_last_line(settings, client):
    out = subprocess.run(
        [sys.executable, "-m", "muonforge.cli", "keys", "create", "--tenant", "cli-tenant"],
        env=service_env(settings),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        cwd=ROOT,
    )
    key = out.stdout.strip().splitlines()[-1]
    assert key.startswith("mf_") and " " not in key
    assert client.get("/v1/jobs", headers={"Authorization": f"Bearer {key}"}).status_code == 200


@pytest.mark.slow
def test_up_with_nothing_configured_runs_a_job_end_to_end(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MUONFORGE_")}
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "muonforge.cli", "up", "--port", str(port)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        url = key = None
        deadline = time.monotonic() + 120
        lines = []
        while key is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("URL: "):
                url = line.split(" ", 1)[1].strip()
            if line.startswith("API key: "):
                key = line.split()[2]
        assert url == f"http://127.0.0.1:{port}" and key, "".join(lines)
        headers = {"Authorization": f"Bearer {key}"}
        job = httpx.post(f"{url}/v1/jobs", json=tiny_spec(steps=20), headers=headers).json()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            current = httpx.get(f"{url}/v1/jobs/{job['id']}", headers=headers).json()
            if current["status"] in ("succeeded", "failed"):
                break
            time.sleep(0.3)
        assert current["status"] == "succeeded", current
        assert current["progress"]["step"] == 20 and "loss" in current["summary"]
        assert (tmp_path / "var" / "muonforge.db").exists()  # the embedded default, under ./var
        with Client(url, key) as client:  # telemetry in the embedded mode: stored in SQLite, streamed by polling
            events = list(client.events(job["id"]))
            assert [e.data["step"] for e in events if e.event == "metrics"] == list(range(21))
            assert [e.data["status"] for e in events if e.event == "status"] == ["queued", "running", "succeeded"]
            assert events[-1].event == "done"
            assert len(client.metrics(job["id"], names=["loss"])["loss"]) == 20

        # The client command against the same server: upload a corpus, submit, follow to the end.
        spec_path, corpus = tmp_path / "spec.yaml", tmp_path / "corpus.txt"
        spec_path.write_text(json.dumps(tiny_spec(steps=15) | {"data": {"tokenizer": "char"}}))
        corpus.write_text("to be or not to be, that is the question. " * 100)
        submit = subprocess.run(
            [sys.executable, "-m", "muonforge.cli", "submit", str(spec_path), "--data", str(corpus), "--follow"],
            env={**env, "MUONFORGE_API_URL": url, "MUONFORGE_API_KEY": key},
            capture_output=True,
            text=True,
            timeout=180,
            cwd=tmp_path,
        )
        assert submit.returncode == 0, submit.stderr
        final = json.loads(submit.stdout.strip().splitlines()[-1])
        assert final["status"] == "succeeded" and final["progress"] == {"step": 15, "total_steps": 15}
        bad = subprocess.run(
            [sys.executable, "-m", "muonforge.cli", "submit", str(spec_path)],
            env={**env, "MUONFORGE_API_URL": url, "MUONFORGE_API_KEY": key},
            capture_output=True,
            text=True,
            timeout=60,
            cwd=tmp_path,
        )
        assert bad.returncode == 2 and "data" in bad.stderr
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_sqlite_migrations_keep_every_row(tmp_path):
    """SQLite alters a table by copying it: the old table's drop must not cascade to the rows
    that reference it (a job's events and checkpoints), as it would with foreign keys on."""
    import sqlite3

    s = Settings(database_url=f"sqlite:///{tmp_path / 'muonforge.db'}")
    upgrade(s, "0001")
    with sqlite3.connect(tmp_path / "muonforge.db") as conn:
        conn.execute("INSERT INTO tenants (id, name, created_at) VALUES ('ten_1', 't', CURRENT_TIMESTAMP)")
        for job, status in (("job_a", "queued"), ("job_b", "succeeded")):
            conn.execute(
                "INSERT INTO jobs (id, tenant_id, status, spec, queue, attempt, max_restarts, cancel_requested,"
                " progress_step, total_steps, summary, created_at) VALUES (?, 'ten_1', ?, '{}', 'cpu',"
                " 0, 3, 0, 0, 10, '{}', CURRENT_TIMESTAMP)",
                (job, status),
            )
        for job in ("job_a", "job_b", "job_a"):
            conn.execute(
                "INSERT INTO job_events (job_id, kind, payload, created_at) VALUES (?, 'log', '{}', CURRENT_TIMESTAMP)",
                (job,),
            )
        conn.execute(
            "INSERT INTO checkpoints (id, job_id, step, path, bytes, attempt, created_at)"
            " VALUES ('ckpt_1', 'job_b', 10, 'x.pt', 1, 1, CURRENT_TIMESTAMP)"
        )
    upgrade(s)
    with sqlite3.connect(tmp_path / "muonforge.db") as conn:
        events = conn.execute("SELECT job_id, seq FROM job_events ORDER BY id").fetchall()
        checkpoints = conn.execute("SELECT id, job_id, step FROM checkpoints").fetchall()
        active = conn.execute("SELECT active_jobs FROM tenants").fetchall()
        assert conn.execute("PRAGMA foreign_key_check").fetchall() == []
    assert events == [("job_a", 1), ("job_b", 1), ("job_a", 2)]
    assert checkpoints == [("ckpt_1", "job_b", 10)]
    assert active == [(1,)]
