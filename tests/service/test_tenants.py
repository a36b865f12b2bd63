"""`muonforge tenants list` and `tenants set-cap` as processes on the test database, and what the
API then answers: a lowered cap, a suspension, the server's default again."""

from __future__ import annotations

import re
import secrets
import subprocess
import sys
from pathlib import Path
from tempfile import TemporaryDirectory

import pytest
from fastapi.testclient import TestClient

from app.db.models import Tenant
from app.db.session import transaction
from app.main import create_app
from app.services.auth import revoke_api_key
from app.services.tenants import set_job_cap
from tests.service.test_models import files_in, tar_of, tiny_llama, upload
from tests.support.api import new_key
from tests.support.cli import service_command
from tests.support.net import wait_for
from tests.support.services import ROOT, service_env, unavailable
from tests.support.specs import tiny_spec

pytestmark = pytest.mark.system  # its tests start processes: the service's, torchrun's or a command's

HINT = "; `muonforge tenants list` shows the tenants"
COLUMNS = ["name", "id", "job cap", "queued+running", "stored bytes", "active keys"]


def tenants(settings, *args: str) -> subprocess.CompletedProcess:
    """``muonforge tenants ARGS`` as a process, on the test database."""
    return service_command(settings, "tenants", *args)


def set_cap(settings, tenant: str, cap: str) -> list[str]:
    out = tenants(settings, "set-cap", tenant, cap)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def listed(settings) -> dict[str, dict[str, str]]:
    """`muonforge tenants list`: its rows by name, each {column: value}."""
    out = tenants(settings, "list")
    assert out.returncode == 0, out.stderr
    header, *rows = out.stdout.splitlines()
    assert re.split(r"\s{2,}", header.strip()) == COLUMNS
    table = {}
    for row in rows:
        cells = re.split(r"\s{2,}", row.strip())  # columns are 2 spaces apart at least; "default (8)" has 1
        assert len(cells) == len(COLUMNS), row
        table[cells[0]] = dict(zip(COLUMNS, cells, strict=True))
    return table


def tenant_of(settings, name: str) -> Tenant:
    with transaction(settings) as session:
        return session.query(Tenant).filter_by(name=name).one()


@pytest.fixture(scope="module")
def uncached(settings):
    """An API whose key cache is off: every request reads the tenant's cap as it is now."""
    with TestClient(create_app(settings.model_copy(update={"auth_cache_seconds": 0}))) as c:
        yield c


def submit(client: TestClient, key: str):
    return client.post("/v1/jobs", json=tiny_spec(), headers={"Authorization": f"Bearer {key}"})


def test_a_cap_of_2_admits_two_jobs_then_0_suspends_and_default_restores(settings, uncached):
    name = f"capped-{secrets.token_hex(4)}"
    key = new_key(settings, name)
    tenant_id = tenant_of(settings, name).id

    assert set_cap(settings, name, "2") == [
        f"tenant '{name}' ({tenant_id}): job cap 2, was default (100, MUONFORGE_TENANT_JOB_CAP)",
        "API processes apply it within 10 s (MUONFORGE_AUTH_CACHE_SECONDS)",
    ]
    assert tenant_of(settings, name).job_cap == 2
    assert [submit(uncached, key).status_code for _ in range(2)] == [201, 201]
    third = submit(uncached, key)
    assert third.status_code == 429 and third.json()["error"]["code"] == "rate_limited"
    assert "already has 2 queued or running jobs" in third.json()["error"]["message"]

    assert set_cap(settings, name, "0") == [
        f"tenant '{name}' ({tenant_id}): suspended (job cap 0), was 2",
        "its submissions answer 403 tenant_suspended; its 2 queued or running jobs go on",
        "API processes apply it within 10 s (MUONFORGE_AUTH_CACHE_SECONDS)",
    ]
    suspended = submit(uncached, key)
    assert suspended.status_code == 403 and suspended.json()["error"]["code"] == "tenant_suspended"
    assert uncached.get("/v1/jobs", headers={"Authorization": f"Bearer {key}"}).status_code == 200, "reads go on"

    assert set_cap(settings, name, "1")[1] == (
        "its 2 queued or running jobs go on; its submissions answer 429 until it has fewer than 1"
    )
    assert set_cap(settings, name, "default")[0] == (
        f"tenant '{name}' ({tenant_id}): job cap default (100, MUONFORGE_TENANT_JOB_CAP), was 1"
    )
    assert tenant_of(settings, name).job_cap is None
    assert submit(uncached, key).status_code == 201, "the server's cap of 100 again"
    assert set_cap(settings, name, "DEFAULT")[0].endswith(", unchanged")


