"""The charts as a reader sees them, in real headless Chromium: every axis titled (with the metric's
unit), every tick label inside its chart and clear of the others, one number format per axis,
whole steps and head counts, the smoothed value named as such, sparse series drawn point by point,
the heatmap's step axis and head labels, hyperparameters written alike on every page, and wall
time counted from the first step.

What the charts draw on their canvases is read back as drawn: every fillText is recorded with its
text and the box it covers on its canvas."""

from __future__ import annotations

import math
import re
from datetime import timedelta

import pytest

from app.db.session import transaction
from app.messaging.live_bus import live_bus
from app.services import lifecycle
from contract import metrics
from contract.spec import JobSpec
from tests.browser.conftest import screenshot
from tests.browser.test_pages import finished, submit
from tests.support.api import new_key
from tests.support.telemetry import report, stored_job
from worker.sink import JobSink

# Every canvas's text as drawn since it was last cleared: {text, font, rotated, left, right, top,
# bottom} in canvas pixels (the box the text's glyphs cover, through the context's transform).
RECORD_TEXT = """(() => {
  const drawn = new WeakMap();
  window.textsOf = (canvas) => drawn.get(canvas) || [];
  const P = CanvasRenderingContext2D.prototype;
  const fillText = P.fillText;
  const clearRect = P.clearRect;
  P.fillText = function (text, x, y, ...rest) {
    const m = this.measureText(text);
    const t = this.getTransform();
    const [x0, x1] = [x - m.actualBoundingBoxLeft, x + m.actualBoundingBoxRight];
    const [y0, y1] = [y - m.actualBoundingBoxAscent, y + m.actualBoundingBoxDescent];
    const corners = [[x0, y0], [x1, y0], [x0, y1], [x1, y1]]
      .map(([cx, cy]) => [t.a * cx + t.c * cy + t.e, t.b * cx + t.d * cy + t.f]);
    const xs = corners.map((c) => c[0]);
    const ys = corners.map((c) => c[1]);
    const list = drawn.get(this.canvas) || [];
    list.push({ text: String(text), font: this.font, rotated: Math.abs(t.b) > 1e-9,
      left: Math.min(...xs), right: Math.max(...xs), top: Math.min(...ys), bottom: Math.max(...ys) });
    drawn.set(this.canvas, list);
    return fillText.call(this, text, x, y, ...rest);
  };
  P.clearRect = function (x, y, w, h) {
    if (x <= 0 && y <= 0 && w >= this.canvas.width && h >= this.canvas.height) drawn.set(this.canvas, []);
    return clearRect.call(this, x, y, w, h);
  };
  const width = Object.getOwnPropertyDescriptor(HTMLCanvasElement.prototype, "width");
  Object.defineProperty(HTMLCanvasElement.prototype, "width", {
    configurable: true, get: width.get, set(v) { drawn.set(this, []); width.set.call(this, v); },
  });
})()"""

# A canvas's drawn text and size in CSS pixels; for a uPlot chart, its plot area too (uPlot's
# overlay element covers it).
CANVAS_TEXT = """(canvas) => {
  const k = canvas.clientWidth / canvas.width;
  const texts = textsOf(canvas).map((t) =>
    ({ ...t, left: t.left * k, right: t.right * k, top: t.top * k, bottom: t.bottom * k }));
  const over = canvas.closest(".uplot") && canvas.closest(".uplot").querySelector(".u-over");
  const plot = over && { left: over.offsetLeft, top: over.offsetTop,
    right: over.offsetLeft + over.offsetWidth, bottom: over.offsetTop + over.offsetHeight };
  return { width: canvas.clientWidth, height: canvas.clientHeight, plot, texts };
}"""

