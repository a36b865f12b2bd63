"""A job watched from submission to the end on one page load: the status turns queued, running,
succeeded, and curve points arrive while it runs, without a reload."""

from __future__ import annotations

import contextlib
import time

import httpx

from muonforge.client import Client
from tests.browser.conftest import Browser, screenshot
from tests.browser.test_pages import DRAWN, submit
from tests.support.services import Worker, running_api


def test_status_and_curves_update_live_without_a_reload(browser, api_url, key, settings, tmp_path):
    job = submit(api_url, key, "live", steps=600, eval_every=200, checkpoint_every=300)
    page = browser.page(key)
    page.goto(f"{browser.url}/jobs/{job['id']}")
    page.locator("#job-status", has_text="queued").wait_for()  # no worker yet
    page.evaluate("window.loadedOnce = true")  # gone if the page reloads
    worker = Worker(settings, tmp_path / "worker.log")
    try:
        page.locator("#job-status", has_text="running").wait_for(timeout=60_000)
        seen = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            status = page.locator("#job-status").inner_text()
            seen.append((status, page.evaluate(DRAWN)["loss"]))
            if status == "succeeded":
                break
            time.sleep(0.25)
        screenshot(page, "job-live")
    finally:
        worker.stop()
    running = [n for status, n in seen if status == "running"]
    assert seen[-1] == ("succeeded", 600), seen[-5:]
    assert len(set(running)) >= 3 and running == sorted(running), "points arrived while it ran"
    assert page.evaluate("window.loadedOnce") is True
    assert page.locator("#progress, .progress-text").first.inner_text().startswith("600 / 600")


# The stream has ended with `done` (an empty log panel then says "None.") or log lines arrived.
STREAM_DONE = (
    """() => { const p = document.querySelector('#log > p.muted'); return !p || p.textContent === 'None.'; }"""
)


def test_a_refused_stream_falls_back_to_polling_then_resumes_without_repeating(
    chromium, settings, key, tmp_path_factory, tmp_path
):
    """With the tenant at its cap of open streams (1 here), the page says so, follows the job by
    polling, and opens a new stream once a slot is free: the logs and samples then arrive, once."""
    with running_api(settings, tmp_path_factory.mktemp("one-stream-api"), MUONFORGE_TENANT_STREAM_CAP="1") as url:
        browser = Browser(chromium, url)
        browser.expect(429)  # the refused stream
        auth = {"Authorization": f"Bearer {key}"}
        job = submit(url, key, "polled", steps=300, eval_every=100, checkpoint_every=150)
        other = submit(url, key, "held", steps=300)  # queued behind it: its stream stays open
        with httpx.Client(base_url=url, headers=auth, timeout=30) as client, contextlib.ExitStack() as streams:
            held = streams.enter_context(client.stream("GET", f"/v1/jobs/{other['id']}/events"))
            assert held.status_code == 200
            page = browser.page(key)
            page.goto(f"{url}/jobs/{job['id']}")
            page.locator("#banner", has_text="Live updates are unavailable").wait_for()
            worker = Worker(settings, tmp_path / "worker.log")
            try:
                page.locator("#job-status", has_text="running").wait_for(timeout=60_000)
                screenshot(page, "job-polled")
                held.close()  # a slot is free: the page's next try opens its stream
                page.locator("#job-status", has_text="succeeded").wait_for(timeout=120_000)
                page.locator("#banner").wait_for(state="hidden", timeout=90_000)
                page.locator("#samples .sample").nth(3).wait_for(timeout=30_000)
                page.wait_for_function(STREAM_DONE, timeout=30_000)
                page.locator("#checkpoints tbody tr").nth(1).wait_for(timeout=30_000)  # steps 150 and 300
                page.wait_for_function(f"() => ({DRAWN})().loss === 300", timeout=30_000)
                page.wait_for_timeout(1000)  # the canvases paint on a later frame than their data
                screenshot(page, "job-polled-then-streamed")
                samples = page.locator("#samples .sample .muted").all_inner_texts()
                logs = page.locator("#log > div").all_inner_texts()
                log_panel, drawn = page.locator("#log").inner_text(), page.evaluate(DRAWN)
                checkpoints_hidden = page.locator("#no-checkpoints").is_hidden()
            finally:
                worker.stop()
                client.post(f"/v1/jobs/{other['id']}/cancel")
                browser.close()
            streamed = [e for e in Client(url, key).events(job["id"]) if e.event in ("log", "sample")]
    assert sorted(samples) == sorted(f"step {s}" for s in (0, 100, 200, 300)), "each sample once"
    assert logs == [f"{e.data['level']}: {e.data['message']}" for e in streamed if e.event == "log"]
    assert logs or log_panel == "None.", "an empty log is said to be empty once done"
    assert drawn["loss"] == 300, "the curve holds every step, polled or streamed"
    assert checkpoints_hidden, "the checkpoints are listed"
    assert browser.errors == [], "console errors"
