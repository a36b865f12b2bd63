"""The tenant job cap holds exactly under parallel submissions, with one API process and with
two; a tenant whose cap is 0 is suspended."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from sqlalchemy import update

from app.db.models import Tenant
from app.db.session import transaction
from app.services.auth import authenticate
from tests.support.api import new_key
from tests.support.services import running_api
from tests.support.specs import tiny_spec

pytestmark = pytest.mark.system  # its tests start processes: the service's, torchrun's or a command's


def key_with_cap(settings, cap: int) -> str:
    key = new_key(settings)
    with transaction(settings) as session:
        tenant = authenticate(session, f"Bearer {key}")
        session.execute(update(Tenant).where(Tenant.id == tenant.id).values(job_cap=cap))
    return key


async def submit_at_once(url: str, key: str, n: int) -> list[httpx.Response]:
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as client:
        return await asyncio.gather(*(client.post("/v1/jobs", json=tiny_spec()) for _ in range(n)))


def check_exact_cap(url: str, settings) -> None:
    key = key_with_cap(settings, 8)
    answers = asyncio.run(submit_at_once(url, key, 40))
    codes = sorted(r.status_code for r in answers)
    assert codes.count(201) == 8 and codes.count(429) == 32, codes
    error = next(r for r in answers if r.status_code == 429).json()["error"]
    assert error["code"] == "rate_limited" and "8 queued or running" in error["message"]
    headers = {"Authorization": f"Bearer {key}"}
    jobs = httpx.get(f"{url}/v1/jobs", params={"limit": 100}, headers=headers).json()["data"]
    assert len(jobs) == 8
    for job in jobs:  # no worker runs them: leave nothing queued for other tests' workers
        assert httpx.post(f"{url}/v1/jobs/{job['id']}/cancel", headers=headers).status_code == 200


def test_40_parallel_submissions_at_cap_8_admit_exactly_8(api_url, settings):
    check_exact_cap(api_url, settings)


@pytest.fixture(scope="module")
def two_process_api(settings, tmp_path_factory):
    with running_api(settings, tmp_path_factory.mktemp("api2"), "--workers", "2") as url:
        yield url


def test_the_cap_is_exact_with_two_api_processes(two_process_api, settings):
    check_exact_cap(two_process_api, settings)


def test_a_tenant_with_cap_0_is_suspended(api_url, settings):
    key = key_with_cap(settings, 0)
    r = httpx.post(f"{api_url}/v1/jobs", json=tiny_spec(), headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 403, r.text
    assert r.json()["error"]["code"] == "tenant_suspended"
    assert "suspended" in r.json()["error"]["message"]
