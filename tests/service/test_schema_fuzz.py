"""schemathesis over the API's own OpenAPI schema, every check on, against a real server on
Postgres and Redis: no server error, every status code, content type and body as the schema
documents, no schema-valid request refused (but for what schemathesis.toml explains), the
Allow header of every 405 right. MUONFORGE_TEST_FUZZ_EXAMPLES sets the examples per operation
(a small number here; docs/benchmarks.md gives a run of more than 2,000 requests)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.support.api import new_key
from tests.support.services import ROOT

pytestmark = pytest.mark.system  # its tests start processes: the service's, torchrun's or a command's

EXAMPLES = int(os.environ.get("MUONFORGE_TEST_FUZZ_EXAMPLES", "8"))
SEED = os.environ.get("MUONFORGE_TEST_FUZZ_SEED", "1")  # fixed: a failure here is reproducible


def test_the_api_does_what_its_openapi_schema_says(api_url, settings):
    key = new_key(settings)
    st = Path(sys.executable).parent / "st"
    command = [
        str(st),
        "run",
        f"{api_url}/openapi.json",
        "--max-examples",
        str(EXAMPLES),
        "--seed",
        SEED,
        "--no-color",
        "-H",
        f"Authorization: Bearer {key}",
    ]
    try:
        run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    finally:
        _cancel_what_it_queued(api_url, key)
    report = run.stdout[-6000:]
    print(report[report.rfind("SUMMARY") :])  # with -s: the operations, phases and requests generated
    assert run.returncode == 0, report
    generated = re.search(r"(\d+) generated", report)
    assert generated and int(generated[1]) >= 100, report  # it did send requests


def _cancel_what_it_queued(api_url: str, key: str) -> None:
    """The fuzzed jobs stay queued (no worker runs here): cancel them, so no later test's worker
    picks one up; the fuzzed sweeps first, so that none starts another trial."""
    with httpx.Client(base_url=api_url, headers={"Authorization": f"Bearer {key}"}, timeout=30) as client:
        for _ in range(10):
            sweeps = client.get("/v1/sweeps", params={"limit": 100, "status": "running"}).json()["data"]
            for sweep in sweeps:
                client.post(f"/v1/sweeps/{sweep['id']}/cancel")
            if not sweeps:
                break
        after = None
        while True:
            page = client.get(
                "/v1/jobs", params={"limit": 100, "status": "queued", **({"after": after} if after else {})}
            ).json()
            for job in page["data"]:
                client.post(f"/v1/jobs/{job['id']}/cancel")
            if not page["has_more"]:
                return
            after = page["next_after"]
