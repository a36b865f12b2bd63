"""The web app in real headless Chromium against a real API process on this machine's Postgres and
Redis: how soon a page draws its curves, and what following a running job costs the browser.

    .venv/bin/python bench/web.py [--part all|finished|live|compare] [--live-minutes 10] [--quick] [--json PATH]

1. finished: a succeeded job of 1,000,000 steps holding 21 series (every step's training
   metrics, the per-layer and per-head max logits of a 2-layer, 4-head gpt under MuonClip, and
   val_loss every 1,000 steps), stored through the service's ingest. Its page is opened in a
   fresh browser context each time (nothing cached): time from navigation to the first curves
   drawn (performance marks the page sets one frame after drawing), and to every chart and the
   heatmap; then a zoom on a 5,000-step range, from the request to the curves drawn.
2. live: the same 21 series emitted by a worker-side sink (a separate process, as in a worker)
   at 20 telemetry steps a second for --live-minutes while the page follows the job: every step
   must be drawn; the page's JS heap after a forced GC at the start and at the end (growth), and
   the main thread's busy share (Chromium's TaskDuration over wall time).
3. compare: 10 succeeded jobs of 100,000 steps each (loss); the compare page from navigation to
   the overlaid curves drawn.

Targets (issue: web app): first curves <= 1.0 s, zoom <= 300 ms; live: every step shown, heap
growth < 20 MB, main thread busy < 20%; compare <= 1.5 s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from stack import ROOT, Stack
from telemetry import running_job, settings_of, step_report

from app.db.session import transaction
from app.messaging.live_bus import live_bus
from app.services import lifecycle
from app.services.metric_history import store_metrics
from app.settings import Settings
from contract import metrics
from tests.support.browser import CHROMIUM, LAUNCH_ARGS
from worker.sink import JobSink

REDIS = "redis://127.0.0.1:6379/11"
SETTINGS = {
    "MUONFORGE_TENANT_JOB_CAP": "1000",
    "MUONFORGE_TENANT_RATE_PER_SECOND": "0",
    "MUONFORGE_TENANT_STREAM_CAP": "100000",
}
TARGETS = {"first_curves_s": 1.0, "zoom_s": 0.3, "heap_growth_mb": 20.0, "busy": 0.20, "compare_s": 1.5}
LAYERS, HEADS, TAU, VAL_EVERY = 2, 4, 100.0, 1000
SPEC = {  # the job the pages show: its charts and heatmap follow from it
    "model": {"arch": "gpt", "n_layer": LAYERS, "n_head": HEADS, "d_model": 64, "seq_len": 64},
    "data": {"builtin": "synthetic"},
    "optimizer": {"name": "muonclip", "qk_clip_tau": TAU},
}


# -- telemetry that looks like training ---------------------------------------------------------
def series_names() -> list[str]:
    """The 20 series every step carries (val_loss, the 21st, comes every VAL_EVERY steps)."""
    heads = [metrics.head_max_logit(i, j) for i in range(LAYERS) for j in range(HEADS)]
    layers = [metrics.layer_max_logit(i) for i in range(LAYERS)]
    every_step = (metrics.LOSS, metrics.LR, metrics.GRAD_NORM, metrics.UPDATE_RMS, metrics.TOKENS_PER_S)
    timing = (metrics.STEP_TIME_MS, metrics.ELAPSED_S, metrics.ATTN_MAX_LOGIT)
    clip = (metrics.QK_CLIP_HEADS_CLIPPED, metrics.QK_CLIP_MIN_GAMMA)
    return [*every_step, *timing, *clip, *layers, *heads]


def block(first: int, count: int, rng: np.random.Generator) -> list[tuple[int, dict[str, float]]]:
    """Telemetry steps [first, first + count): decaying loss with noise, logits growing to tau."""
    s = np.arange(first, first + count, dtype=np.float64)
    noise = lambda scale: rng.normal(0.0, scale, count)  # noqa: E731
    loss = 1.3 + 3.0 * np.exp(-s / 2e4) + noise(0.05)
    logit = np.minimum(TAU, 5 + 95 * (1 - np.exp(-s / 3e5))) + noise(1.0)
    columns = {
        "loss": loss,
        "lr": np.full(count, 0.02),
        "grad_norm": 0.3 + 0.7 * np.exp(-s / 1e4) + noise(0.02),
        "update_rms": 0.0019 + noise(1e-5),
        "tokens_per_s": 42_000 + noise(800),
        "step_time_ms": 48 + noise(2),
        "elapsed_s": s * 0.05,
        "attn_max_logit": logit,
        "qk_clip/heads_clipped": (logit > TAU - 1) * 1.0,
        "qk_clip/min_gamma": np.minimum(1.0, TAU / np.maximum(logit, 1e-9)),
    }
    for i in range(LAYERS):
        columns[f"attn_max_logit/l{i}"] = logit - i
        for j in range(HEADS):
            columns[f"attn_max_logit/l{i}h{j}"] = logit * (0.6 + 0.1 * j) - i + noise(0.5)
    names = series_names()
    rows = np.stack([columns[n] for n in names], axis=1).tolist()
    out = []
    for k, row in enumerate(rows):
        values = dict(zip(names, row))
        if (first + k) % VAL_EVERY == 0:
            values["val_loss"] = values["loss"] + 0.02
        out.append((first + k, values))
    return out


def stored_job(settings: Settings, key: str, steps: int, names: list[str] | None = None, seed: int = 0) -> str:
    """A succeeded job whose telemetry of ``steps`` steps is stored through the service's ingest."""
    job_id, attempt = running_job(settings, key, steps=steps)
    rng = np.random.default_rng(seed)
    for first in range(0, steps, 20_000):
        batch = block(first, min(20_000, steps - first), rng)
        if names is not None:
            batch = [(s, {k: v for k, v in values.items() if k in names}) for s, values in batch]
        with transaction(settings) as session:
            store_metrics(session, job_id, batch)
    with transaction(settings) as session:
        lifecycle.finish(session, live_bus(settings), job_id, attempt, "succeeded", steps, {})
    return job_id


