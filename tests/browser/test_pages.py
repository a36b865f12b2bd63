"""The web app in real headless Chromium against a real API and worker: sign-in, the job page's
curves (every point of a short job), cancel, compare, the new-job form and its 422s, text that
stays text, tenants. Live updates without a reload are in test_live.py."""

from __future__ import annotations

import re
import time

import httpx
import pytest

from tests.browser.conftest import screenshot
from tests.support.api import new_key
from tests.support.net import wait_for
from tests.support.telemetry import synthetic_run

DRAWN = """() => Object.fromEntries(MF.shown.charts.flatMap((c) => c.spec.series.map((s, i) =>
    [s.name, c.plot ? c.plot.data[1 + 2 * i].filter((v) => v !== null).length : 0])))"""
XSS = "<img src=x onerror=alert(1)>"


SPEC = {
    "name": "page",
    "model": {"arch": "gpt", "n_layer": 2, "n_head": 2, "d_model": 32, "seq_len": 32},
    "data": {"builtin": "synthetic"},
    "optimizer": {"name": "muonclip", "qk_clip_tau": 30},
    "train": {"steps": 200, "batch_size": 8, "eval_every": 50, "checkpoint_every": 100},
}


def submit(api_url: str, key: str, name: str, steps: int, **train) -> dict:
    spec = SPEC | {"name": name, "train": SPEC["train"] | {"steps": steps, **train}}
    answer = httpx.post(f"{api_url}/v1/jobs", json=spec, headers={"Authorization": f"Bearer {key}"})
    assert answer.status_code == 201, answer.text
    return answer.json()


def finished(api_url: str, key: str, job_id: str, timeout: float = 120) -> dict:
    def done():
        job = httpx.get(f"{api_url}/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {key}"}).json()
        return job if job["status"] in ("succeeded", "failed", "cancelled") else None

    return wait_for(done, timeout=timeout, interval=0.3)


def test_sign_in_keeps_the_key_out_of_reach_and_sign_out_forgets_it(browser, key):
    browser.expect(401, 404)  # the wrong key; the job that does not exist
    page = browser.page()
    page.goto(f"{browser.url}/jobs/job_anything")
    page.get_by_label("API key").fill("mf_wrong")
    page.get_by_role("button", name="Sign in").click()
    page.get_by_text("This key is unknown or revoked.").wait_for()
    screenshot(page, "signin")
    page.get_by_label("API key").fill(key)
    page.get_by_role("button", name="Sign in").click()
    page.get_by_text("Job not found").wait_for()  # back on the page asked for, signed in
    (cookie,) = page.context.cookies()
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["expires"] == -1  # a session cookie
    assert key not in page.evaluate("document.cookie") and key not in page.url
    page.get_by_role("button", name="Sign out").click()
    page.get_by_label("API key").wait_for()
    assert page.context.cookies() == []


def test_a_finished_job_shows_every_point_its_samples_checkpoints_and_spec(browser, api_url, key, worker):
    job = submit(api_url, key, "every-point", steps=200)
    finished(api_url, key, job["id"])
    page = browser.page(key)
    page.goto(f"{browser.url}/jobs/{job['id']}")
    page.wait_for_function("() => MF.shown && MF.shown.charts.length && MF.shown.charts.every((c) => c.hasData())")
    drawn = page.evaluate(DRAWN)
    assert drawn["loss"] == 200 and drawn["val_loss"] == 5  # steps 0-199; evaluations at 0, 50, ..., 200
    assert drawn["attn_max_logit"] == 200 and drawn["qk_clip/min_gamma"] == 200 and drawn["lr"] == 200
    assert page.locator("#job-status").inner_text() == "succeeded"
    page.locator("#samples .sample").nth(4).wait_for()  # from the events stream
    assert page.locator("#samples .sample").count() == 5  # one per evaluation, newest first
    assert page.locator("#samples .sample").first.inner_text().startswith("step 200")
    # The log opens with the routing of the parameters (the job's only log line here).
    page.wait_for_function("() => document.querySelector('#log').innerText.includes('parameters: Muon takes')")
    assert page.locator("#log").inner_text().count("\n") == 0
    page.locator("#checkpoints tbody tr").nth(1).wait_for()
    assert page.locator("#checkpoints tbody tr").count() == 2
    href = page.locator("#checkpoints tbody tr a").first.get_attribute("href")
    assert href == f"/v1/jobs/{job['id']}/checkpoints/200"
    assert "name: every-point" in page.locator("#spec").inner_text()
    heat = page.evaluate("() => { const h = MF.shown.heatmap; return [h.layers, h.heads, h.max > 0]; }")
    assert heat == [2, 2, True]
    screenshot(page, "job-finished")


