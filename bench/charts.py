"""Which charting library draws 100,000-point series faster in a real browser: uPlot (what the web
app uses, from app/web/node_modules) against plotly.js (the bundle inside PyPI's ``plotly``
package), side by side in one run in headless Chromium.

    .venv/bin/python bench/charts.py [--points 100000] [--series 1,5] [--rounds 5] [--json PATH]

Each round opens a fresh page per contender (interleaved, nothing cached between pages), builds
the same deterministic loss-like series in the page (so data transfer is not timed), and
measures from the call that creates the chart to the frame after it is drawn; then a zoom to a
2% x range, from the request to the frame after the redraw; and the JS heap after a forced GC.
Contenders: uPlot (canvas 2D), plotly ``scatter`` (SVG) and plotly ``scattergl`` (WebGL;
Chromium runs it on its software GL here, as a server without a GPU would).
"""

from __future__ import annotations

import argparse
import functools
import http.server
import json
import shutil
import statistics
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
UPLOT = ROOT / "app" / "web" / "node_modules" / "uplot" / "dist"
CHROMIUM = "/usr/bin/chromium"
LAUNCH_ARGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-background-networking",
    "--enable-unsafe-swiftshader",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--js-flags=--expose-gc",
    "--enable-precise-memory-info",
]

# The page: the same series for every contender, then one chart, one zoom, one heap reading.
PAGE = """<!doctype html><html><head><meta charset="utf-8">
<link rel="stylesheet" href="uPlot.min.css"><script src="%(script)s"></script></head>
<body style="margin:0"><div id="chart" style="width:1200px;height:400px"></div><script>
const N = %(points)d, S = %(series)d, LIB = "%(lib)s";
function series(seed) {  // a falling, noisy loss curve (xorshift noise, the same in every page)
  let x = seed * 2654435761 >>> 0 || 1; const y = new Float64Array(N);
  for (let i = 0; i < N; i++) {
    x ^= x << 13; x >>>= 0; x ^= x >>> 17; x ^= x << 5; x >>>= 0;
    y[i] = 2.0 + 3.0 * Math.exp(-i / (N / 8)) + 0.15 * (x / 4294967296 - 0.5) + 0.05 * seed;
  }
  return y;
}
const xs = new Float64Array(N); for (let i = 0; i < N; i++) xs[i] = i + 1;
const ys = Array.from({length: S}, (_, s) => series(s + 1));
const frame = () => new Promise(r => requestAnimationFrame(() => setTimeout(r, 0)));
async function draw() {
  const el = document.getElementById("chart"), t0 = performance.now();
  let zoom;
  if (LIB === "uplot") {
    const u = new uPlot({width: 1200, height: 400, scales: {x: {time: false}},
      series: [{}, ...ys.map((_, i) => ({label: "s" + i, stroke: "hsl(" + i * 60 + ",70%%,45%%)"}))]},
      [xs, ...ys], el);
    zoom = (a, b) => { u.setScale("x", {min: a, max: b}); };
  } else {
    const traces = ys.map((y, i) => ({x: xs, y: y, type: LIB, mode: "lines", name: "s" + i}));
    await Plotly.newPlot(el, traces, {width: 1200, height: 400, margin: {t: 10}}, {staticPlot: false});
    zoom = (a, b) => Plotly.relayout(el, {"xaxis.range": [a, b]});
  }
  await frame();
  const drawn = performance.now() - t0;
  const z0 = performance.now();
  await zoom(N * 0.49, N * 0.51);
  await frame();
  const zoomed = performance.now() - z0;
  if (window.gc) { window.gc(); window.gc(); }
  return {draw_ms: drawn, zoom_ms: zoomed, heap_mb: performance.memory.usedJSHeapSize / 2 ** 20,
          canvas: !!el.querySelector("canvas"), svg_paths: el.querySelectorAll("path").length};
}
window.result = draw().catch(e => ({error: String(e)}));
</script></body></html>
"""


def serve(directory: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    handler = functools.partial(_QuietHandler, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


def plotly_bundle() -> Path:
    try:
        import plotly
    except ImportError as exc:
        raise SystemExit("bench/charts.py needs the plotly package (its plotly.js bundle): pip install plotly") from exc
    return Path(plotly.__file__).parent / "package_data" / "plotly.min.js"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--points", type=int, default=100_000)
    ap.add_argument("--series", default="1,5", help="series per chart, comma-separated")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright

    site = Path(tempfile.mkdtemp(prefix="charts-"))
    for name in ("uPlot.iife.min.js", "uPlot.min.css"):
        shutil.copy(UPLOT / name, site / name)
    shutil.copy(plotly_bundle(), site / "plotly.min.js")
    contenders = {"uplot": "uPlot.iife.min.js", "scatter": "plotly.min.js", "scattergl": "plotly.min.js"}
    counts = [int(s) for s in args.series.split(",")]
    for lib, script in contenders.items():
        for s in counts:
            page = PAGE % {"script": script, "points": args.points, "series": s, "lib": lib}
            (site / f"{lib}-{s}.html").write_text(page)
    server, url = serve(site)
    results: dict[str, list[dict]] = {}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
        for _ in range(args.rounds):
            for s in counts:
                for lib in contenders:  # interleaved: every contender once per round
                    context = browser.new_context(viewport={"width": 1280, "height": 600})
                    page = context.new_page()
                    page.goto(f"{url}/{lib}-{s}.html")
                    out = page.evaluate("window.result")
                    context.close()
                    if "error" in out:
                        raise SystemExit(f"{lib} with {s} series: {out['error']}")
                    results.setdefault(f"{lib}/{s}", []).append(out)
        version = browser.version
        browser.close()
    server.shutdown()
    shutil.rmtree(site)

    print(f"Chromium {version}, headless; {args.points:,} points per series, {args.rounds} rounds, medians")
    print(f"{'series':>6}  {'library':<18}{'draw ms':>9}{'zoom ms':>9}{'heap MB':>9}{'draw x uPlot':>14}")
    table = []
    for s in counts:
        base = statistics.median(r["draw_ms"] for r in results[f"uplot/{s}"])
        for lib in contenders:
            rows = results[f"{lib}/{s}"]
            row = {
                "series": s,
                "library": {"uplot": "uPlot", "scatter": "plotly scatter", "scattergl": "plotly scattergl"}[lib],
                "draw_ms": statistics.median(r["draw_ms"] for r in rows),
                "zoom_ms": statistics.median(r["zoom_ms"] for r in rows),
                "heap_mb": statistics.median(r["heap_mb"] for r in rows),
            }
            row["draw_ratio"] = row["draw_ms"] / base
            table.append(row)
            print(
                f"{s:>6}  {row['library']:<18}{row['draw_ms']:>9.0f}{row['zoom_ms']:>9.0f}"
                f"{row['heap_mb']:>9.1f}{row['draw_ratio']:>13.1f}x"
            )
    if args.json:
        args.json.write_text(json.dumps({"chromium": version, "points": args.points, "rows": table}, indent=2))


if __name__ == "__main__":
    main()
