// MF.Chart: a uPlot line chart of step series, shared by the job and compare pages.
//
// A chart keeps its series aligned on the union of their steps (a column per series, null where
// a series has no point): the history the API downsampled to the chart's pixel width, then the
// live points appended one step at a time. It draws them against step, tokens or wall time (as
// the page's view says), with an EMA of each series over its faint raw curve when smoothing is
// on; a sparse series (SPARSE_PX) is drawn point by point instead, with markers. Every axis has
// a title and is as wide as its tick labels, written in one format per axis. A zoom asks the
// page for that step range at full resolution; the page hands the points back with showZoom and
// the chart keeps them until resetZoom.
"use strict";

(function () {
  const PALETTE = ["#3056d3", "#e8590c", "#2b8a3e", "#c2255c", "#7048e8", "#0b7285", "#a61e4d", "#5c940d",
    "#1864ab", "#d9480f", "#087f5b", "#862e9c", "#e67700", "#364fc7", "#c92a2a", "#2f9e44", "#495057",
    "#f08c00", "#0c8599", "#9c36b5"];
  const REDRAW_MS = 250; // live points are drawn at most this often per chart (4 frames a second)
  // A series with fewer points than one per SPARSE_PX pixels of the chart's width (val_loss at a
  // few evaluations, a short run) is sparse: its points stand apart (uPlot's own rule for drawing
  // markers, about twice a marker's width), so each is drawn, with a marker, and none is smoothed
  // (an average of a few far-apart points sits away from all of them).
  const SPARSE_PX = 12;

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

  // The fewest decimals that write ``step`` exactly (0.0005: 4, 2.5: 1, 20: 0), at most 12.
  function decimals(step) {
    let d = 0;
    while (d < 12 && Math.abs(Math.round(step * 10 ** d) - step * 10 ** d) > 1e-6 * step * 10 ** d) d++;
    return d;
  }

  // The tick labels of one axis, all in one format chosen by the axis's range: fixed, with the
  // decimals its tick spacing needs (0.0005, 0.0010, 0.0015); k, M or G from 10^4 up (20k, 40k);
  // scientific with one exponent below 10^-3 (2e-4, 4e-4). On a log axis (incr null) every tick
  // is fixed, or every tick scientific when the axis reaches below 10^-3 or from 10^4 up.
  function tickLabels(ticks, incr) {
    const shown = ticks.filter((v) => v !== null && Number.isFinite(v));
    const top = Math.max(0, ...shown.map(Math.abs));
    const low = Math.min(...shown.filter((v) => v !== 0).map(Math.abs));
    const label = (write, zero = "0") =>
      ticks.map((v) => (v === null || !Number.isFinite(v) ? "" : v === 0 ? zero : write(v)));
    if (top === 0) return label(String);
    if (!incr) return low < 1e-3 || top >= 1e4 ? label((v) => v.toExponential(0)) : label((v) => String(+v.toPrecision(3)));
    if (top >= 1e4) {
      const [unit, suffix] = top >= 1e9 ? [1e9, "G"] : top >= 1e6 ? [1e6, "M"] : [1e3, "k"];
      const d = decimals(incr / unit);
      return label((v) => `${(v / unit).toFixed(d)}${suffix}`);
    }
    if (top < 1e-3) {
      const exp = Math.floor(Math.log10(top));
      const d = decimals(incr / 10 ** exp);
      return label((v) => `${(v / 10 ** exp).toFixed(d)}e${exp}`);
    }
    const d = decimals(incr);
    return label((v) => v.toFixed(d), (0).toFixed(d));
  }

  // uPlot's ``values`` of an axis: its ticks' labels (tickLabels), on a linear or a log scale.
  function axisValues(u, ticks, axisIdx, space, incr) {
    return tickLabels(ticks, u.scales[u.axes[axisIdx].scale].distr === 3 ? null : incr);
  }

  // A vertical axis as wide as its longest tick label (with the tick and the gap before it), so
  // that no label is cut at the chart's edge or runs into the axis title. uPlot sizes its axes
  // over a few cycles, the ticks changing with the plot's height: after the first an axis only
  // grows, so that the layout converges.
  function axisWidth(u, values, axisIdx, cycleNum) {
    const axis = u.axes[axisIdx];
    u.ctx.font = axis.font[0];
    const longest = Math.max(0, ...(values || []).map((v) => u.ctx.measureText(v).width));
    const width = Math.ceil(axis.ticks.size + axis.gap + longest / devicePixelRatio + 4);
    return cycleNum > 1 ? Math.max(width, axis._size || 0) : width;
  }

  // Tick spacings of an axis of whole numbers (steps, tokens, counts): 1, 2, 5, 10, 20, 50, ...
  const WHOLE = Array.from({ length: 16 }, (_, e) => [1, 2, 5].map((m) => m * 10 ** e)).flat();

  // A metric's axis title: its name, and its unit where the name does not say it (tokens_per_s,
  // step_time_ms and elapsed_s do; the others are ratios, norms and counts).
  const UNITS = { [MF.M.LOSS]: "nats/token", [MF.M.VAL_LOSS]: "nats/token" };
  function metricLabel(name) {
    return UNITS[name] ? `${name} (${UNITS[name]})` : name;
  }

  class Chart {
    // spec: {title, series: [{name, label, color?, scale?: "y" | "y2"}], refLine?: {value, label},
    // height?, y?, y2?: {label?, range?: [min, max], whole?}}; view: {smoothing, logY, xLabel,
    // xText(x), whole, x(step) -> x value, step(x) -> step} (xAxis gives the last five);
    // onZoom(loStep, hiStep) asks for that range at full resolution.
    constructor(container, spec, view, onZoom) {
      this.container = container;
      this.spec = spec;
      this.view = view;
      this.onZoom = onZoom;
      this.table = align([]); // the overview: history, then live points, aligned on their steps
      this.zoomed = null; // {table, lo, hi} while zoomed
      this.plot = null;
      this.sparse = []; // per series, as last drawn (sparseSeries)
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

    // Whether each series is sparse (SPARSE_PX) in what is shown.
    sparseSeries() {
      const { columns } = this.zoomed ? this.zoomed.table : this.table;
      return columns.map((col) => col.reduce((n, v) => n + (v === null ? 0 : 1), 0) * SPARSE_PX < this.width);
    }

    // Whether a series is drawn smoothed: smoothing is on and the series is not sparse.
    smoothed(i) {
      return this.view.smoothing > 0 && !this.sparse[i];
    }

    // The uPlot data of what is shown: x, then per series its raw and its smoothed column.
    data() {
      const { steps, columns } = this.zoomed ? this.zoomed.table : this.table;
      const { smoothing, logY } = this.view;
      const out = [steps.map(this.view.x)];
      const unit = typicalGap(steps);
      columns.forEach((col, i) => {
        const positive = logY && !this.fixedRange(this.spec.series[i]); // log y drops values <= 0
        const raw = positive ? col.map((v) => (v !== null && v > 0 ? v : null)) : col;
        out.push(raw, this.smoothed(i) ? ema(raw, smoothing, steps, unit) : new Array(raw.length).fill(null));
      });
      return out;
    }

    redraw() {
      if (!this.plot || String(this.sparseSeries()) !== String(this.sparse)) return this.rebuild();
      this.plot.setData(this.data(), !this.zoomed);
      if (this.zoomed) this.plot.setScale("x", { min: this.view.x(this.zoomed.lo), max: this.view.x(this.zoomed.hi) });
    }

    // The axis settings of a y scale ("y" or "y2"): spec.y or spec.y2, {label, range: [min, max],
    // whole}; the title defaults to the metric name (and unit) of its first series.
    yAxis(scale) {
      const first = this.spec.series.find((s) => (s.scale || "y") === scale);
      return { label: first ? metricLabel(first.name) : "", ...(this.spec[scale] || {}) };
    }

    // A y scale given a range (a count of heads, a factor in [0, 1]) stays linear under log y.
    fixedRange(series) {
      return !!this.yAxis(series.scale || "y").range;
    }

    options() {
      const { logY, xLabel, whole } = this.view;
      const series = [{ label: xLabel }];
      this.spec.series.forEach((s, i) => {
        const c = s.color || color(i);
        const common = { scale: s.scale || "y", spanGaps: true };
        const smooth = this.smoothed(i);
        const points = this.sparse[i] ? { show: true, size: 6, width: 1, fill: c } : { show: false };
        const name = s.label || s.name;
        series.push({ ...common, label: name, stroke: smooth ? withAlpha(c, 0.25) : c, width: 1.25, points });
        series.push({ ...common, label: `${name} (smoothed)`, stroke: c, width: 2, show: smooth, points: { show: false } });
      });
      const x = { label: xLabel, values: axisValues, size: 30, labelSize: 18, labelGap: 0, incrs: whole ? WHOLE : undefined };
      const scales = { x: { time: false } };
      const axes = [x];
      for (const scale of ["y", "y2"]) {
        if (!this.spec.series.some((s) => (s.scale || "y") === scale)) continue;
        const { label, range, whole: wholeY } = this.yAxis(scale);
        scales[scale] = range ? { range } : { distr: logY && scale === "y" ? 3 : 1 };
        const incrs = wholeY ? WHOLE : undefined;
        const axis = { scale, label, labelSize: 18, labelGap: 0, values: axisValues, size: axisWidth, incrs };
        axes.push(scale === "y2" ? { ...axis, side: 1, grid: { show: false } } : axis);
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
      this.sparse = this.sparseSeries();
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
    // The value is the raw one; a smoothed series' EMA follows it, named as such.
    updateLegend(u) {
      if (!this.legend) return;
      const data = u.data;
      const num = (v) => (v === null || v === undefined ? "–" : MF.fmt.num(v));
      const at = (column) => {
        const idx = u.cursor.idx;
        if (idx !== null && idx !== undefined) return column[idx];
        for (let i = column.length - 1; i >= 0; i--) if (column[i] !== null) return column[i];
        return null;
      };
      const cursorX = u.cursor.idx !== null && u.cursor.idx !== undefined ? data[0][u.cursor.idx] : null;
      const items = [MF.el("span", { class: "x" }, cursorX === null ? "" : this.view.xText(cursorX))];
      const weight = this.view.smoothing.toFixed(2);
      const ema = `exponential moving average of the raw values, weight ${weight} (the Smoothing control)`;
      this.spec.series.forEach((s, i) => {
        const smooth = this.smoothed(i) ? at(data[2 + 2 * i] || []) : null;
        const note = this.sparse[i] ? "few points: each is drawn, with a marker, and none is smoothed" : null;
        items.push(
          MF.el("span", { class: "item", title: note }, MF.el("i", { style: `background:${s.color || color(i)}` }),
            `${s.label || s.name} `,
            MF.el("b", {}, num(at(data[1 + 2 * i] || []))),
            smooth === null ? "" : MF.el("span", { class: "smoothed", title: ema }, ` (smoothed ${num(smooth)})`))
        );
      });
      this.legend.replaceChildren(...items);
    }

    resize() {
      const width = Math.max(200, Math.floor(this.container.clientWidth));
      if (width === this.width) return;
      this.width = width;
      if (this.plot && String(this.sparseSeries()) !== String(this.sparse)) this.rebuild();
      else if (this.plot) this.plot.setSize({ width, height: this.spec.height || 230 });
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

  // The titles of an x axis choice ("step", "tokens" or "time"): xLabel on the axis, xText(x) in
  // the legend; whole: its ticks are whole numbers.
  function xAxisLabels(mode) {
    if (mode === "tokens") return { xLabel: "tokens", xText: (x) => `${MF.fmt.int(x)} tokens`, whole: true };
    if (mode === "time")
      return { xLabel: "wall time since the first step (s)", xText: (x) => `${MF.fmt.num(x)} s`, whole: false };
    return { xLabel: "step", xText: (x) => `step ${MF.fmt.int(x)}`, whole: true };
  }

  // The x axis choices: step, tokens seen, or wall time (elapsed_s, interpolated between the
  // steps where it was measured, counted from the first of them: a run's clock starts before its
  // first step, with the first evaluation and the device's warm-up). elapsed: [[step, seconds],
  // ...] ascending, the page's own array (live points land in it).
  function xAxis(mode, tokensPerStep, elapsed) {
    if (mode === "tokens") return { ...xAxisLabels(mode), x: (s) => s * tokensPerStep, step: (x) => x / tokensPerStep };
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
      const start = () => elapsed[0][1];
      return { ...xAxisLabels(mode), x: (s) => interp(s, 0, 1) - start(), step: (t) => interp(t + start(), 1, 0) };
    }
    return { ...xAxisLabels("step"), x: (s) => s, step: (x) => x };
  }

  window.MF.Chart = Chart;
  window.MF.chartColor = color;
  window.MF.xAxis = xAxis;
  window.MF.xAxisLabels = xAxisLabels;
  window.MF.metricLabel = metricLabel;
  window.MF.axisValues = axisValues;
  window.MF.axisWidth = axisWidth;
  window.MF.ema = ema;
})();
