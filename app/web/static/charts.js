// MF.Chart: a uPlot line chart of step series, shared by the job and compare pages.
//
// A chart keeps its series aligned on the union of their steps (a column per series, null where
// a series has no point): the history the API downsampled to the chart's pixel width, then the
// live points appended one step at a time. It draws them against step, tokens or wall time (as
// the page's view says), with an EMA of each series over its faint raw curve when smoothing is
// on. A zoom asks the page for that step range at full resolution; the page hands
// the points back with showZoom and the chart keeps them until resetZoom.
"use strict";

(function () {
  const PALETTE = ["#3056d3", "#e8590c", "#2b8a3e", "#c2255c", "#7048e8", "#0b7285", "#a61e4d", "#5c940d",
    "#1864ab", "#d9480f", "#087f5b", "#862e9c", "#e67700", "#364fc7", "#c92a2a", "#2f9e44", "#495057",
    "#f08c00", "#0c8599", "#9c36b5"];
  const REDRAW_MS = 250; // live points are drawn at most this often per chart (4 frames a second)

  function color(i) {
    return PALETTE[i % PALETTE.length];
  }

  function withAlpha(hex, alpha) {
    const n = parseInt(hex.slice(1), 16);
    return `rgba(${n >> 16}, ${(n >> 8) & 255}, ${n & 255}, ${alpha})`;
  }

  // Debiased exponential moving average (TensorBoard's smoothing), weighted by x distance: a point
  // ``gap`` x units after the previous one keeps weight ** (gap / unit) of the average, so a sparse
  // series (val_loss, every eval) is smoothed as little as its spacing warrants, not point by point.
  function ema(values, weight, xs = null, unit = 1) {
    const out = new Array(values.length);
    let last = 0;
    let norm = 0; // the weights' sum: dividing by it removes the start's bias toward 0
    let prev = null;
    for (let i = 0; i < values.length; i++) {
      const v = values[i];
      if (v === null || !Number.isFinite(v)) {
        out[i] = null;
        continue;
      }
      const w = xs && prev !== null ? Math.pow(weight, Math.max(0, xs[i] - xs[prev]) / unit) : weight;
      last = last * w + (1 - w) * v;
      norm = norm * w + (1 - w);
      out[i] = last / norm;
      prev = i;
    }
    return out;
  }

  // The typical x gap of a table (the median over its steps): the unit of the EMA's distance.
  function typicalGap(xs) {
    if (xs.length < 2) return 1;
    const gaps = [];
    for (let i = 1; i < xs.length; i++) gaps.push(xs[i] - xs[i - 1]);
    gaps.sort((a, b) => a - b);
    return gaps[gaps.length >> 1] || 1;
  }

  // Series ([[step, value], ...] each, ascending) aligned on the union of their steps: {steps,
  // columns}, a column per series with null where it has no point.
  function align(seriesPoints) {
    const steps = [...new Set(seriesPoints.flatMap((pts) => pts.map((p) => p[0])))].sort((a, b) => a - b);
    const index = new Map(steps.map((s, i) => [s, i]));
    const columns = seriesPoints.map((pts) => {
      const col = new Array(steps.length).fill(null);
      for (const [s, v] of pts) col[index.get(s)] = v;
      return col;
    });
    return { steps, columns };
  }

  function formatTick(v) {
    if (v === null || v === undefined) return "";
    const a = Math.abs(v);
    if (a !== 0 && (a >= 1e6 || a < 1e-3)) return v.toExponential(1);
    if (a >= 1e3) return `${+(v / 1e3).toFixed(1)}k`;
    return String(+v.toPrecision(4));
  }

  class Chart {
    // spec: {title, series: [{name, label, color?, scale?: "y" | "y2"}], refLine?: {value, label},
    // height?}; view: {smoothing, logY, xLabel, x(step) -> x value, step(x) -> step};
    // onZoom(loStep, hiStep) asks for that range at full resolution.
    constructor(container, spec, view, onZoom) {
      this.container = container;
      this.spec = spec;
      this.view = view;
      this.onZoom = onZoom;
      this.table = align([]); // the overview: history, then live points, aligned on their steps
      this.zoomed = null; // {table, lo, hi} while zoomed
      this.plot = null;
      this.pending = null;
      this.width = Math.max(200, Math.floor(container.clientWidth));
      new ResizeObserver(() => this.resize()).observe(container);
    }

    get names() {
      return this.spec.series.map((s) => s.name);
    }

    // The history: {name: [[step, value], ...]} for this chart's series (others ignored).
    setHistory(history) {
      this.table = align(this.names.map((n) => history[n] || []));
      this.rebuild();
    }

    // A live telemetry step: its values for this chart's series, drawn soon. Steps come in
    // order, so a step is appended to the aligned columns in O(series).
    append(step, values) {
      const names = this.names;
      if (!names.some((n) => values[n] !== undefined)) return;
      const { steps, columns } = this.table;
      const last = steps.length ? steps[steps.length - 1] : -1;
      if (step < last) return; // drawn already (the history and the stream overlap)
      if (step > last) {
        steps.push(step);
        names.forEach((n, i) => columns[i].push(values[n] ?? null));
      } else {
        names.forEach((n, i) => {
          if (values[n] !== undefined) columns[i][columns[i].length - 1] = values[n];
        });
      }
      if (!this.zoomed) this.scheduleRedraw();
    }

    showZoom(history, lo, hi) {
      this.zoomed = { table: align(this.names.map((n) => history[n] || [])), lo, hi };
      this.rebuild();
    }

    resetZoom() {
      this.zoomed = null;
      this.rebuild();
    }

    setView(view) {
      this.view = view;
      this.rebuild();
    }

    hasData() {
      return this.table.steps.length > 0;
    }

    scheduleRedraw() {
      if (this.pending) return;
      this.pending = setTimeout(() => {
        this.pending = null;
        this.redraw();
      }, REDRAW_MS);
    }

    // The uPlot data of what is shown: x, then per series its raw and its smoothed column.
    data() {
      const { steps, columns } = this.zoomed ? this.zoomed.table : this.table;
      const { smoothing, logY } = this.view;
      const out = [steps.map(this.view.x)];
      const unit = typicalGap(steps);
      for (const col of columns) {
        const raw = logY ? col.map((v) => (v !== null && v > 0 ? v : null)) : col;
        out.push(raw, smoothing > 0 ? ema(raw, smoothing, steps, unit) : new Array(raw.length).fill(null));
      }
      return out;
    }

    redraw() {
      if (!this.plot) return this.rebuild();
      this.plot.setData(this.data(), !this.zoomed);
      if (this.zoomed) this.plot.setScale("x", { min: this.view.x(this.zoomed.lo), max: this.view.x(this.zoomed.hi) });
    }

    options() {
      const { smoothing, logY, xLabel } = this.view;
      const series = [{ label: xLabel, value: (_, v) => (v === null ? "–" : formatTick(v)) }];
      this.spec.series.forEach((s, i) => {
        const c = s.color || color(i);
        const common = { scale: s.scale || "y", spanGaps: true, points: { show: false } };
        series.push({ ...common, label: s.label || s.name, stroke: smoothing > 0 ? withAlpha(c, 0.25) : c, width: 1.25 });
        series.push({ ...common, label: `${s.label || s.name} (smoothed)`, stroke: c, width: 2, show: smoothing > 0 });
      });
      const scales = { x: { time: false }, y: { distr: logY ? 3 : 1 } };
      const axes = [
        { label: xLabel, values: (_, ticks) => ticks.map(formatTick), size: 40, labelSize: 18, labelGap: 0 },
        { values: (_, ticks) => ticks.map(formatTick), size: 56 },
      ];
      if (this.spec.series.some((s) => s.scale === "y2")) {
        scales.y2 = { distr: 1 };
        axes.push({ scale: "y2", side: 1, grid: { show: false }, values: (_, ticks) => ticks.map(formatTick), size: 50 });
      }
      const ref = this.spec.refLine;
      return {
        width: this.width,
        height: this.spec.height || 230,
        series,
        scales,
        axes,
        legend: { show: false },
        cursor: { sync: { key: "mf-steps" }, drag: { x: true, y: false, setScale: false }, points: { size: 5 } },
        hooks: {
          setSelect: [(u) => this.selected(u)],
          setCursor: [(u) => this.updateLegend(u)],
          setData: [(u) => this.updateLegend(u)],
          draw: ref ? [(u) => this.drawRefLine(u, ref)] : [],
          ready: [(u) => u.over.addEventListener("dblclick", () => this.onZoom(null, null))],
        },
      };
    }

    rebuild() {
      const data = this.data();
      if (this.plot) this.plot.destroy();
      this.legend = document.createElement("div");
      this.legend.className = "chart-legend";
      this.container.replaceChildren();
      this.plot = new uPlot(this.options(), data, this.container);
      this.container.append(this.legend);
      if (this.zoomed) this.plot.setScale("x", { min: this.view.x(this.zoomed.lo), max: this.view.x(this.zoomed.hi) });
      this.updateLegend(this.plot);
    }

    // Each series' label and value: at the cursor, else the last point shown; the x value first.
    // The value is the raw one; the smoothed one follows it, lighter, while smoothing is on.
    updateLegend(u) {
      if (!this.legend) return;
      const data = u.data;
      const smoothed = this.view.smoothing > 0;
      const at = (column) => {
        const idx = u.cursor.idx;
        if (idx !== null && idx !== undefined) return column[idx];
        for (let i = column.length - 1; i >= 0; i--) if (column[i] !== null) return column[i];
        return null;
      };
      const cursorX = u.cursor.idx !== null && u.cursor.idx !== undefined ? data[0][u.cursor.idx] : null;
      const items = [MF.el("span", { class: "x" }, cursorX === null ? "" : `${this.view.xLabel} ${formatTick(cursorX)}`)];
      this.spec.series.forEach((s, i) => {
        const value = at(data[1 + 2 * i] || []);
        const smooth = smoothed ? at(data[2 + 2 * i] || []) : null;
        items.push(
          MF.el("span", { class: "item" }, MF.el("i", { style: `background:${s.color || color(i)}` }), `${s.label || s.name} `,
            MF.el("b", {}, value === null ? "–" : formatTick(value)),
            smooth === null ? "" : MF.el("span", { class: "smoothed", title: "smoothed" }, ` ~${formatTick(smooth)}`))
        );
      });
      this.legend.replaceChildren(...items);
    }

    resize() {
      const width = Math.max(200, Math.floor(this.container.clientWidth));
      if (width === this.width) return;
      this.width = width;
      if (this.plot) this.plot.setSize({ width, height: this.spec.height || 230 });
    }

    selected(u) {
      const { left, width } = u.select;
      if (width < 5) return;
      const lo = this.view.step(u.posToVal(left, "x"));
      const hi = this.view.step(u.posToVal(left + width, "x"));
      u.setSelect({ left: 0, top: 0, width: 0, height: 0 }, false);
      if (hi > lo) this.onZoom(Math.max(0, Math.floor(lo)), Math.ceil(hi));
    }

    drawRefLine(u, ref) {
      const y = u.valToPos(ref.value, "y", true);
      if (!Number.isFinite(y) || y < u.bbox.top || y > u.bbox.top + u.bbox.height) return;
      const ctx = u.ctx;
      ctx.save();
      ctx.strokeStyle = "#d13b3b";
      ctx.setLineDash([6, 4]);
      ctx.lineWidth = 1.5;
      ctx.beginPath();
      ctx.moveTo(u.bbox.left, y);
      ctx.lineTo(u.bbox.left + u.bbox.width, y);
      ctx.stroke();
      // The label at the right end, above the line, on a light box so a curve under it stays legible.
      ctx.font = `${11 * devicePixelRatio}px system-ui`;
      ctx.textAlign = "right";
      const right = u.bbox.left + u.bbox.width - 4 * devicePixelRatio;
      const textWidth = ctx.measureText(ref.label).width;
      ctx.fillStyle = "rgba(255, 255, 255, 0.8)";
      ctx.fillRect(right - textWidth - 3 * devicePixelRatio, y - 16 * devicePixelRatio, textWidth + 6 * devicePixelRatio, 13 * devicePixelRatio);
      ctx.fillStyle = "#d13b3b";
      ctx.fillText(ref.label, right, y - 5 * devicePixelRatio);
      ctx.restore();
    }
  }

  // The x axis choices: step, tokens seen, or wall time (elapsed_s, interpolated between the
  // steps where it was measured). elapsed: [[step, seconds], ...] ascending.
  function xAxis(mode, tokensPerStep, elapsed) {
    if (mode === "tokens")
      return { xLabel: "tokens", x: (s) => s * tokensPerStep, step: (x) => x / tokensPerStep };
    if (mode === "time" && elapsed.length > 1) {
      const interp = (v, from, to) => {
        let lo = 0;
        let hi = elapsed.length - 1;
        if (v <= elapsed[lo][from]) return elapsed[lo][to];
        if (v >= elapsed[hi][from]) return elapsed[hi][to];
        while (hi - lo > 1) {
          const mid = (lo + hi) >> 1;
          if (elapsed[mid][from] <= v) lo = mid;
          else hi = mid;
        }
        const a = elapsed[lo];
        const b = elapsed[hi];
        return a[to] + ((v - a[from]) * (b[to] - a[to])) / (b[from] - a[from] || 1);
      };
      return { xLabel: "wall time (s)", x: (s) => interp(s, 0, 1), step: (t) => interp(t, 1, 0) };
    }
    return { xLabel: "step", x: (s) => s, step: (x) => x };
  }

  window.MF.Chart = Chart;
  window.MF.chartColor = color;
  window.MF.xAxis = xAxis;
  window.MF.ema = ema;
})();
