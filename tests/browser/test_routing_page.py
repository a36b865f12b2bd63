"""The job page's "Parameter routing" section in real headless Chromium: a job a real worker ran
(its table open: it is short), a long table recorded as a worker records it (collapsed, the
unrecognized matrix highlighted with its warning, names as text), and a job not started yet,
whose facts name its data and tokenizer."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import httpx
import pytest

from app.db.session import transaction
from app.messaging.live_bus import NoBus
from app.services import lifecycle
from tests.browser.conftest import screenshot
from tests.browser.test_pages import XSS, finished
from tests.support.fixtures import settle
from tests.support.specs import tiny_spec
from tests.support.telemetry import stored_job
from worker.sink import JobSink

SCREENSHOT = Path("/tmp/routing.png")


@pytest.fixture(autouse=True)
def settled(client, auth) -> Iterator[None]:
    """The test's tenant has nothing left queued or running after it."""
    yield
    settle(client, auth)


def rows(page) -> list[list[str]]:
    """The routing table's cells, row by row, as the page shows them."""
    return page.eval_on_selector_all(
        "#routing tbody tr", "trs => trs.map((tr) => [...tr.cells].map((td) => td.innerText.trim()))"
    )


def test_a_finished_job_shows_its_routing(browser, api_url, key, worker):
    spec = tiny_spec(steps=2, eval_every=2, checkpoint_every=2)
    answer = httpx.post(f"{api_url}/v1/jobs", json=spec, headers={"Authorization": f"Bearer {key}"})
    job = answer.json()
    assert finished(api_url, key, job["id"])["status"] == "succeeded"
    page = browser.page(key)
    page.goto(f"{browser.url}/jobs/{job['id']}")
    page.locator("#routing tbody tr").nth(11).wait_for()
    summary = page.locator("#routing-summary").inner_text()
    assert summary.startswith("Muon: 4 parameters, ") and " · AdamW: 8 parameters, " in summary, summary
    assert page.locator("#routing-details").get_attribute("open") is not None  # 12 rows: shown open
    assert page.locator("#routing-warnings").is_hidden()
    table = rows(page)
    assert len(table) == 12
    assert table[0] == ["wte.weight", "64 × 16", "AdamW", "embedding or norm", "1,024"]
    assert ["blocks.0.attn.qkv.weight", "48 × 16", "Muon", "hidden matrix", "768"] in table
    page.locator("#routing-card").scroll_into_view_if_needed()
    page.locator("#routing-card").screenshot(path=SCREENSHOT)
    screenshot(page, "job-routing")


def recorded_job(settings, key: str) -> str:
    """A job whose worker recorded a table of 30 parameters, one an unrecognized matrix, then failed."""
    job_id = stored_job(settings, key, tiny_spec())
    with transaction(settings) as session:
        attempt = lifecycle.claim(session, NoBus(), job_id, "test:0:run", timedelta(minutes=10)).attempt
    hidden = {"optimizer": "muon", "role": "hidden_matrix", "reason": "hidden matrix", "warning": None}
    parameters = [{"name": f"layers.{i}.weight", "shape": [16, 16]} | hidden for i in range(29)]
    warning = f"parameter {XSS} [3x5] is a matrix of an unrecognized module: AdamW takes it, not Muon"
    odd = {"name": XSS, "shape": [3, 5], "optimizer": "adamw", "role": "unrecognized"}
    parameters.append(odd | {"reason": "matrix of an unrecognized module", "warning": warning})
    sink = JobSink(settings, job_id, attempt, 0, {})
    sink.routing({"optimizer": "muon", "parameters": parameters})
    sink.close()
    with transaction(settings) as session:
        lifecycle.finish(session, NoBus(), job_id, attempt, "failed", 0, {}, {"code": "test", "message": "no steps"})
    return job_id


def test_a_long_table_is_collapsed_and_an_unrecognized_matrix_is_highlighted(browser, settings, key):
    job_id = recorded_job(settings, key)
    dialogs: list[str] = []
    page = browser.page(key)
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    page.goto(f"{browser.url}/jobs/{job_id}")
    page.locator("#routing-warnings li").wait_for()
    assert page.locator("#routing-warnings").inner_text().startswith(f"parameter {XSS} [3x5]")
    details = page.locator("#routing-details")
    assert details.get_attribute("open") is None and page.locator("#routing").is_hidden()  # 30 rows: collapsed
    assert page.locator("#routing-toggle").inner_text() == "Every parameter (30)"
    page.locator("#routing-toggle").click()
    odd = page.locator("#routing tbody tr.unrecognized")
    assert odd.count() == 1 and odd.locator("td").first.inner_text() == XSS
    assert "AdamW takes it, not Muon" in odd.locator(".routing-warning").inner_text()
    assert page.locator("img").count() == 0 and dialogs == []
    summary = page.locator("#routing-summary").inner_text()
    assert summary == "Muon: 29 parameters, 7,424 values (99.8%) · AdamW: 1 parameter, 15 values (0.2%)"
    screenshot(page, "job-routing-long")


def test_a_job_not_started_says_when_its_routing_is_known(browser, settings, key, no_worker):
    job_id = stored_job(settings, key, tiny_spec())  # no task sent
    page = browser.page(key)
    page.goto(f"{browser.url}/jobs/{job_id}")
    page.get_by_text("its routing is known once a worker builds its model").wait_for()
    assert page.locator("#routing-details").is_hidden()
    assert fact(page, "data") == "synthetic task"
    data = {"builtin": "pysource-instruct", "tokenizer": {"type": "bpe", "vocab_size": 4096}, "train_on_inputs": True}
    other = stored_job(settings, key, tiny_spec() | {"data": data})
    page.goto(f"{browser.url}/jobs/{other}")
    page.get_by_text("its routing is known once a worker builds its model").wait_for()
    assert fact(page, "data") == "pysource-instruct, bpe 4,096, inputs trained on"


def fact(page, label: str) -> str:
    """The value the job page's facts show under ``label``."""
    return page.locator(".fact", has=page.locator(".k", has_text=label)).locator(".v").inner_text()