LR = 0.006160940191909269  # as a sweep draws it from a log_uniform range
HEADS = 8  # 2 layers x 4 heads
RECORDED = {
    "name": "recorded",
    "model": {"arch": "gpt", "n_layer": 2, "n_head": 4, "d_model": 32, "seq_len": 32},
    "data": {"builtin": "synthetic"},
    "optimizer": {"name": "muonclip", "lr": LR, "qk_clip_tau": 30},
    "train": {"steps": 200, "batch_size": 8, "eval_every": 50, "checkpoint_every": 100},
}
START_S = 11.0  # a run's clock at its first report: the first evaluation and the device's warm-up


def values_at(spec: JobSpec, step: int) -> dict[str, float]:
    """What a MuonClip run of ``spec`` reports at ``step``: an update RMS near 0.002 and a gradient
    norm from 0.0005 to 0.0015 (small values, written with 4 or 5 decimals), a few heads clipped,
    a clock that reads START_S at the first step, val_loss at each evaluation."""
    steps, every = spec.train.steps, spec.train.eval_every
    loss = 1.2 + 3.0 * math.exp(-step / 40) + 0.08 * math.sin(step * 1.7)
    out = {
        metrics.LOSS: loss,
        metrics.LR: spec.optimizer.lr,
        metrics.GRAD_NORM: 0.0005 + 0.001 * step / steps,
        metrics.UPDATE_RMS: 0.00196 + 0.00001 * math.sin(step / 7),
        metrics.TOKENS_PER_S: 58_000.0 + 2_000 * math.sin(step / 9),
        metrics.STEP_TIME_MS: 4.0,
        metrics.ELAPSED_S: START_S + 0.05 * step,
        metrics.ATTN_MAX_LOGIT: 20.0 + 15.0 * step / steps,
        metrics.QK_CLIP_HEADS_CLIPPED: float(step % 4),
        metrics.QK_CLIP_MIN_GAMMA: 1.0 - 0.1 * (step % 4),
    }
    for layer in range(spec.model.n_layer):
        for head in range(spec.model.n_head):
            out[metrics.head_max_logit(layer, head)] = 10.0 + 3 * layer + head + 20.0 * step / steps
    if step % every == 0 or step == steps:
        out[metrics.VAL_LOSS] = loss + 0.05
    return {metrics.VAL_LOSS: out[metrics.VAL_LOSS]} if step == steps else out


def recorded_run(settings, key: str, spec: dict) -> str:
    """A job of ``spec`` that ran all its steps, each step's ``values_at`` stored as a worker
    stores them; returns its id."""
    job_id = stored_job(settings, key, spec)
    validated = JobSpec.model_validate(spec)
    bus = live_bus(settings)
    with transaction(settings) as session:
        claim = lifecycle.claim(session, bus, job_id, "recorded:0:run", timedelta(minutes=10))
    sink = JobSink(settings, job_id, claim.attempt, 0, {})
    steps, summary = validated.train.steps, {}
    for step in range(steps + 1):
        reported = report(step, values_at(validated, step))
        summary |= reported.summary
        sink.metrics(reported)
    sink.close()
    with transaction(settings) as session:
        lifecycle.finish(session, bus, job_id, claim.attempt, "succeeded", steps, summary)
    return job_id


@pytest.fixture(scope="module")
def runs(settings) -> dict[str, str]:
    """A tenant's key and two recorded runs: ``long`` (200 steps) and ``short`` (12 steps)."""
    key = new_key(settings)
    short = RECORDED | {"name": "recorded-short", "train": RECORDED["train"] | {"steps": 12, "eval_every": 4}}
    return {"key": key, "long": recorded_run(settings, key, RECORDED), "short": recorded_run(settings, key, short)}


def open_page(browser, key: str, path: str, width: int = 1400):
    page = browser.page(key, width=width)
    page.add_init_script(RECORD_TEXT)
    page.goto(f"{browser.url}{path}")
    page.wait_for_function("() => MF.shown && MF.shown.charts.length && MF.shown.charts.every((c) => c.hasData())")
    page.evaluate("() => new Promise((done) => requestAnimationFrame(() => requestAnimationFrame(done)))")
    return page


