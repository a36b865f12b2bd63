// MF.Heatmap: the per-head max attention logit of every layer and head (rows) over the steps
// (columns) on a canvas. A cell shows the largest value of its head in its step range, coloured
// from 0 to the largest value seen (at most QK-Clip's tau); cells above tau are red. Live points land in their column; the canvas is redrawn at most 4 times a second.
"use strict";

(function () {
  const STOPS = [ // a perceptually even scale, dark to bright (viridis)
    [68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37],
  ];
  const OVER = [214, 40, 40];
  const ROW_PX = 8;
  const LABEL_PX = 56;

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
      const height = rows * ROW_PX;
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
      ctx.drawImage(off, LABEL_PX, 0, this.columns, height);
      ctx.fillStyle = "#667085";
      ctx.font = "10px system-ui";
      ctx.textBaseline = "middle";
      for (let l = 0; l < this.layers; l++) {
        ctx.fillText(`layer ${l}`, 2, (l * this.heads + this.heads / 2) * ROW_PX);
        ctx.fillStyle = "#ffffff";
        ctx.fillRect(LABEL_PX, l * this.heads * ROW_PX, this.columns, l ? 1 : 0);
        ctx.fillStyle = "#667085";
      }
    }

    hover(event) {
      const rect = this.canvas.getBoundingClientRect();
      const x = event.clientX - rect.left - LABEL_PX;
      const row = Math.floor((event.clientY - rect.top) / ROW_PX);
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