def emit_main(argv: list[str]) -> None:
    """The worker side of the live part (its own process): RATE steps a second for SECONDS."""
    job_id, attempt, rate, seconds = argv[0], int(argv[1]), float(argv[2]), float(argv[3])
    settings = Settings()
    sink = JobSink(settings, job_id, attempt, 0, {})
    steps = int(rate * seconds)
    telemetry = block(0, steps, np.random.default_rng(1))
    start = time.perf_counter()
    for step, values in telemetry:
        delay = start + step / rate - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        sink.metrics(step_report(step, values))
    sink.close()
    with transaction(settings) as session:
        lifecycle.finish(session, live_bus(settings), job_id, attempt, "succeeded", steps, sink.summary)


# -- the browser --------------------------------------------------------------------------------
class Chromium:
    def __init__(self, url: str, key: str) -> None:
        from playwright.sync_api import sync_playwright

        self.url, self.key = url, key
        self._p = sync_playwright().start()
        self.browser = self._p.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)

    def page(self):
        """A fresh context (empty cache), signed in through the API (the session cookie)."""
        context = self.browser.new_context(viewport={"width": 1400, "height": 900})
        context.request.post(f"{self.url}/v1/session", data={"api_key": self.key})
        page = context.new_page()
        page.errors = []
        page.on("pageerror", lambda e: page.errors.append(str(e)))
        page.on("console", lambda m: m.type == "error" and page.errors.append(m.text))
        return page

    def close(self) -> None:
        self.browser.close()
        self._p.stop()


def mark(page, name: str, timeout_s: float = 60.0) -> float:
    """Seconds from navigation to the performance mark ``name`` (waits for it)."""
    page.wait_for_function(f"() => performance.getEntriesByName('{name}').length > 0", timeout=timeout_s * 1e3)
    return page.evaluate(f"performance.getEntriesByName('{name}')[0].startTime") / 1e3


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": len(values)}


