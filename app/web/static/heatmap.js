// MF.Heatmap: the per-head max attention logit of every layer and head (rows) over the steps
// (columns) on a canvas. A cell shows the largest value of its head in its step range, coloured
// from 0 to the largest value seen (at most QK-Clip's tau); cells above tau are red. Rows are
// labelled by layer and head (every head while rows are tall enough for a label), the columns by a
// step axis. Live points land in their column; the canvas is redrawn at most 4 times a second.
"use strict";

(function () {
  const STOPS = [ // a perceptually even scale, dark to bright (viridis)
    [68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37],
  ];
  const OVER = [214, 40, 40];
  const LABEL_PX = 72; // the row labels' gutter: "layer 11" then "h15"
  const AXIS_PX = 34; // the step axis under the cells: ticks, their labels and its title
  const FONT_PX = 10;
  const TICK_SPACE_PX = 70; // step ticks at least this far apart
  const STEP_INCRS = Array.from({ length: 16 }, (_, e) => [1, 2, 5].map((m) => m * 10 ** e)).flat();

  // Rows tall enough to label every head while there are few, down to 3 px each for many.
  function rowHeight(rows) {
    return Math.max(3, Math.min(14, Math.floor(360 / rows)));
  }

  // The step ticks of [0, total] over ``width`` pixels: multiples of the smallest whole-number
  // spacing (1, 2, 5, 10, ...) that keeps them TICK_SPACE_PX apart.
  function stepTicks(total, width) {
    const incr = STEP_INCRS.find((i) => (i / (total + 1)) * width >= TICK_SPACE_PX) || total;
    const out = [];
    for (let s = 0; s <= total; s += incr) out.push(s);
    return out;
  }

  function colorOf(t) {
    if (t > 1) return OVER;
    const x = Math.max(0, t) * (STOPS.length - 1);
    const i = Math.min(STOPS.length - 2, Math.floor(x));
    const f = x - i;
    return STOPS[i].map((c, k) => Math.round(c + f * (STOPS[i + 1][k] - c)));
  }

  class Heatmap {
    // layers x heads rows; steps [0, totalSteps]; reference: tau or null (then the largest value).
    constructor(container, { layers, heads, totalSteps, reference }) {
      this.container = container;
      this.layers = layers;
      this.heads = heads;
      this.total = Math.max(1, totalSteps);
      this.reference = reference;
      this.rowPx = rowHeight(layers * heads);
      this.canvas = document.createElement("canvas");
      this.tip = document.createElement("div");
      this.tip.className = "muted";
      this.tip.style.minHeight = "18px";
      container.replaceChildren(this.canvas, this.tip);
      this.columns = Math.max(50, Math.floor(container.clientWidth - LABEL_PX));
      this.cells = new Float64Array(layers * heads * this.columns).fill(NaN);
      this.max = 0;
      this.pending = null;
      this.canvas.addEventListener("mousemove", (e) => this.hover(e));
      this.canvas.addEventListener("mouseleave", () => (this.tip.textContent = ""));
      new ResizeObserver(() => this.resize()).observe(container);
    }

    name(layer, head) {
      return MF.M.head(layer, head);
    }

    names() {
      const out = [];
      for (let l = 0; l < this.layers; l++) for (let h = 0; h < this.heads; h++) out.push(this.name(l, h));
      return out;
    }

    // The columns a step covers: one, or several when there are fewer steps than columns.
    columnsOf(step) {
      const per = this.columns / (this.total + 1);
      const first = Math.min(this.columns - 1, Math.floor(step * per));
      return [first, Math.max(first, Math.min(this.columns - 1, Math.ceil((step + 1) * per) - 1))];
    }

    put(row, step, value) {
      if (!Number.isFinite(value)) return;
      const [first, last] = this.columnsOf(step);
      for (let c = first; c <= last; c++) {
        const i = row * this.columns + c;
        if (!(this.cells[i] >= value)) this.cells[i] = value;
      }
      if (value > this.max) this.max = value;
    }

    // Colours go from 0 to the largest value seen, capped at tau: cells above tau are red.
    scale() {
      const top = this.max || 1;
      return this.reference ? Math.min(top, this.reference) : top;
    }

    // history: {name: [[step, value], ...]}
    setHistory(history) {
      this.history = history;
      this.cells.fill(NaN);
      this.max = 0;
      this.names().forEach((name, row) => {
        for (const [step, value] of history[name] || []) this.put(row, step, value);
      });
      this.draw();
    }

    append(step, values) {
      if (step > this.total) return;
      let changed = false;
      this.names().forEach((name, row) => {
        if (values[name] !== undefined) {
          this.put(row, step, values[name]);
          changed = true;
        }
      });
      if (changed && !this.pending) this.pending = setTimeout(() => ((this.pending = null), this.draw()), 250);
    }

    resize() {
      const columns = Math.max(50, Math.floor(this.container.clientWidth - LABEL_PX));
      if (columns === this.columns || !this.history) return;
      this.columns = columns;
      this.cells = new Float64Array(this.layers * this.heads * columns).fill(NaN);
      this.setHistory(this.history);
    }

    draw() {
      const rows = this.layers * this.heads;
      const width = LABEL_PX + this.columns;
      const cellsHeight = rows * this.rowPx;
      const height = cellsHeight + AXIS_PX;
      const dpr = window.devicePixelRatio || 1;
      this.canvas.width = width * dpr;
      this.canvas.height = height * dpr;
      this.canvas.style.height = `${height}px`;
      const ctx = this.canvas.getContext("2d");
      ctx.scale(dpr, dpr);
      const image = ctx.createImageData(this.columns, rows);
      const ref = this.scale();
      if (this.onScale) this.onScale(ref);
      for (let r = 0; r < rows; r++) {
        for (let c = 0; c < this.columns; c++) {
          const v = this.cells[r * this.columns + c];
          const o = (r * this.columns + c) * 4;
          const [R, G, B] = Number.isNaN(v) ? [240, 242, 245] : colorOf(v / ref);
          image.data[o] = R;
          image.data[o + 1] = G;
          image.data[o + 2] = B;
          image.data[o + 3] = 255;
        }
      }
      const off = new OffscreenCanvas(this.columns, rows);
      off.getContext("2d").putImageData(image, 0, 0);
      ctx.imageSmoothingEnabled = false;
      ctx.drawImage(off, LABEL_PX, 0, this.columns, cellsHeight);
      ctx.font = `${FONT_PX}px system-ui`;
      ctx.fillStyle = "#ffffff";
      for (let l = 1; l < this.layers; l++) ctx.fillRect(LABEL_PX, l * this.heads * this.rowPx, this.columns, 1);
      this.drawRowLabels(ctx);
      this.drawStepAxis(ctx, cellsHeight);
    }

    // "layer l" in the middle of its rows, then "h0", "h1", ... at each row while rows are tall
    // enough for a label (else the hover names the head).
    drawRowLabels(ctx) {
      const groupPx = this.heads * this.rowPx;
      ctx.fillStyle = "#667085";
      ctx.textBaseline = "middle";
      for (let l = 0; l < this.layers; l++) {
        if (groupPx >= FONT_PX) {
          ctx.textAlign = "left";
          ctx.fillText(`layer ${l}`, 2, (l + 0.5) * groupPx);
        }
        if (this.rowPx < FONT_PX) continue;
        ctx.textAlign = "right";
        for (let h = 0; h < this.heads; h++) ctx.fillText(`h${h}`, LABEL_PX - 4, l * groupPx + (h + 0.5) * this.rowPx);
      }
    }

    // Ticks at whole steps under the cells (a step's tick at the left edge of its first column),
    // their labels, and the axis title.
    drawStepAxis(ctx, top) {
      const per = this.columns / (this.total + 1);
      ctx.fillStyle = "#667085";
      ctx.textBaseline = "top";
      for (const s of stepTicks(this.total, this.columns)) {
        const x = LABEL_PX + Math.floor(s * per);
        ctx.fillRect(x, top, 1, 4);
        ctx.textAlign = s === 0 ? "left" : x + 20 > LABEL_PX + this.columns ? "right" : "center";
        ctx.fillText(MF.fmt.int(s), x, top + 6);
      }
      ctx.textAlign = "center";
      ctx.font = `600 ${FONT_PX + 1}px system-ui`;
      ctx.fillText("step", LABEL_PX + this.columns / 2, top + 6 + FONT_PX + 4);
    }

    hover(event) {
      const rect = this.canvas.getBoundingClientRect();
      const x = event.clientX - rect.left - LABEL_PX;
      const row = Math.floor((event.clientY - rect.top) / this.rowPx);
      if (x < 0 || row < 0 || row >= this.layers * this.heads) return (this.tip.textContent = "");
      const col = Math.min(this.columns - 1, Math.floor(x));
      const v = this.cells[row * this.columns + col];
      const lo = Math.floor((col / this.columns) * (this.total + 1));
      const hi = Math.max(lo, Math.ceil(((col + 1) / this.columns) * (this.total + 1)) - 1);
      const where = `layer ${Math.floor(row / this.heads)}, head ${row % this.heads}, steps ${lo}–${hi}`;
      this.tip.textContent = Number.isNaN(v) ? `${where}: no data` : `${where}: max logit ${MF.fmt.num(v)}`;
    }
  }

  window.MF.Heatmap = Heatmap;
})();
