"""What the pages say where there is nothing to draw or nothing matches, in real headless Chromium
against a real API: a job waiting in the queue (and how many jobs are ahead of it) whose curves
appear once it starts, a job cancelled or failed before its first step, the spec in the order its
schema declares, the jobs list's filters that match nothing, sweeps' trials and the step of each
val_loss, and compare with a metric the jobs do not report. No worker runs here: a run is recorded
as a worker records it (tests/support/telemetry.py)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import timedelta

import httpx
import pytest

from app.db.session import transaction
from app.messaging.live_bus import live_bus
from app.services import lifecycle
from contract import metrics
from contract.spec import JobSpec, ModelSpec
from tests.browser.conftest import screenshot
from tests.browser.test_pages import DRAWN, SPEC
from tests.support.fixtures import settle
from tests.support.telemetry import plausible, stored_job, synthetic_run
from worker.engine.telemetry import Report
from worker.sink import JobSink


@pytest.fixture(autouse=True)
def settled(client, auth) -> Iterator[None]:
    """The test's tenant has nothing left queued or running after it."""
    yield
    settle(client, auth)


def spec_of(name: str, steps: int = 60, **train) -> dict:
    return SPEC | {"name": name, "train": SPEC["train"] | {"steps": steps, **train}}


def get(api_url: str, key: str, path: str, **params) -> dict:
    answer = httpx.get(f"{api_url}{path}", params=params, headers={"Authorization": f"Bearer {key}"})
    assert answer.status_code == 200, answer.text
    return answer.json()


class Run:
    """A stored job taken as a worker takes it: its steps reported through the worker's sink."""

    def __init__(self, settings, job_id: str) -> None:
        self.settings, self.job_id, self.bus = settings, job_id, live_bus(settings)
        with transaction(settings) as session:
            claim = lifecycle.claim(session, self.bus, job_id, "test:0:run", timedelta(minutes=10))
        assert claim is not None
        self.attempt, self.summary, self.completed = claim.attempt, {}, 0
        self.spec = JobSpec.model_validate(claim.spec)

    def steps(self, first: int, last: int) -> None:
        """Report the steps first..last (inclusive), stored and published."""
        values = plausible(self.spec)
        sink = JobSink(self.settings, self.job_id, self.attempt, self.completed, self.summary)
        for step in range(first, last + 1):
            reported = values(step)
            self.summary |= {k: v for k, v in reported.items() if k in metrics.SUMMARY}
            self.completed = step + 1
            sink.metrics(Report(step, reported, completed=self.completed, summary=dict(self.summary)))
        sink.close()

    def finish(self, status: str, error: dict | None = None) -> None:
        with transaction(self.settings) as session:
            done = lifecycle.finish(
                session, self.bus, self.job_id, self.attempt, status, self.completed, self.summary, error
            )
        assert done is not None

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc) -> None:
        """Ends the run if the test did not: no job is left on a worker that is not there."""
        with transaction(self.settings) as session:
            lifecycle.finish(session, self.bus, self.job_id, self.attempt, "failed", self.completed, self.summary)


def test_a_queued_job_says_how_many_are_ahead_then_draws_its_curves_once_it_starts(browser, api_url, key, settings):
    ahead = stored_job(settings, key, spec_of("first-in-line"))
    job_id = stored_job(settings, key, spec_of("waiting"))
    before = get(api_url, key, f"/v1/jobs/{ahead}")["queue_position"]
    assert get(api_url, key, f"/v1/jobs/{job_id}")["queue_position"] == before + 1
    page = browser.page(key)
    page.goto(f"{browser.url}/jobs/{job_id}")
    title = page.locator("#job-state-title")
    title.filter(has_text=re.compile(rf"^Waiting in queue, {before + 1} ahead$")).wait_for()
    assert page.locator("#job-state-detail").inner_text() == "Its curves appear here once a worker takes it."
    assert page.locator("#charts .chart-card").count() == 0 and not page.locator("#charts").is_visible()
    assert not page.locator("#chart-controls").is_visible()
    screenshot(page, "job-queued")
    page.evaluate("window.loadedOnce = true")  # gone if the page reloads

    # The job ahead leaves the queue: the page reads its place again.
    httpx.post(f"{api_url}/v1/jobs/{ahead}/cancel", headers={"Authorization": f"Bearer {key}"})
    title.filter(has_text=re.compile(rf"^Waiting in queue, {before or 'none'} ahead$")).wait_for(timeout=20_000)

    # A worker takes it: the state gives way to the curves, drawn live.
    with Run(settings, job_id) as run:
        page.locator("#job-status", has_text="running").wait_for()
        page.locator("#charts .chart-card").first.wait_for()
        assert not page.locator("#job-state").is_visible() and page.locator("#chart-controls").is_visible()
        run.steps(0, 29)
        page.wait_for_function(f"() => ({DRAWN})()['{metrics.LOSS}'] === 30")
        page.wait_for_function("() => MF.shown.charts[0].plot.data[0].length === 30")  # on screen (redraws are batched)
        run.finish("succeeded")
    page.locator("#job-status", has_text="succeeded").wait_for()
    assert page.evaluate("window.loadedOnce") is True
    screenshot(page, "job-queued-then-ran")


