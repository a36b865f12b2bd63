// One sweep: its facts, the best trial, a scatter of the metric against each swept parameter
// (log x for a log_uniform one, the choices in order for a values list of words), and the
// trials table, sortable by any column (the metric by default). Polls while the sweep runs.
"use strict";

(function () {
  const { api, el, fmt, statusBadge, poll, showError, STATUS } = MF;
  const root = document.getElementById("sweep");
  const sweepId = root.dataset.sweepId;
  const maxJobs = Number(root.dataset.maxJobs) || 20;
  const GROUPS = [
    [STATUS.job.SUCCEEDED, "#2b8a3e"],
    [STATUS.job.STOPPED_EARLY, "#8e44ad"],
    ["other", "#868e96"],
  ];
  let sweep = null;
  let sort = { key: "metric", dir: 1 }; // 1: ascending
  let drawnKey = "";
  let plots = [];
  let poller = null;

  const decade = (v) => Math.abs(Math.log10(v) - Math.round(Math.log10(v))) < 1e-9;
  const better = (a, b) => (sweep.mode === "min" ? a - b : b - a);
  const isNum = (v) => typeof v === "number" && Number.isFinite(v);

  function compareValues(a, b) {
    if (a === b) return 0;
    if (a === null || a === undefined) return 1; // missing values last, whatever the direction
    if (b === null || b === undefined) return -1;
    if (isNum(a) && isNum(b)) return (a - b) * sort.dir;
    return String(a).localeCompare(String(b)) * sort.dir;
  }

  function value(trial, key) {
    if (key === "number" || key === "step" || key === "metric" || key === "status") return trial[key];
    return trial.params[key];
  }

  const paramText = fmt.param;

  function renderHead(paths) {
    const cols = [["number", "#"], ["job", "Job"], ...paths.map((p) => [p, p]), ["status", "Status"],
      ["step", "Steps"], ["metric", sweep.metric], ["rungs", "Rungs"]];
    const row = el(
      "tr",
      {},
      cols.map(([key, label]) => {
        const sortable = key !== "job" && key !== "rungs";
        const arrow = sort.key === key ? (sort.dir === 1 ? " ▲" : " ▼") : "";
        const th = el("th", { class: sortable ? "sortable" : null, dataset: { key } }, label + arrow);
        if (sortable) {
          th.setAttribute("aria-sort", sort.key === key ? (sort.dir === 1 ? "ascending" : "descending") : "none");
          th.addEventListener("click", () => {
            sort = sort.key === key ? { key, dir: -sort.dir } : { key, dir: 1 };
            render();
          });
        }
        return th;
      })
    );
    document.querySelector("#trials thead").replaceChildren(row);
  }

  function trialRow(t, paths) {
    const best = sweep.best && sweep.best.number === t.number;
    const rungs = t.rungs.map((r) => {
      const waits = !r.continued && t.status === STATUS.job.PAUSED;
      const word = r.continued ? (r.promoted ? "promoted" : "continued") : waits ? "waits" : "stopped";
      return el("span", { class: `rung ${r.continued ? "rung-go" : waits ? "rung-wait" : "rung-stop"}`, title: `${sweep.metric} ${r.value} (#${r.position} at this rung)` },
        `${r.rung}: ${word}`);
    });
    return el(
      "tr",
      { class: best ? "best" : null, dataset: { number: String(t.number) } },
      el("td", {}, `${t.number}${best ? " ★" : ""}`),
      el("td", { class: "id" }, t.job_id ? el("a", { href: `/jobs/${t.job_id}` }, t.job_id) : "–"),
      paths.map((p) => el("td", { class: "num" }, paramText(t.params[p]))),
      el("td", {}, statusBadge(t.status)),
      el("td", { class: "num" }, fmt.int(t.step)),
      el("td", { class: "num" }, fmt.num(t.metric)),
      el("td", {}, rungs.length ? rungs : "–")
    );
  }

  function renderFacts() {
    document.getElementById("sweep-name").textContent = sweep.name || sweep.id;
    document.getElementById("sweep-status").replaceChildren(statusBadge(sweep.status));
    document.title = `${sweep.name || sweep.id} · muonforge`;
    const spec = sweep.spec;
    const others = spec.asha && spec.asha.stop_once === false ? "the others wait to be promoted" : "stops the others";
    const asha = spec.asha ? `ASHA at steps ${spec.asha.rungs.join(", ")} (keeps 1 in ${spec.asha.reduction_factor}, ${others})` : "no early termination";
    const counts = Object.entries(sweep.counts.by_status).map(([s, n]) => `${n} ${s}`).join(", ");
    document.getElementById("sweep-facts").textContent =
      `${sweep.id} · ${spec.method}${spec.method === "random" ? ` (seed ${spec.seed})` : ""} · ` +
      `${sweep.counts.total} trials: ${counts} · up to ${spec.max_concurrent} at once · ${sweep.mode} ${sweep.metric} · ${asha}`;
    const best = sweep.best;
    document.getElementById("best").replaceChildren(
      best
        ? el("span", {}, el("a", { href: `/jobs/${best.job_id}` }, `Trial #${best.number}`), ` · ${sweep.metric} ${fmt.num(best.metric)} · `,
          Object.entries(best.params).map(([p, v]) => `${p} = ${paramText(v)}`).join(", "))
        : el("span", { class: "muted" }, "None yet: no trial has succeeded.")
    );
    document.getElementById("cancel").hidden = sweep.status !== STATUS.sweep.RUNNING;
    const started = sweep.trials.filter((t) => t.job_id);
    started.sort((a, b) => (a.metric === null) - (b.metric === null) || (a.metric !== null ? better(a.metric, b.metric) : 0));
    const link = document.getElementById("compare-link");
    link.href = `/compare?jobs=${started.slice(0, maxJobs).map((t) => t.job_id).join(",")}`;
    link.title = started.length > maxJobs ? `The best ${maxJobs} of ${started.length}` : `All ${started.length} started trials`;
    link.hidden = started.length < 1;
  }

  // x positions of one parameter's values: numbers as they are, words by their place in the list;
  // the same x twice is nudged apart so that uPlot's ascending x holds.
  function plotData(path) {
    const param = sweep.spec.space[path];
    const words = param.values && param.values.some((v) => !isNum(v)) ? param.values.map((v) => JSON.stringify(v)) : null;
    const points = sweep.trials
      .filter((t) => isNum(t.metric))
      .map((t) => {
        const v = t.params[path];
        const group = GROUPS.findIndex(([g]) => g === t.status);
        return { x: words ? words.indexOf(JSON.stringify(v)) : v, y: t.metric, g: group < 0 ? 2 : group };
      })
      .filter((p) => isNum(p.x))
      .sort((a, b) => a.x - b.x);
    for (let i = 1; i < points.length; i++) {
      if (points[i].x <= points[i - 1].x) points[i].x = points[i - 1].x + Math.max(Math.abs(points[i - 1].x) * 1e-9, 1e-12);
    }
    const xs = points.map((p) => p.x);
    const columns = GROUPS.map((_, g) => points.map((p) => (p.g === g ? p.y : null)));
    return { words, log: !!param.log_uniform, data: [xs, ...columns] };
  }

  function renderPlots(paths) {
    const key = JSON.stringify(paths.map(plotData));
    if (key === drawnKey) return;
    drawnKey = key;
    for (const p of plots) p.destroy();
    plots = [];
    const box = document.getElementById("plots");
    box.replaceChildren();
    for (const path of paths) {
      const { words, log, data } = plotData(path);
      const chart = el("div", { class: "chart" });
      const card = el("section", { class: "card chart-card", dataset: { param: path } },
        el("h2", {}, `${sweep.metric} against ${path}${log ? " (log scale)" : ""}`), chart);
      box.append(card);
      if (!data[0].length) {
        chart.replaceChildren(el("div", { class: "chart-empty" }, "No evaluations yet"));
        continue;
      }
      const opts = {
        width: Math.max(300, chart.clientWidth || 600),
        height: 260,
        legend: { show: true, live: false },
        scales: {
          x: log ? { time: false, distr: 3 } : words ? { time: false, range: [-0.5, words.length - 0.5] } : { time: false },
          y: {},
        },
        axes: [
          {
            label: path,
            values: words
              ? (u, ticks) => ticks.map((t) => (Number.isInteger(t) && words[t] !== undefined ? JSON.parse(words[t]) : ""))
              : log
                ? (u, ticks, ...rest) => MF.axisValues(u, ticks.map((t) => (decade(t) ? t : null)), ...rest) // decades only
                : MF.axisValues,
            splits: words ? () => words.map((_, i) => i) : undefined,
          },
          { label: MF.metricLabel(sweep.metric), values: MF.axisValues, size: MF.axisWidth },
        ],
        series: [
          { label: path, value: (u, v) => (v === null || v === undefined ? "–" : words ? JSON.parse(words[Math.round(v)] ?? "null") : fmt.num(v)) },
          ...GROUPS.map(([name, color]) => ({
            label: name,
            stroke: color,
            fill: color,
            width: 0,
            paths: () => null,
            points: { show: true, size: 9, stroke: color, fill: color },
            value: (u, v) => fmt.num(v),
          })),
        ],
      };
      plots.push(new uPlot(opts, data, chart));
    }
    MF.markDrawn("sweep-plots");
  }

  function render() {
    const paths = Object.keys(sweep.spec.space);
    renderFacts();
    renderHead(paths);
    const trials = sweep.trials.slice().sort((a, b) => compareValues(value(a, sort.key), value(b, sort.key)) || a.number - b.number);
    document.querySelector("#trials tbody").replaceChildren(...trials.map((t) => trialRow(t, paths)));
    renderPlots(paths);
    document.getElementById("content").hidden = false;
  }

  async function load() {
    try {
      sweep = await api(`/v1/sweeps/${encodeURIComponent(sweepId)}`);
    } catch (e) {
      if (e instanceof MF.ApiError && (e.status === 404 || e.status === 422)) {
        document.getElementById("not-found").hidden = false;
        if (poller) poller.stop();
        return;
      }
      throw e;
    }
    if (sweep.mode === "max" && sort.key === "metric" && !load.sorted) sort.dir = -1;
    load.sorted = true;
    render();
    if (sweep.status !== STATUS.sweep.RUNNING && poller) poller.stop();
  }

  document.getElementById("cancel").addEventListener("click", async () => {
    try {
      sweep = await api(`/v1/sweeps/${encodeURIComponent(sweepId)}/cancel`, { method: "POST" });
      render();
    } catch (e) {
      showError(e);
    }
  });

  poller = poll(load, { visible: 3000, hidden: 30000 });
})();
