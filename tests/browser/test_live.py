"""A job watched from submission to the end on one page load: the status turns queued, running,
succeeded, and curve points arrive while it runs, without a reload."""

from __future__ import annotations

import time

from tests.browser.conftest import screenshot
from tests.browser.test_pages import DRAWN, submit
from tests.service.conftest import Worker


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