# -- parts ----------------------------------------------------------------------------------------
def finished_part(stack: Stack, browser: Chromium, steps: int, repeats: int) -> dict[str, Any]:
    settings = settings_of(stack)
    t0 = time.perf_counter()
    job_id = stored_job(settings, browser.key, steps)
    ingest_s = time.perf_counter() - t0
    first, full, zoom = [], [], []
    for _ in range(repeats):
        page = browser.page()
        page.goto(f"{browser.url}/jobs/{job_id}")
        first.append(mark(page, "mf:first-curves"))
        full.append(mark(page, "mf:all-curves"))
        lo = steps // 2
        page.evaluate(f"MF.shown.charts[0].onZoom({lo}, {lo + 5_000})")
        mark(page, "mf:zoom-drawn")
        zoom.append(
            page.evaluate(
                "performance.getEntriesByName('mf:zoom-drawn')[0].startTime"
                " - performance.getEntriesByName('mf:zoom-asked')[0].startTime"
            )
            / 1e3
        )
        drawn = page.evaluate("MF.shown.charts[0].plot.data[0].length")
        zoomed = page.evaluate("MF.shown.charts[0].zoomed.table.steps.length")
        width = page.evaluate("MF.shown.charts[0].width")
        assert not page.errors, page.errors
        page.context.close()
    return {
        "steps": steps,
        "series": len(series_names()) + 1,
        "ingest_s": ingest_s,
        "first_curves_s": summary(first),
        "all_curves_s": summary(full),
        "zoom_s": summary(zoom),
        "overview_points": drawn,
        "zoom_points": zoomed,
        "chart_px": width,
    }


def cdp_metrics(cdp) -> dict[str, float]:
    return {m["name"]: m["value"] for m in cdp.send("Performance.getMetrics")["metrics"]}


def heap_mb(cdp) -> float:
    cdp.send("HeapProfiler.collectGarbage")
    return cdp_metrics(cdp)["JSHeapUsedSize"] / 2**20


def live_part(stack: Stack, browser: Chromium, minutes: float, rate: float) -> dict[str, Any]:
    settings = settings_of(stack)
    seconds = minutes * 60
    steps = int(rate * seconds)
    job_id, attempt = running_job(settings, browser.key, steps=steps)
    page = browser.page()
    page.goto(f"{browser.url}/jobs/{job_id}")
    mark(page, "mf:all-curves")
    page.wait_for_timeout(1000)  # the events stream is open
    cdp = page.context.new_cdp_session(page)
    cdp.send("Performance.enable")
    heap0 = heap_mb(cdp)
    start = cdp_metrics(cdp)
    cmd = [sys.executable, __file__, "--emit", job_id, str(attempt), str(rate), str(seconds)]
    emitter = subprocess.Popen(cmd, env=stack.env, cwd=ROOT)
    t0 = time.perf_counter()
    samples = []
    while emitter.poll() is None:
        time.sleep(10)
        samples.append((time.perf_counter() - t0, page.evaluate("MF.shown.charts[0].table.steps.length")))
    page.locator("#job-status", has_text="succeeded").wait_for(timeout=60_000)
    page.wait_for_timeout(1000)  # the last redraw
    end = cdp_metrics(cdp)
    wall = end["Timestamp"] - start["Timestamp"]
    busy = (end["TaskDuration"] - start["TaskDuration"]) / wall
    heap1 = heap_mb(cdp)
    drawn = page.evaluate("MF.shown.charts[0].plot.data[1].filter((v) => v !== null).length")
    assert not page.errors, page.errors
    page.context.close()
    return {
        "rate": rate,
        "seconds": seconds,
        "steps": steps,
        "loss_points_drawn": drawn,
        "every_step_shown": drawn == steps,
        "heap_start_mb": heap0,
        "heap_end_mb": heap1,
        "heap_growth_mb": heap1 - heap0,
        "main_thread_busy": busy,
        "wall_s": wall,
        "script_s": end["ScriptDuration"] - start["ScriptDuration"],
        "progress": samples,
    }


def compare_part(stack: Stack, browser: Chromium, jobs: int, steps: int, repeats: int) -> dict[str, Any]:
    settings = settings_of(stack)
    ids = [stored_job(settings, browser.key, steps, names=["loss", "elapsed_s"], seed=i) for i in range(jobs)]
    drawn_s = []
    for _ in range(repeats):
        page = browser.page()
        page.goto(f"{browser.url}/compare?jobs={','.join(ids)}")
        drawn_s.append(mark(page, "mf:compare-drawn"))
        series = page.evaluate("MF.shown.charts[0].plot.data.length - 1") // 2
        assert series == jobs and not page.errors, (series, page.errors)
        page.context.close()
    return {"jobs": jobs, "steps": steps, "drawn_s": summary(drawn_s)}