def side_of(text: dict, plot: dict) -> str | None:
    """Which axis a text beside the plot area belongs to; None for a text inside it."""
    if text["right"] <= plot["left"]:
        return "left"
    if text["left"] >= plot["right"]:
        return "right"
    return "bottom" if text["top"] >= plot["bottom"] else None


def chart(page, title: str | None = None) -> dict:
    """A chart's drawn text, sorted into its axes: for each of "left", "right" and "bottom", the
    axis title (drawn rotated beside the plot, bold under it) and the tick labels (in drawing
    order: ascending), and "all" of its text."""
    card = page.locator(f"section[data-chart='{title}']" if title else ".chart-card").first
    drawn = card.locator(".uplot canvas").evaluate(CANVAS_TEXT)
    axes = {side: {"title": None, "ticks": []} for side in ("left", "right", "bottom")}
    for t in drawn["texts"]:
        side = side_of(t, drawn["plot"])
        if side is None:
            continue  # inside the plot: a reference line's label
        is_title = t["rotated"] if side != "bottom" else "bold" in t["font"] or "700" in t["font"]
        if is_title:
            axes[side]["title"] = t["text"]
        else:
            axes[side]["ticks"].append(t["text"])
    return {**axes, "all": drawn["texts"], "width": drawn["width"], "height": drawn["height"]}


def assert_fits(drawn: dict, where: str) -> None:
    """Every text inside its canvas, and no two texts overlapping."""
    texts = drawn["all"]
    for t in texts:
        inside = t["left"] >= 0 and t["top"] >= 0 and t["right"] <= drawn["width"] and t["bottom"] <= drawn["height"]
        assert inside, f"{where}: {t['text']!r} is cut at the canvas's edge: {t}"
    for i, a in enumerate(texts):
        for b in texts[i + 1 :]:
            beside = a["right"] <= b["left"] or b["right"] <= a["left"]
            assert beside or a["bottom"] <= b["top"] or b["bottom"] <= a["top"], (
                f"{where}: {a['text']!r} overlaps {b['text']!r}"
            )


def number_format(label: str) -> tuple:
    """The format a tick label is written in: ("sci", exponent), ("fixed", decimals) or (suffix,
    decimals) for k, M and G."""
    if m := re.fullmatch(r"-?\d+(?:\.(\d+))?e(-?\d+)", label):
        return ("sci", int(m[2]), len(m[1] or ""))
    if m := re.fullmatch(r"-?\d+(?:\.(\d+))?([kMG]?)", label):
        return (m[2] or "fixed", len(m[1] or ""))
    raise AssertionError(f"not a number: {label!r}")


def assert_one_format(ticks: list[str], where: str) -> None:
    formats = {number_format(t) for t in ticks if t not in ("", "0")}
    assert len(formats) <= 1, f"{where}: ticks in several formats: {ticks}"


def test_every_chart_of_a_muonclip_run_titles_its_axes_and_fits_its_labels(browser, api_url, key, worker):
    job = submit(api_url, key, "labelled", steps=200)
    finished(api_url, key, job["id"])
    page = open_page(browser, key, f"/jobs/{job['id']}")
    page.wait_for_function("() => MF.shown.heatmap.max > 0")
    titles = page.locator("#charts section[data-chart]").evaluate_all("(s) => s.map((e) => e.dataset.chart)")
    assert "QK-Clip" in titles and "Muon update RMS" in titles
    for title in titles:
        drawn = chart(page, title)
        assert drawn["bottom"]["title"] == "step", title
        assert drawn["left"]["title"], f"{title}: no y axis title"
        assert_fits(drawn, title)
        for side in ("left", "right", "bottom"):
            assert_one_format(drawn[side]["ticks"], f"{title}, {side}")
    assert chart(page, "Loss")["left"]["title"] == "loss (nats/token)"
    assert chart(page, "Tokens/s")["left"]["title"] == "tokens_per_s"  # the name says the unit
    screenshot(page, "charts-job")