def test_zoom_refetches_the_range_at_full_resolution(browser, api_url, key, settings):
    # A long run's history is what is shown here, not its training: recorded as a worker records it.
    spec = SPEC | {"name": "zoom", "train": SPEC["train"] | {"steps": 1200, "eval_every": 400}}
    job = {"id": synthetic_run(settings, key, spec)}
    page = browser.page(key, width=900)  # charts narrower than 1200 steps: the history is downsampled
    page.goto(f"{browser.url}/jobs/{job['id']}")
    page.wait_for_function("() => MF.shown && MF.shown.charts.every((c) => c.hasData())")
    overview = page.evaluate(DRAWN)["loss"]
    width = page.evaluate("MF.shown.charts[0].width")
    assert overview <= width < 1200
    page.evaluate("MF.shown.charts[0].onZoom(300, 400)")
    page.wait_for_function("() => MF.shown.charts[0].zoomed !== null")
    zoomed = page.evaluate(
        "() => { const t = MF.shown.charts[0].zoomed.table;"
        " return t.steps.filter((_, i) => t.columns[0][i] !== null); }"
    )
    assert zoomed == list(range(300, 401))  # every step of the range
    assert page.locator("#reset-zoom").is_visible()
    page.locator("#reset-zoom").click()
    page.wait_for_function("() => MF.shown.charts.every((c) => c.zoomed === null)")
    for control in ("#log-y",):
        page.locator(control).check()
    page.locator("#x-axis").select_option("tokens")
    page.locator("#smoothing").fill("0")
    xs = page.evaluate("MF.shown.charts[0].plot.data[0]")
    assert xs[1] - xs[0] > 0 and max(xs) <= 1200 * 8 * 32  # tokens = step x batch x seq_len
    screenshot(page, "job-zoom-controls")
    # Smoothing is debiased and weighted by distance: a point 100 steps after the last (an eval)
    # is as good as unsmoothed, while neighbours average.
    dense, sparse = page.evaluate("[MF.ema([1, 2], 0.5, [0, 1], 1), MF.ema([1, 3], 0.5, [0, 100], 1)]")
    assert dense == pytest.approx([1.0, 5 / 3]) and sparse[0] == 1.0 and sparse[1] == pytest.approx(3.0, abs=1e-12)


def test_cancel_from_the_page(browser, api_url, key, worker):
    job = submit(api_url, key, "to-cancel", steps=200_000, checkpoint_every=200_000)
    page = browser.page(key)
    page.goto(f"{browser.url}/jobs/{job['id']}")
    page.locator("#job-status", has_text="running").wait_for(timeout=60_000)
    page.once("dialog", lambda dialog: dialog.accept())
    page.get_by_role("button", name="Cancel").click()
    page.locator("#job-status", has_text="cancelled").wait_for(timeout=60_000)
    assert not page.get_by_role("button", name="Cancel").is_visible()
    assert finished(api_url, key, job["id"])["status"] == "cancelled"