def test_a_cached_tenant_takes_the_new_cap_within_the_cache_time(settings):
    name = f"cached-{secrets.token_hex(4)}"
    key = new_key(settings, name)
    with TestClient(create_app(settings.model_copy(update={"auth_cache_seconds": 1}))) as client:
        assert submit(client, key).status_code == 201  # the key's tenant, cap included, now cached
        with transaction(settings) as session:
            set_job_cap(session, name, 0)
        answer = wait_for(lambda: (r := submit(client, key)).status_code == 403 and r, timeout=5)
        assert answer.json()["error"]["code"] == "tenant_suspended"


def test_tenants_list_shows_caps_jobs_bytes_and_keys(settings, uncached):
    name = f"listed-{secrets.token_hex(4)}"
    key, other_key = new_key(settings, name), new_key(settings, name)
    headers = {"Authorization": f"Bearer {key}"}
    for body in (b"a" * 1000, b"b" * 2345):
        assert uncached.post("/v1/datasets", files={"file": ("c.txt", body)}, headers=headers).status_code == 201
    with TemporaryDirectory() as directory:  # a model's bytes count with the datasets'
        tiny_llama(Path(directory))
        model = upload(uncached, headers, tar_of(files_in(Path(directory))))
    assert model.status_code == 201, model.text
    stored = 3345 + model.json()["bytes"]
    jobs = [submit(uncached, key).json()["id"] for _ in range(3)]
    assert uncached.post(f"/v1/jobs/{jobs[0]}/cancel", headers=headers).json()["status"] == "cancelled"
    with transaction(settings) as session:
        revoke_api_key(session, other_key)
    idle, suspended = f"{name}-idle", f"{name}-suspended"
    new_key(settings, idle)
    new_key(settings, suspended)
    set_cap(settings, suspended, "0")
    set_cap(settings, name, "7")

    rows = listed(settings)
    assert rows[name] == {
        "name": name,
        "id": tenant_of(settings, name).id,
        "job cap": "7",
        "queued+running": "2",
        "stored bytes": f"{stored:,}",
        "active keys": "1",
    }
    assert rows[idle] == {
        "name": idle,
        "id": tenant_of(settings, idle).id,
        "job cap": "default (100)",
        "queued+running": "0",
        "stored bytes": "0",
        "active keys": "1",
    }
    assert rows[suspended]["job cap"] == "suspended"
    assert list(rows) == sorted(rows), "by name"


def console_script(settings, *args: str) -> subprocess.CompletedProcess:
    """The installed ``muonforge`` console script, running this checkout's code."""
    script = Path(sys.executable).with_name("muonforge")
    if not script.exists():
        unavailable(f"needs the muonforge console script beside {sys.executable} (pip install -e .)")
    return subprocess.run(
        [str(script), *args],
        env=service_env(settings) | {"PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (("nobody-at-all", "3"), f"error: no tenant 'nobody-at-all'{HINT}"),
        (("{tenant}", "-1"), "error: the job cap is a whole number >= 0 or 'default', not -1"),
        (("{tenant}", "lots"), "error: the job cap is a whole number >= 0 or 'default', not 'lots'"),
        (("{tenant}", "2.5"), "error: the job cap is a whole number >= 0 or 'default', not '2.5'"),
    ],
)
def test_an_unknown_tenant_or_a_bad_cap_is_one_line_and_status_2(settings, args, line):
    name = f"unchanged-{secrets.token_hex(4)}"
    new_key(settings, name)
    out = console_script(settings, "tenants", "set-cap", *(arg.format(tenant=name) for arg in args))
    assert (out.returncode, out.stdout, out.stderr) == (2, "", line + "\n")
    assert tenant_of(settings, name).job_cap is None