def test_an_axis_is_wide_enough_for_its_tick_labels(browser, runs):
    page = open_page(browser, runs["key"], f"/jobs/{runs['long']}", width=1000)
    rms = chart(page, "Muon update RMS")  # 0.00195 to 0.00197: "0.001950", never ".001950"
    assert rms["left"]["ticks"] and all(t.startswith("0.00") for t in rms["left"]["ticks"]), rms["left"]["ticks"]
    assert_fits(rms, "update rms")
    assert rms["left"]["title"] == "update_rms"


def test_an_axis_writes_its_ticks_in_one_format(browser, runs):
    page = open_page(browser, runs["key"], f"/jobs/{runs['long']}", width=1000)
    grad = chart(page, "Gradient norm (before clipping)")  # 0.0005 to 0.0015: 0.00050, 0.00075, 0.00100, ...
    assert len(grad["left"]["ticks"]) >= 3
    assert_one_format(grad["left"]["ticks"], "grad norm")
    assert_fits(grad, "grad norm")
    assert grad["left"]["title"] == "grad_norm"


def test_qk_clip_axes_are_titled_and_the_count_axis_runs_over_the_heads(browser, runs):
    page = open_page(browser, runs["key"], f"/jobs/{runs['long']}")
    drawn = chart(page, "QK-Clip")
    assert drawn["left"]["title"] == "heads clipped" and drawn["right"]["title"] == "min gamma"
    counts = drawn["left"]["ticks"]
    assert all(re.fullmatch(r"\d+", t) for t in counts), counts  # whole heads
    assert int(counts[0]) == 0 and int(counts[-1]) == HEADS  # 0 to every head of every layer
    assert float(drawn["right"]["ticks"][0]) == 0 and float(drawn["right"]["ticks"][-1]) == 1  # gamma in (0, 1]
    assert_fits(drawn, "QK-Clip")


def test_the_heatmap_labels_its_heads_and_has_a_step_axis(browser, runs):
    page = open_page(browser, runs["key"], f"/jobs/{runs['long']}")
    page.wait_for_function("() => MF.shown.heatmap.max > 0")
    drawn = page.locator("#heatmap canvas").evaluate(CANVAS_TEXT)
    texts = [t["text"] for t in drawn["texts"]]
    assert {"layer 0", "layer 1"} <= set(texts)
    assert texts.count("h0") == 2 and texts.count("h3") == 2  # every head of both layers
    assert "step" in texts
    ticks = [t for t in drawn["texts"] if re.fullmatch(r"[\d,]+", t["text"])]
    steps = [int(t["text"].replace(",", "")) for t in sorted(ticks, key=lambda t: t["left"])]
    assert steps[0] == 0 and steps[-1] == 200 and steps == sorted(steps) and len(steps) >= 3
    assert_fits({**drawn, "all": drawn["texts"]}, "heatmap")


def test_the_legend_names_the_smoothed_value_and_its_weight(browser, runs):
    page = open_page(browser, runs["key"], f"/jobs/{runs['long']}")
    loss = page.locator("section[data-chart='Loss'] .chart-legend .item").first
    assert re.fullmatch(r"loss [\d.]+ \(smoothed [\d.]+\)", loss.inner_text().strip()), loss.inner_text()
    assert "weight 0.60" in loss.locator(".smoothed").get_attribute("title")
    page.locator("#smoothing").fill("0")
    page.locator("#smoothing").dispatch_event("input")
    assert "smoothed" not in page.locator("section[data-chart='Loss'] .chart-legend").inner_text()