def test_compare_two_jobs_picked_on_the_jobs_page(browser, key, settings):
    a, b = (
        {"id": synthetic_run(settings, key, SPEC | {"name": name, "train": SPEC["train"] | train})}
        for name, train in (("compare-a", {"steps": 120}), ("compare-b", {"steps": 80, "lr_schedule": "cosine"}))
    )
    page = browser.page(key)
    for name in ("compare-a", "compare-b"):
        page.get_by_label(f"Select {name}").check()
    page.get_by_role("button", name="Compare selected (2)").click()
    page.wait_for_url(re.compile(r"/compare\?jobs="))
    assert set(page.url.split("jobs=")[1].split(",")) == {a["id"], b["id"]}
    page.wait_for_function("() => MF.shown && MF.shown.charts[0].hasData()")
    drawn = page.evaluate(DRAWN)
    assert drawn == {a["id"]: 120, b["id"]: 80} or drawn == {b["id"]: 80, a["id"]: 120}
    legend = page.locator(".chart-legend").inner_text()
    assert "compare-a · muonclip lr 0.02" in legend and "compare-b · muonclip lr 0.02" in legend
    page.locator("#metric").fill("lr")
    page.locator("#metric").dispatch_event("change")
    page.wait_for_function("() => document.getElementById('chart-title').textContent === 'lr'")
    screenshot(page, "compare")


def test_new_job_form_submits_and_shows_a_422_at_its_field(browser, key, worker):
    browser.expect(422)
    page = browser.page(key)
    page.goto(f"{browser.url}/new")
    page.locator("#preset").select_option("synthetic-muon")
    page.get_by_label("Learning rate").fill("50")  # the API allows at most 10
    page.get_by_role("button", name="Submit job").click()
    error = page.locator("#f-lr").locator("xpath=..").locator(".field-error")
    error.wait_for()
    assert "less than or equal to 10" in error.inner_text()
    assert "invalid" in page.locator("#f-lr").get_attribute("class")
    # A field the form does not show: the error goes under the spec editor.
    page.get_by_label("Learning rate").fill("0.02")
    spec = page.locator("#raw").input_value()
    assert "telemetry:\n  every: 1\n" in spec
    page.locator("#raw").fill(spec.replace("telemetry:\n  every: 1\n", "telemetry:\n  every: 0\n"))
    page.get_by_role("button", name="Submit job").click()
    page.locator("#raw-error", has_text="telemetry.every").wait_for()
    screenshot(page, "new-job-422")
    # Fixed: the job is created and the page goes to it.
    page.locator("#raw").fill(spec)
    page.get_by_label("Steps", exact=True).fill("30")
    page.get_by_role("button", name="Submit job").click()
    page.wait_for_url(re.compile(r"/jobs/job_"))
    page.locator("#job-name", has_text="synthetic-muon").wait_for()


def test_names_are_text_never_markup(browser, api_url, key):
    dialogs = []
    job = submit(api_url, key, XSS, steps=10)
    page = browser.page(key)
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    for path in ("/", f"/jobs/{job['id']}", f"/compare?jobs={job['id']}"):
        page.goto(f"{browser.url}{path}")
        page.get_by_text(XSS).first.wait_for()
        assert page.locator("img").count() == 0, path
    time.sleep(0.5)
    assert dialogs == []
    httpx.post(f"{api_url}/v1/jobs/{job['id']}/cancel", headers={"Authorization": f"Bearer {key}"})


@pytest.mark.parametrize("path", ["/jobs/{id}", "/compare?jobs={id}"])
def test_another_tenants_job_is_not_found(browser, api_url, settings, key, path):
    browser.expect(404)
    job = submit(api_url, key, "private", steps=10)
    page = browser.page(new_key(settings, "someone-else"))
    page.goto(f"{browser.url}{path.format(id=job['id'])}")
    if path.startswith("/jobs"):
        page.get_by_role("heading", name="Job not found").wait_for()
    else:
        page.get_by_text(f"Not found: {job['id']}").wait_for()
    httpx.post(f"{api_url}/v1/jobs/{job['id']}/cancel", headers={"Authorization": f"Bearer {key}"})