def test_a_job_cancelled_before_it_started_says_so_instead_of_empty_charts(browser, api_url, key, settings):
    job_id = stored_job(settings, key, spec_of("never-ran"))
    httpx.post(f"{api_url}/v1/jobs/{job_id}/cancel", headers={"Authorization": f"Bearer {key}"})
    page = browser.page(key)
    page.goto(f"{browser.url}/jobs/{job_id}")
    page.locator("#job-state", has_text="Cancelled before it started").wait_for()
    page.wait_for_function("() => document.querySelector('#log').innerText === 'None.'")  # the stream has ended
    assert page.locator("#charts .chart-card").count() == 0 and not page.locator("#chart-controls").is_visible()
    assert page.locator("#job-status").inner_text() == "cancelled"
    screenshot(page, "job-cancelled")


def test_a_job_that_failed_before_its_first_step_shows_the_error(browser, api_url, key, settings):
    job_id = stored_job(settings, key, spec_of("failed-early"))
    Run(settings, job_id).finish("failed", {"code": "data_error", "message": "the corpus is too short"})
    page = browser.page(key)
    page.goto(f"{browser.url}/jobs/{job_id}")
    state = page.locator("#job-state")
    state.locator("h2", has_text="Failed before its first step").wait_for()
    assert state.locator("p").inner_text() == "data_error: the corpus is too short"
    assert not page.locator("#job-error").is_visible()  # said once, in the state
    assert page.locator("#charts .chart-card").count() == 0


def test_the_spec_is_shown_in_the_order_its_schema_declares(browser, api_url, key, settings):
    job_id = stored_job(settings, key, spec_of("ordered") | {"optimizer": {"qk_clip_tau": 30, "name": "muonclip"}})
    shown = get(api_url, key, f"/v1/jobs/{job_id}")["spec"]
    assert list(shown) == list(JobSpec.model_fields)  # Postgres's jsonb sorts keys: put back in order
    assert list(shown["model"]) == list(ModelSpec.model_fields)
    page = browser.page(key)
    page.goto(f"{browser.url}/jobs/{job_id}")
    page.locator("#spec", has_text="name: ordered").wait_for()
    text = page.locator("#spec").inner_text()
    top = [line.split(":")[0] for line in text.splitlines() if line and not line.startswith(" ")]
    assert top == list(JobSpec.model_fields)  # name, model, data, optimizer, train, ...
    model = re.search(r"^model:\n((?:  .*\n)+)", text, re.M)[1]
    assert [line.split(":")[0].strip() for line in model.splitlines()] == list(ModelSpec.model_fields)
    assert re.search(r"^optimizer:\n  name: muonclip\n  lr: ", text, re.M)


def test_a_filter_that_matches_nothing_says_so_and_clears(browser, key, settings):
    page = browser.page(key)
    page.locator("#empty", has_text="No jobs yet").wait_for()  # the tenant has none at all
    for i in range(3):
        stored_job(settings, key, spec_of(f"queued-{i}"))
    page.reload()
    page.locator("#jobs tbody tr").nth(2).wait_for()
    page.locator("#status-filter").select_option("succeeded")
    page.locator("#no-match", has_text="No succeeded jobs.").wait_for()
    assert not page.locator("#empty").is_visible() and page.locator("#jobs tbody tr").count() == 0
    screenshot(page, "jobs-filter-no-match")
    page.get_by_role("button", name="Show all jobs").click()
    page.locator("#jobs tbody tr").nth(2).wait_for()
    assert page.locator("#status-filter").input_value() == "" and not page.locator("#no-match").is_visible()


SWEEP = {
    "name": "lr-scan",
    "base": {
        "model": {"arch": "gpt", "n_layer": 1, "n_head": 2, "d_model": 32, "seq_len": 32},
        "data": {"builtin": "synthetic"},
        "train": {"steps": 40, "batch_size": 8, "eval_every": 10},
    },
    "space": {"optimizer.lr": {"values": [0.01, 0.02]}},
    "method": "grid",
    "max_concurrent": 2,
}


