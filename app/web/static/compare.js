// Compare: the chosen jobs' curves of one metric overlaid, each downsampled by the API to the
// chart's pixel width; the legend names each job, its optimizer and lr. Same smoothing, log and
// x-axis controls as the job page. The x axis is per job (a job's tokens per step and wall
// clock are its own), so points are placed on it here and a zoom maps back to each job's steps.
"use strict";

(function () {
  const { api, el, fmt, statusBadge, M } = MF;
  const root = document.getElementById("compare");
  const ids = root.dataset.jobIds ? root.dataset.jobIds.split(",") : [];
  const $ = (id) => document.getElementById(id);

  let jobs = []; // found jobs, in the order asked
  let chart = null;
  let overview = {}; // job id -> [[step, value], ...] of the metric
  let elapsed = {}; // job id -> [[step, elapsed_s], ...] (for the wall-time axis)

  function label(job) {
    const o = job.spec.optimizer;
    return `${job.name || job.id} · ${o.name} lr ${fmt.param(o.lr)}`;
  }

  function axisOf(job) {
    const tokensPerStep = job.spec.train.batch_size * job.spec.model.seq_len;
    return MF.xAxis($("x-axis").value, tokensPerStep, elapsed[job.id] || []);
  }

  // Points of each job on the shared x axis.
  function placed(history) {
    const out = {};
    for (const job of jobs) {
      const axis = axisOf(job);
      out[job.id] = (history[job.id] || []).map(([s, v]) => [axis.x(s), v]);
    }
    return out;
  }

  function view() {
    const labels = MF.xAxisLabels($("x-axis").value);
    return { smoothing: Number($("smoothing").value), logY: $("log-y").checked, ...labels, x: (v) => v, step: (v) => v };
  }

  async function series(id, name, range) {
    const width = chart ? chart.width : $("chart").clientWidth || root.clientWidth; // hidden until loaded
    const params = new URLSearchParams({ names: name, max_points: String(Math.max(3, width)) });
    if (range) params.set("from_step", range[0]), params.set("to_step", range[1]);
    const data = await api(`/v1/jobs/${encodeURIComponent(id)}/metrics?${params}`);
    return data.series.length ? data.series[0].points : null; // null: the job reports no such series
  }

  async function fetchAll(name, ranges, list = jobs.map((j) => j.id)) {
    const lists = await Promise.all(list.map((id) => series(id, name, ranges ? ranges[id] : null)));
    return Object.fromEntries(list.map((id, i) => [id, lists[i]]));
  }

  const metricName = () => $("metric").value.trim() || M.LOSS;

  // -- a metric the jobs do not report --------------------------------------------------------
  // The metric goes into the URL (?metric=). Where some jobs do not report it, a note names them;
  // where none does, the chart gives way to the names they report. Returns whether any does.
  async function noteMetric(metric, points) {
    const params = new URLSearchParams(location.search);
    params.set("metric", metric);
    history.replaceState(null, "", `?${params.toString().replace(/%2C/gi, ",")}`);
    const missing = jobs.filter((j) => points[j.id] === null);
    const note = $("metric-note") || el("div", { id: "metric-note", class: "note-box metric-note" });
    if (!note.isConnected) $("chart").closest("section").before(note);
    note.hidden = !missing.length;
    $("chart").closest("section").hidden = missing.length > 0 && missing.length === jobs.length;
    if (!missing.length) return true;
    if (missing.length < jobs.length) {
      note.replaceChildren(`Not reported by ${missing.map((j) => j.name || j.id).join(", ")}: “${metric}”.`);
      return true;
    }
    const lists = await Promise.all(
      // from_step after to_step: every series of the job, without points
      jobs.map((j) => api(`/v1/jobs/${encodeURIComponent(j.id)}/metrics?from_step=1&to_step=0`).catch(() => null))
    );
    const reported = new Set(lists.flatMap((d) => (d ? d.series.map((s) => s.name) : [])));
    const offered = [...document.querySelectorAll("#metric-names option")].map((o) => o.value);
    const whole = offered.filter((n) => reported.has(n)); // the series of a whole run, in the list's order
    const others = [...reported].filter((n) => !whole.includes(n)).sort();
    const link = (name) => {
      const to = new URLSearchParams(params);
      to.set("metric", name);
      return el("a", { href: `?${to.toString().replace(/%2C/gi, ",")}` }, name);
    };
    const names = whole.flatMap((n, i) => (i ? [", ", link(n)] : [link(n)]));
    const they = jobs.length > 1 ? ["They report ", "They have reported no metrics yet."] : ["It reports ", "It has reported no metrics yet."];
    note.replaceChildren(
      el("strong", {}, `Unknown metric “${metric}”`),
      `: ${jobs.length > 1 ? "none of these jobs reports" : "this job does not report"} it. `,
      reported.size ? they[0] : they[1],
      ...names,
      others.length ? `${whole.length ? ", and " : ""}${others.length} other series (such as ${others[0]})` : "",
      reported.size ? "." : ""
    );
    return false;
  }

  // ``prefetched``: the metric's points, asked for together with the jobs themselves.
  async function load(prefetched) {
    const metric = metricName();
    $("chart-title").textContent = metric;
    const needTime = $("x-axis").value === "time" && jobs.some((j) => !elapsed[j.id]);
    const [points, times] = await Promise.all([prefetched || fetchAll(metric), needTime ? fetchAll(M.ELAPSED_S) : null]);
    if (times) Object.assign(elapsed, times);
    overview = points;
    if (!(await noteMetric(metric, points))) return MF.markDrawn("mf:compare-drawn");
    const series = jobs.map((j) => ({ name: j.id, label: label(j) }));
    const spec = { title: metric, series, height: 420, y: { label: MF.metricLabel(metric) } };
    if (!chart) chart = new MF.Chart($("chart"), spec, view(), zoom);
    MF.shown = { charts: [chart] }; // what the page draws, for tests and the console
    chart.spec = spec;
    chart.view = view();
    chart.zoomed = null;
    $("reset-zoom").hidden = true;
    chart.setHistory(placed(overview));
    MF.markDrawn("mf:compare-drawn");
  }

  // A zoom on the shared x axis: each job's steps in that range, at full resolution.
  async function zoom(lo, hi) {
    if (lo === null) {
      $("reset-zoom").hidden = true;
      return chart.resetZoom();
    }
    const ranges = {};
    for (const job of jobs) {
      const axis = axisOf(job);
      ranges[job.id] = [Math.max(0, Math.floor(axis.step(lo))), Math.ceil(axis.step(hi))];
    }
    const points = await fetchAll(metricName(), ranges);
    $("reset-zoom").hidden = false;
    chart.showZoom(placed(points), lo, hi);
  }

  function renderTable() {
    document.querySelector("#jobs tbody").replaceChildren(
      ...jobs.map((job, i) => {
        const s = job.summary || {};
        const o = job.spec.optimizer;
        const m = job.spec.model;
        return el(
          "tr",
          {},
          el("td", {}, el("span", { class: "swatch", style: `background:${MF.chartColor(i)}` })),
          el("td", { class: "name" }, el("a", { href: `/jobs/${job.id}` }, job.name || "(unnamed)")),
          el("td", { class: "id" }, job.id),
          el("td", {}, statusBadge(job.status)),
          el("td", {}, o.name),
          el("td", { class: "num" }, fmt.param(o.lr)),
          el("td", {}, fmt.model(m)),
          el("td", { class: "num" }, `${fmt.int(job.progress.step)} / ${fmt.int(job.progress.total_steps)}`),
          el("td", { class: "num" }, fmt.num(s[M.LOSS])),
          el("td", { class: "num" }, fmt.num(s[M.VAL_LOSS])),
          el("td", { class: "num" }, fmt.num(s[M.ATTN_MAX_LOGIT])),
          el("td", { class: "num" }, fmt.int(s[M.TOKENS_PER_S]))
        );
      })
    );
  }

  async function main() {
    if (MF.query("metric")) $("metric").value = MF.query("metric"); // a link's metric (?metric=)
    if (!ids.length) {
      $("no-jobs").hidden = false;
      return;
    }
    const early = fetchAll(metricName(), null, ids).catch(() => null); // in parallel with the jobs' own requests
    const found = await Promise.all(ids.map((id) => api(`/v1/jobs/${encodeURIComponent(id)}`).catch((e) => e)));
    jobs = found.filter((j) => !(j instanceof Error));
    const missing = ids.filter((_, i) => found[i] instanceof Error);
    if (missing.length) MF.banner(`Not found: ${missing.join(", ")}`);
    if (!jobs.length) return;
    $("content").hidden = false;
    $("smoothing-value").textContent = Number($("smoothing").value).toFixed(2);
    renderTable();
    await load(await early);
  }

  $("metric").addEventListener("change", () => load().catch(MF.showError));
  $("x-axis").addEventListener("change", () => load().catch(MF.showError));
  for (const id of ["smoothing", "log-y"])
    $(id).addEventListener("input", () => {
      $("smoothing-value").textContent = Number($("smoothing").value).toFixed(2);
      chart && chart.setView(view());
    });
  $("reset-zoom").addEventListener("click", () => zoom(null, null));

  main().catch(MF.showError);
})();
