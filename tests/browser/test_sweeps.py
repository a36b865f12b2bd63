"""The sweep pages in real headless Chromium against a real API and worker: the list, one sweep's
plots of the metric against each swept parameter (log x for a log_uniform one), its trials table
sorted by the metric, and the link to the compare view of its trials."""

from __future__ import annotations

import re

import httpx

from tests.browser.conftest import screenshot
from tests.support.net import wait_for

SWEEP = {
    "name": "lr-and-optimizer",
    "base": {
        "model": {"arch": "gpt", "n_layer": 1, "n_head": 2, "d_model": 32, "seq_len": 32},
        "data": {"builtin": "synthetic"},
        "train": {"steps": 40, "batch_size": 8, "eval_every": 10, "checkpoint_every": 20},
        "telemetry": {"sample_tokens": 0},
    },
    "space": {
        "optimizer.lr": {"log_uniform": [1e-5, 3e-2]},
        "optimizer.name": {"values": ["adamw", "muon"]},
    },
    "method": "random",
    "seed": 4,
    "max_trials": 8,
    "max_concurrent": 2,
    "asha": {"rungs": [10], "reduction_factor": 2},
}


def test_a_sweep_page_plots_its_trials_and_sorts_them_by_the_metric(browser, api_url, key, worker):
    headers = {"Authorization": f"Bearer {key}"}
    answer = httpx.post(f"{api_url}/v1/sweeps", json=SWEEP, headers=headers, timeout=30)
    assert answer.status_code == 201, answer.text
    sweep_id = answer.json()["id"]

    def done():
        sweep = httpx.get(f"{api_url}/v1/sweeps/{sweep_id}", headers=headers, timeout=30).json()
        return sweep if sweep["status"] != "running" else None

    sweep = wait_for(done, timeout=240, interval=0.5)
    assert sweep["status"] == "completed" and "stopped_early" in sweep["counts"]["by_status"]

    page = browser.page(key)
    page.get_by_role("link", name="Sweeps").click()
    row = page.locator(f"#sweeps tr[data-id='{sweep_id}']")
    row.wait_for()
    assert "completed" in row.inner_text() and "stopped early" in row.inner_text()
    screenshot(page, "sweeps")
    row.get_by_role("link", name="lr-and-optimizer").click()
    page.wait_for_url(re.compile(rf"/sweeps/{sweep_id}$"))
    page.locator("#plots .uplot").nth(1).wait_for()
    assert page.locator("#plots .uplot").count() == 2
    titles = page.locator("#plots h2").all_inner_texts()
    assert titles == ["val_loss against optimizer.lr (log scale)", "val_loss against optimizer.name"]

    rows = page.locator("#trials tbody tr")
    assert rows.count() == 8
    cells = page.locator("#trials tbody tr td:nth-child(7)").all_inner_texts()
    metrics = [float(t) if t != "–" else None for t in cells]
    shown = [m for m in metrics if m is not None]
    assert shown == sorted(shown) and metrics[: len(shown)] == shown  # by the metric, best first
    best = sweep["best"]
    assert page.locator("#trials tbody tr.best").get_attribute("data-number") == str(best["number"])
    assert f"Trial #{best['number']}" in page.locator("#best").inner_text()
    page.locator("#trials th[data-key='metric']").click()  # descending now
    again = [t for t in page.locator("#trials tbody tr td:nth-child(7)").all_inner_texts() if t != "–"]
    assert [float(t) for t in again] == sorted(shown, reverse=True)
    screenshot(page, "sweep")

    compare = page.get_by_role("link", name="Compare trials")
    ids = compare.get_attribute("href").split("=", 1)[1].split(",")
    assert set(ids) == {t["job_id"] for t in sweep["trials"]} and ids[0] == best["job_id"]
    compare.click()
    page.wait_for_url(re.compile(r"/compare\?jobs="))
    page.wait_for_function("() => MF.shown && MF.shown.charts[0].hasData()")