# The colour of every pixel 2 px left, right, above and below each point of a series: a marker
# covers all four, a line through the point at most two.
AROUND_POINTS = """([chartIndex, seriesIndex]) => {
  const u = MF.shown.charts[chartIndex].plot;
  const ctx = u.ctx;
  const out = [];
  u.data[0].forEach((x, i) => {
    const y = u.data[1 + 2 * seriesIndex][i];
    if (y === null) return;
    const px = Math.round(u.valToPos(x, "x", true));
    const py = Math.round(u.valToPos(y, u.series[1 + 2 * seriesIndex].scale, true));
    const rgb = (x, y) => Array.from(ctx.getImageData(x, y, 1, 1).data.slice(0, 3));
    out.push([[2, 0], [-2, 0], [0, 2], [0, -2]].map(([dx, dy]) => rgb(px + dx, py + dy)));
  });
  return out;
}"""
ORANGE = (0xE8, 0x59, 0x0C)  # the second series' colour (charts.js PALETTE)


def test_sparse_series_are_drawn_point_by_point_and_not_smoothed(browser, runs):
    page = open_page(browser, runs["key"], f"/jobs/{runs['long']}", width=1000)
    around = page.evaluate(AROUND_POINTS, [0, 1])  # the Loss chart's val_loss
    assert len(around) == 5  # evaluations at 0, 50, ..., 200
    for pixels in around:
        assert all(max(abs(a - b) for a, b in zip(p, ORANGE)) < 40 for p in pixels), pixels
    items = page.locator("section[data-chart='Loss'] .chart-legend .item").all_inner_texts()
    assert "(smoothed" in items[0] and re.fullmatch(r"val_loss [\d.]+", items[1].strip()), items
    # On the compare page too: the bold line of a few evaluations is the evaluations themselves.
    page = open_page(browser, runs["key"], f"/compare?jobs={runs['long']}")
    page.locator("#metric").fill("val_loss")
    page.locator("#metric").dispatch_event("change")
    page.wait_for_function("() => MF.shown.charts[0].plot.data[1].filter((v) => v !== null).length === 5")
    legend = page.locator(".chart-legend .item").first.inner_text()
    assert "smoothed" not in legend and "~" not in legend, legend
    screenshot(page, "charts-compare-val-loss")


def test_step_ticks_are_whole_steps(browser, runs):
    for path in (f"/jobs/{runs['short']}", f"/compare?jobs={runs['short']}"):  # 12 steps on a wide chart
        page = open_page(browser, runs["key"], path)
        ticks = chart(page)["bottom"]["ticks"]
        assert len(ticks) >= 3 and all(re.fullmatch(r"\d+", t) for t in ticks), (path, ticks)


def test_compare_writes_hyperparameters_as_the_sweep_page_does(browser, runs):
    page = open_page(browser, runs["key"], f"/compare?jobs={runs['long']},{runs['short']}")
    assert page.locator("#jobs tbody tr td:nth-child(6)").all_inner_texts() == ["0.006161", "0.006161"]
    assert "muonclip lr 0.006161" in page.locator(".chart-legend").inner_text()
    assert page.evaluate(f"MF.fmt.param({LR})") == "0.006161"  # what the sweep page writes
    drawn = chart(page)
    assert drawn["left"]["title"] == "loss (nats/token)" and drawn["bottom"]["title"] == "step"
    assert_fits(drawn, "compare")
    screenshot(page, "charts-compare")


def test_wall_time_counts_from_the_first_step(browser, runs):
    for path in (f"/jobs/{runs['long']}", f"/compare?jobs={runs['long']}"):
        page = open_page(browser, runs["key"], path)
        page.locator("#x-axis").select_option("time")
        page.wait_for_function(
            "() => textsOf(document.querySelector('.chart-card .uplot canvas')).some((t) => t.text.startsWith('wall'))"
        )
        drawn = chart(page)
        assert drawn["bottom"]["title"] == "wall time since the first step (s)", path
        ticks = [float(t) for t in drawn["bottom"]["ticks"]]  # left to right
        assert ticks[0] == 0 and ticks[-1] <= 10, (path, ticks)  # the first step at 0 s, not START_S; 200 x 0.05 s
        screenshot(page, f"charts-time-{path.split('/')[1].split('?')[0]}")