def test_the_jobs_list_links_trials_to_their_sweep_hides_them_on_request_and_gives_val_losss_step(
    browser, api_url, key, settings
):
    headers = {"Authorization": f"Bearer {key}"}
    answer = httpx.post(f"{api_url}/v1/sweeps", json=SWEEP, headers=headers, timeout=30)
    assert answer.status_code == 201, answer.text
    sweep_id = answer.json()["id"]
    # A job stopped at step 70 that evaluated every 50 steps: its val_loss is step 50's.
    stopped = stored_job(settings, key, spec_of("evaluated", steps=200, eval_every=50))
    with Run(settings, stopped) as run:
        run.steps(0, 70)
        run.finish("cancelled")
    listed = {j["id"]: j for j in get(api_url, key, "/v1/jobs")["data"]}
    assert listed[stopped]["val_loss_step"] == 50 and listed[stopped]["progress"]["step"] == 71
    trials = [j for j in listed.values() if j["sweep_id"] == sweep_id]
    assert len(trials) == 2 and all(j["val_loss_step"] is None for j in trials)
    assert [j["id"] for j in get(api_url, key, "/v1/jobs", trials="false")["data"]] == [stopped]
    assert {j["id"] for j in get(api_url, key, "/v1/jobs", trials="true")["data"]} == {j["id"] for j in trials}

    page = browser.page(key)
    page.locator("#jobs tbody tr").nth(2).wait_for()
    for trial in trials:
        link = page.locator(f"#jobs tr[data-id='{trial['id']}'] td.sweep a")
        link.filter(has_text="lr-scan").wait_for()  # the sweep's name, once read
        assert link.get_attribute("href") == f"/sweeps/{sweep_id}"
    row = page.locator(f"#jobs tr[data-id='{stopped}']")
    assert row.locator("td.sweep").inner_text() == ""
    value = listed[stopped]["summary"][metrics.VAL_LOSS]
    assert row.locator("td").nth(7).inner_text() == f"{float(f'{value:.4g}'):g} @ 50"
    screenshot(page, "jobs-with-trials")
    page.get_by_label("Hide sweep trials").check()
    page.locator("#jobs tbody tr").nth(1).wait_for(state="detached")
    assert page.locator("#jobs tbody tr").get_attribute("data-id") == stopped
    page.locator("#status-filter").select_option("queued")
    page.locator("#no-match", has_text="No queued jobs outside sweeps.").wait_for()
    screenshot(page, "jobs-no-trials-no-match")


def test_compare_names_a_metric_the_jobs_do_not_report_and_lists_those_they_do(browser, key, settings):
    a = synthetic_run(settings, key, spec_of("clip", steps=30, eval_every=10))
    b = synthetic_run(settings, key, spec_of("adam", steps=30, eval_every=10) | {"optimizer": {"name": "adamw"}})
    page = browser.page(key)
    page.goto(f"{browser.url}/compare?jobs={a},{b}&metric=val_los")
    note = page.locator("#metric-note", has_text="Unknown metric “val_los”")
    note.wait_for()
    assert "none of these jobs reports it" in note.inner_text()
    names = note.locator("a").all_inner_texts()
    assert names[:2] == [metrics.LOSS, metrics.VAL_LOSS] and metrics.QK_CLIP_MIN_GAMMA in names
    assert "other series (such as attn_max_logit/l0)" in note.inner_text()
    assert not page.locator("#chart").is_visible()
    screenshot(page, "compare-unknown-metric")
    note.get_by_role("link", name=metrics.VAL_LOSS, exact=True).click()
    page.wait_for_url(re.compile(rf"metric={metrics.VAL_LOSS}$"))
    page.wait_for_function("() => MF.shown && MF.shown.charts[0].hasData()")
    assert page.locator("#metric").input_value() == metrics.VAL_LOSS
    assert page.evaluate(DRAWN) == {a: 4, b: 4}  # evaluations at 0, 10, 20, 30
    assert not page.locator("#metric-note").is_visible()
    # Reported by one of the two: the chart draws it, and a note names the other.
    page.locator("#metric").fill(metrics.UPDATE_RMS)
    page.locator("#metric").dispatch_event("change")
    page.locator("#metric-note", has_text=f"Not reported by adam: “{metrics.UPDATE_RMS}”.").wait_for()
    assert page.locator("#chart").is_visible()
