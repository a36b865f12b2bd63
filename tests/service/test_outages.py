"""Infrastructure faults during a running job are survived, not turned into failures: a
Postgres outage (every connection dropped, new ones refused) longer than the job's lease, with
the API and the worker both behind it."""

from __future__ import annotations

import time
from urllib.parse import urlsplit, urlunsplit

import httpx

from app.db.session import transaction
from app.repositories.jobs import JobRepository
from tests.service.conftest import Worker, new_key, running_api, tiny_spec, wait_for
from tests.service.faults import TcpProxy

STEPS = 300


def job_row(settings, job_id: str):
    with transaction(settings) as session:
        return JobRepository(session).fresh(job_id)


def run_through(settings, tmp_path, fault) -> None:
    """A 300-step job with the API and the worker behind a proxy to Postgres; ``fault(proxy)``
    once the job is past step 60; the job must succeed with every step's loss stored once."""
    parts = urlsplit(settings.database_url)
    proxy = TcpProxy((parts.hostname or "127.0.0.1", parts.port or 5432))
    netloc = f"{parts.username or 'postgres'}@127.0.0.1:{proxy.port}"
    behind = settings.model_copy(update={"database_url": urlunsplit(parts._replace(netloc=netloc))})
    headers = {"Authorization": f"Bearer {new_key(settings)}"}
    spec = tiny_spec(STEPS, eval_every=50, checkpoint_every=50)
    worker = None
    try:
        with running_api(behind, tmp_path) as api:
            worker = Worker(behind, tmp_path / "worker.log")
            job_id = httpx.post(f"{api}/v1/jobs", json=spec, headers=headers).json()["id"]
            wait_for(lambda: job_row(settings, job_id).progress_step >= 60, timeout=120)
            fault(proxy)
            job = wait_for(
                lambda: (j := job_row(settings, job_id)).status in ("succeeded", "failed") and j, timeout=240
            )
            assert job.status == "succeeded", (job.error, (tmp_path / "worker.log").read_text()[-3000:])
            history = httpx.get(
                f"{api}/v1/jobs/{job_id}/metrics", params={"names": "loss", "max_points": 1000}, headers=headers
            ).json()
            (loss,) = [series for series in history["series"] if series["name"] == "loss"]
            steps = [point[0] for point in loss["points"]]
            missing, twice = sorted(set(range(STEPS)) - set(steps)), len(steps) - len(set(steps))
            assert (missing, twice) == ([], 0), (missing, twice)  # each step once
    finally:
        if worker is not None:
            worker.stop()
        proxy.close()


def test_a_postgres_restart_during_a_job_does_not_fail_it(settings, tmp_path):
    def restart(proxy: TcpProxy) -> None:  # every connection dropped, the server back at once
        for _ in range(2):
            proxy.cut()
            proxy.restore()
            time.sleep(1.5)

    run_through(settings, tmp_path, restart)


def test_a_postgres_outage_longer_than_the_lease_neither_fails_nor_loses_the_job(settings, tmp_path):
    def outage(proxy: TcpProxy) -> None:  # longer than the lease: the reaper may requeue the job
        proxy.cut()
        time.sleep(3 * settings.lease_seconds)
        proxy.restore()

    run_through(settings, tmp_path, outage)