def report(out: dict[str, Any]) -> None:
    print(f"\nChromium {out['chromium']}, one API process")
    if "finished" in out:
        r = out["finished"]
        print(f"finished job: {r['steps']:,} steps x {r['series']} series (ingested in {r['ingest_s']:.0f} s)")
        for label, key in (
            ("first curves drawn", "first_curves_s"),
            ("every chart drawn", "all_curves_s"),
            ("5,000-step zoom drawn", "zoom_s"),
        ):
            x = r[key]
            print(
                f"  {label:<24} median {x['median']:.3f} s  (min {x['min']:.3f}, max {x['max']:.3f}, {x['runs']} runs)"
            )
        print(
            f"  points drawn on a {r['chart_px']} px chart: overview {r['overview_points']} (min, max and last per "
            f"bucket), 5,000-step zoom {r['zoom_points']} (every step once a range has fewer steps than pixels)"
        )
        ok = r["first_curves_s"]["median"] <= TARGETS["first_curves_s"] and r["zoom_s"]["median"] <= TARGETS["zoom_s"]
        print(f"  target first curves <= 1.0 s, zoom <= 300 ms: {'met' if ok else 'NOT met'}")
    if "live" in out:
        r = out["live"]
        print(f"live job: {r['rate']:.0f} steps/s for {r['seconds']:.0f} s ({r['steps']:,} steps)")
        print(f"  every step shown: {r['every_step_shown']} ({r['loss_points_drawn']:,} loss points drawn)")
        print(
            f"  JS heap after GC: {r['heap_start_mb']:.1f} MB -> {r['heap_end_mb']:.1f} MB "
            f"(growth {r['heap_growth_mb']:.1f} MB)"
        )
        print(
            f"  main thread busy: {100 * r['main_thread_busy']:.1f}% "
            f"(script {r['script_s']:.1f} s of {r['wall_s']:.0f} s)"
        )
        ok = (
            r["every_step_shown"]
            and r["heap_growth_mb"] < TARGETS["heap_growth_mb"]
            and r["main_thread_busy"] < TARGETS["busy"]
        )
        print(f"  target every step, heap < 20 MB, busy < 20%: {'met' if ok else 'NOT met'}")
    if "compare" in out:
        r = out["compare"]
        x = r["drawn_s"]
        print(
            f"compare: {r['jobs']} jobs x {r['steps']:,} steps drawn: median {x['median']:.3f} s "
            f"(min {x['min']:.3f}, max {x['max']:.3f}, {x['runs']} runs)"
        )
        print(f"  target <= 1.5 s: {'met' if x['median'] <= TARGETS['compare_s'] else 'NOT met'}")


def main() -> None:
    if sys.argv[1:2] == ["--emit"]:
        emit_main(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("all", "finished", "live", "compare"), default="all")
    parser.add_argument("--steps", type=int, default=1_000_000, help="finished: the job's steps")
    parser.add_argument("--repeats", type=int, default=5, help="page loads per measurement")
    parser.add_argument("--live-minutes", type=float, default=10.0)
    parser.add_argument("--rate", type=float, default=20.0, help="live: telemetry steps a second")
    parser.add_argument("--compare-jobs", type=int, default=10)
    parser.add_argument("--compare-steps", type=int, default=100_000)
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.quick:
        args.steps, args.repeats, args.live_minutes, args.compare_steps = 100_000, 2, 0.5, 10_000
    parts = ("finished", "live", "compare") if args.part == "all" else (args.part,)
    out: dict[str, Any] = {"settings": {k: str(v) for k, v in vars(args).items()}}
    with Stack("web", REDIS, SETTINGS) as stack:
        key = stack.api_key("web")
        url = stack.start_api()
        browser = Chromium(url, key)
        out["chromium"] = browser.browser.version
        try:
            for part in parts:
                t0 = time.perf_counter()
                if part == "finished":
                    out["finished"] = finished_part(stack, browser, args.steps, args.repeats)
                elif part == "live":
                    out["live"] = live_part(stack, browser, args.live_minutes, args.rate)
                else:
                    out["compare"] = compare_part(stack, browser, args.compare_jobs, args.compare_steps, args.repeats)
                print(f"[{part} took {time.perf_counter() - t0:.0f} s]", flush=True)
        finally:
            browser.close()
    report(out)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2, default=str))


if __name__ == "__main__":
    main()
