// One job: status, progress and ETA, spec, error, cancel; curves from the downsampled history
// (max_points = the chart's pixel width) then live points from the events stream (resumed by the
// browser with Last-Event-ID after a dropped connection; polling when the stream cannot be
// opened); zoom re-fetches the range at full resolution; a layer x head heatmap of the max
// attention logits; samples, log lines, checkpoints and the parameter routing (routing.js).
"use strict";

(function () {
  const { api, el, fmt, statusBadge, progressBar, jobDuration, STATUS, FINISHED, M, ApiError } = MF;
  const root = document.getElementById("job");
  const jobId = root.dataset.jobId;
  const $ = (id) => document.getElementById(id);
  const POLL_MS = 2000;
  const RETRY_MS = 5000; // the first wait before a refused stream is opened again; it doubles up to
  const MAX_RETRY_MS = 60000;
  const MAX_HEATMAP_ROWS = 512; // layers x heads drawn as rows
  const routing = new MF.RoutingSection(jobId, $("routing-card"));

  let job = null;
  let charts = [];
  let heatmap = null;
  let zoom = null; // [lo, hi] steps while zoomed
  let lastStep = -1; // the newest telemetry step drawn
  const latest = {}; // the newest value of every metric seen
  const elapsed = []; // [[step, elapsed_s], ...]: the wall-time axis
  let stream = null;
  let lastEventId = ""; // the newest event id received: a new stream resumes after it
  let retryMs = RETRY_MS;
  let refused = false; // the server refused the last stream: the banner says so
  let poller = null; // polls while the stream is refused and the job runs
  let known = null; // [attempt, steps recorded] of the newest Job read: the stream replays older ones first
  let queueAhead = null; // queued: the queued jobs ahead of it, as last read
  let queuePoller = null; // reads that again while the job waits
  let following = false; // the history is drawn (if any): the rest comes from the stream
  const QUEUE_POLL_MS = 5000;

  // -- head, facts, spec ----------------------------------------------------------------------
  function fact(label, value) {
    return el("div", { class: "fact" }, el("div", { class: "k" }, label), el("div", { class: "v" }, value));
  }

  function eta() {
    const done = job.progress.step;
    const total = job.progress.total_steps;
    if (FINISHED.has(job.status) || job.status === STATUS.job.PAUSED || done >= total) return null;
    const seconds = latest[M.ELAPSED_S] ?? (job.summary || {})[M.ELAPSED_S];
    return seconds && done > 0 ? (seconds / done) * (total - done) : null;
  }

  function renderHead() {
    const spec = job.spec;
    const s = { ...(job.summary || {}), ...latest };
    document.title = `${job.name || job.id} · muonforge`;
    $("job-name").textContent = job.name || "(unnamed)";
    $("job-status").replaceChildren(statusBadge(job.status));
    $("job-id").textContent = job.id;
    const opt = spec.optimizer;
    const model = spec.model;
    $("facts").replaceChildren(
      fact("progress", progressBar(job)),
      fact("ETA", eta() === null ? "–" : fmt.duration(eta())),
      fact("attempt", String(job.attempt)),
      fact(M.LOSS, fmt.num(s[M.LOSS])),
      fact(M.VAL_LOSS, fmt.num(s[M.VAL_LOSS])),
      fact("max attention logit", fmt.num(s[M.ATTN_MAX_LOGIT])),
      fact("tokens/s", fmt.int(s[M.TOKENS_PER_S])),
      fact("optimizer", `${opt.name}, lr ${fmt.param(opt.lr)}${opt.qk_clip_tau ? `, tau ${opt.qk_clip_tau}` : ""}`),
      fact("model", `${fmt.model(model)}, ${model.n_head} heads, seq ${model.seq_len}`),
      fact("data", fmt.data(spec.data)),
      fact("created", fmt.time(job.created_at)),
      fact("started", fmt.time(job.started_at)),
      fact("duration", fmt.duration(jobDuration(job)))
    );
    if (job.parent) {
      // A warm start (init_from): the job and checkpoint it started from.
      const { job_id: parent, step } = job.parent;
      const link = el("a", { href: `/jobs/${encodeURIComponent(parent)}` }, `${parent} at step ${step}`);
      $("facts").append(fact("started from", link));
    }
    $("cancel").hidden = FINISHED.has(job.status) || job.status === STATUS.job.CANCELLING;
    $("compare-link").href = `/compare?jobs=${job.id}`;
    const error = $("job-error");
    error.hidden = !job.error;
    if (job.error) error.textContent = `${job.error.code}: ${job.error.message}`;
    const stopped = $("job-stopped"); // early stopping (train.early_stop, ASHA): where and why; or where it waits
    const summary = job.summary || {};
    stopped.hidden = summary.stopped_at === undefined;
    const how = job.status === STATUS.job.PAUSED ? "Paused" : "Stopped early";
    if (!stopped.hidden) stopped.textContent = `${how} at step ${summary.stopped_at}: ${summary.stop_reason}`;
    renderState();
    routing.follow(job);
  }

  // -- before the first step ------------------------------------------------------------------
  // Curves once the job has run a step or a worker holds it; before that, the page says why there
  // are none (waiting in the queue, cancelled or failed before it ran) instead of empty charts.
  function hasCurves() {
    return charts.length > 0 || job.progress.step > 0 || job.status === STATUS.job.RUNNING || job.status === STATUS.job.CANCELLING;
  }

  function renderState() {
    const curves = hasCurves();
    let title = "";
    let detail = "";
    if (job.status === STATUS.job.QUEUED) {
      title = queueAhead === null ? "Waiting in queue" : `Waiting in queue, ${queueAhead ? fmt.int(queueAhead) : "none"} ahead`;
      detail = curves
        ? "It goes on from its latest checkpoint once a worker takes it."
        : "Its curves appear here once a worker takes it.";
    } else if (!curves && job.status === STATUS.job.CANCELLED) {
      title = job.started_at ? "Cancelled before its first step" : "Cancelled before it started";
    } else if (!curves && job.status === STATUS.job.FAILED) {
      title = job.started_at ? "Failed before its first step" : "Failed before it started";
      detail = job.error ? `${job.error.code}: ${job.error.message}` : "";
      $("job-error").hidden = true; // said here
    } else if (!curves) {
      title = "No steps ran";
    }
    $("job-state").hidden = !title;
    $("job-state-title").textContent = title;
    $("job-state-detail").textContent = detail;
    $("job-state-detail").hidden = !detail;
    $("chart-controls").hidden = !curves;
    $("charts").hidden = !curves;
    if (curves && !charts.length) showCurves();
  }

  function showCurves() {
    buildCharts();
    MF.shown = { charts, heatmap }; // what the page draws, for tests and the console
    if (!following) return; // the page's first load draws the history next
    charts.forEach((c) => c.setHistory({})); // a job that has just started: its steps arrive live
    if (heatmap) heatmap.setHistory({});
  }

  // While the job waits in the queue: the jobs ahead of it, read again every few seconds (the
  // stream says when it starts).
  function followQueue() {
    queuePoller = MF.poll(
      async () => {
        if (job.status !== STATUS.job.QUEUED) return queuePoller && queuePoller.stop();
        const now = await api(`/v1/jobs/${jobId}`);
        queueAhead = now.queue_position ?? null;
        onStatus(now);
      },
      { visible: QUEUE_POLL_MS, hidden: QUEUE_POLL_MS * 6 }
    );
  }

  let headPending = null;
  function renderHeadSoon() {
    if (!headPending) headPending = setTimeout(() => ((headPending = null), renderHead()), 1000);
  }

  // -- charts ---------------------------------------------------------------------------------
  function chartSpecs(spec) {
    const attention = spec.model.arch !== "mlp";
    const opt = spec.optimizer;
    const clip = opt.qk_clip_tau !== null && opt.qk_clip_tau !== undefined; // set for muonclip and normuonclip
    return [
      { title: "Loss", series: [{ name: M.LOSS }, { name: M.VAL_LOSS }] },
      attention && {
        title: "Max attention logit",
        series: [{ name: M.ATTN_MAX_LOGIT, label: "max logit" }],
        refLine: clip ? { value: opt.qk_clip_tau, label: `tau ${opt.qk_clip_tau}` } : null,
      },
      clip && {
        title: "QK-Clip",
        // A count of heads (at most every head of every layer), and gamma, the factor in (0, 1].
        y: { label: "heads clipped", range: [0, spec.model.n_layer * spec.model.n_head], whole: true },
        y2: { label: "min gamma", range: [0, 1] },
        series: [
          { name: M.QK_CLIP_HEADS_CLIPPED, label: "heads clipped" },
          { name: M.QK_CLIP_MIN_GAMMA, label: "min gamma", scale: "y2" },
        ],
      },
      { title: "Learning rate", series: [{ name: M.LR }] },
      { title: "Gradient norm (before clipping)", series: [{ name: M.GRAD_NORM, label: "grad norm" }] },
      opt.name !== "adamw" && { title: "Muon update RMS", series: [{ name: M.UPDATE_RMS, label: "update rms" }] },
      { title: "Tokens/s", series: [{ name: M.TOKENS_PER_S, label: "tokens/s" }] },
    ].filter(Boolean);
  }

  function view() {
    const tokensPerStep = job.spec.train.batch_size * job.spec.model.seq_len;
    return {
      smoothing: Number($("smoothing").value),
      logY: $("log-y").checked,
      ...MF.xAxis($("x-axis").value, tokensPerStep, elapsed),
    };
  }

  function buildCharts() {
    const box = $("charts");
    charts = chartSpecs(job.spec).map((spec) => {
      const body = el("div", { class: "chart" });
      box.append(el("section", { class: "card chart-card", dataset: { chart: spec.title } }, el("h2", {}, spec.title), body));
      return new MF.Chart(body, spec, view(), zoomTo);
    });
    const { arch, n_layer: layers, n_head: heads } = job.spec.model;
    const perHead = (job.spec.telemetry || {}).per_head !== false; // per-head series off: no heatmap to draw
    if (arch !== "mlp" && perHead && layers * heads <= MAX_HEATMAP_ROWS) {
      $("heatmap-card").hidden = false;
      const tau = job.spec.optimizer.qk_clip_tau;
      heatmap = new MF.Heatmap($("heatmap"), { layers, heads, totalSteps: job.progress.total_steps, reference: tau || null });
      heatmap.onScale = (top) => ($("heatmap-ref").textContent = `${fmt.num(top)}${tau && top >= tau ? " (tau)" : ""}`);
      $("heatmap-over").hidden = !tau;
    }
  }

  async function history(names, maxPoints, range) {
    const params = new URLSearchParams({ names: names.join(","), max_points: String(Math.max(3, maxPoints)) });
    if (range) params.set("from_step", range[0]), params.set("to_step", range[1]);
    const data = await api(`/v1/jobs/${jobId}/metrics?${params}`);
    return Object.fromEntries(data.series.map((s) => [s.name, s.points]));
  }

  function noteHistory(series) {
    for (const [name, points] of Object.entries(series)) {
      if (points.length) {
        lastStep = Math.max(lastStep, points[points.length - 1][0]);
        latest[name] = latest[name] ?? points[points.length - 1][1];
      }
    }
  }

  async function loadHistory() {
    const width = Math.max(...charts.map((c) => c.width));
    // The first chart first: its curves are drawn while the others load.
    const first = await history([...charts[0].names, M.ELAPSED_S], width);
    elapsed.push(...(first[M.ELAPSED_S] || []));
    noteHistory(first);
    charts[0].setView(view());
    charts[0].setHistory(first);
    MF.markDrawn("mf:first-curves");
    const rest = charts.slice(1).flatMap((c) => c.names);
    const [others, heads] = await Promise.all([
      rest.length ? history(rest, width) : {},
      heatmap ? history(heatmap.names(), heatmap.columns) : null,
    ]);
    noteHistory(others);
    for (const chart of charts.slice(1)) {
      chart.setView(view());
      chart.setHistory(others);
    }
    if (heads) heatmap.setHistory(heads);
    MF.markDrawn("mf:all-curves");
  }

  async function zoomTo(lo, hi) {
    if (lo === null) {
      zoom = null;
      $("reset-zoom").hidden = true;
      charts.forEach((c) => c.resetZoom());
      return;
    }
    zoom = [lo, hi];
    $("reset-zoom").hidden = false;
    const width = Math.max(...charts.map((c) => c.width));
    performance.mark("mf:zoom-asked");
    const points = await history(charts.flatMap((c) => c.names), width, zoom);
    charts.forEach((c) => c.showZoom(points, lo, hi));
    MF.markDrawn("mf:zoom-drawn");
  }

  function onMetrics(step, values) {
    if (step <= lastStep) return; // drawn already (the history and the stream overlap)
    if (!charts.length) showCurves(); // the first step of a job that was waiting
    lastStep = Math.max(lastStep, step);
    Object.assign(latest, values);
    if (values[M.ELAPSED_S] !== undefined) elapsed.push([step, values[M.ELAPSED_S]]);
    charts.forEach((c) => c.append(step, values));
    if (heatmap) heatmap.append(step, values);
    job.progress.step = Math.max(job.progress.step, step);
    renderHeadSoon();
  }

  // -- events ---------------------------------------------------------------------------------
  function onStatus(next) {
    // The stream replays the job's history: a finished job's earlier snapshots must not replace it.
    if (FINISHED.has(job.status) && !FINISHED.has(next.status)) return;
    // Nor an unfinished job's older ones: an earlier attempt's, or fewer steps recorded in the same one.
    const [attempt, steps] = known;
    if (next.attempt < attempt || (next.attempt === attempt && next.progress.step < steps)) return;
    known = [next.attempt, next.progress.step];
    job = next;
    renderHead();
  }

  function addLog(data) {
    const box = $("log");
    if (box.querySelector("p.muted")) box.replaceChildren();
    box.append(el("div", { class: `level-${data.level}` }, `${data.level}: ${data.message}`));
    box.scrollTop = box.scrollHeight;
  }

  function addSample(data) {
    const box = $("samples");
    if (box.querySelector("p.muted")) box.replaceChildren();
    box.prepend(
      el(
        "div",
        { class: "sample" },
        el("div", { class: "muted" }, `step ${fmt.int(data.step)}`),
        el("div", { class: "text" }, el("span", { class: "prompt" }, data.prompt), data.text)
      )
    );
  }

  let checkpointsPending = null;
  function refreshCheckpointsSoon() {
    if (!checkpointsPending)
      checkpointsPending = setTimeout(() => ((checkpointsPending = null), loadCheckpoints().catch(MF.showError)), 500);
  }

  async function loadCheckpoints() {
    const list = (await api(`/v1/jobs/${jobId}/checkpoints`)).data;
    $("no-checkpoints").hidden = list.length > 0;
    document.querySelector("#checkpoints tbody").replaceChildren(
      ...list.map((c) =>
        el(
          "tr",
          {},
          el("td", { class: "num" }, fmt.int(c.step)),
          el("td", { class: "num" }, fmt.bytes(c.bytes)),
          el("td", { class: "num" }, fmt.num(c.metrics[M.LOSS])),
          el("td", { class: "num" }, fmt.num(c.metrics[M.VAL_LOSS])),
          el("td", { class: "num" }, fmt.num(c.metrics[M.ATTN_MAX_LOGIT])),
          el("td", {}, fmt.time(c.created_at)),
          el("td", {}, el("a", { href: `/v1/jobs/${jobId}/checkpoints/${c.step}`, download: "" }, "download"))
        )
      )
    );
  }

  // The events stream from the first step not drawn yet: every job event (status, checkpoint,
  // log, sample), then live metrics; the browser reconnects by itself with Last-Event-ID. A
  // stream the server refuses (a 429 once the tenant holds its cap of open streams, a restart)
  // is closed for good: the page then polls and opens a new one later, after the last event it
  // received, so nothing is missed or repeated.
  function openStream() {
    const params = new URLSearchParams({ from_step: lastStep + 1 });
    if (lastEventId) params.set("last_event_id", lastEventId);
    stream = new EventSource(`/v1/jobs/${jobId}/events?${params}`);
    const on = (type, fn) =>
      stream.addEventListener(type, (e) => {
        if (e.lastEventId) lastEventId = e.lastEventId;
        fn(JSON.parse(e.data));
      });
    on("metrics", (d) => onMetrics(d.step, d.metrics));
    on("status", onStatus);
    on("log", addLog);
    on("sample", addSample);
    on("checkpoint", refreshCheckpointsSoon);
    stream.addEventListener("done", () => {
      stream.close();
      // The job has finished and the stream has given every event: an empty panel stays empty.
      for (const p of document.querySelectorAll("#samples > p.muted, #log > p.muted")) p.textContent = "None.";
      clearTimeout(checkpointsPending); // the list is read once more here, at the end: not twice
      checkpointsPending = null;
      loadCheckpoints()
        .then(() => ($("no-checkpoints").textContent = "None."))
        .catch(MF.showError);
    });
    stream.addEventListener("open", () => {
      retryMs = RETRY_MS;
      if (!refused) return;
      refused = false;
      if (poller) poller.stop();
      poller = null;
      MF.banner("");
    });
    stream.addEventListener("error", () => {
      if (stream.readyState === EventSource.CLOSED) streamRefused(); // refused, not just dropped
    });
  }

  function streamRefused() {
    refused = true;
    const wait = retryMs;
    retryMs = Math.min(retryMs * 2, MAX_RETRY_MS);
    MF.banner(
      `Live updates are unavailable: the page refreshes every ${POLL_MS / 1000} s and reconnects in ` +
        `${wait / 1000} s. Logs and samples arrive once it has.`,
      "info"
    );
    if (!poller && !FINISHED.has(job.status)) poller = pollInstead();
    setTimeout(openStream, wait);
  }

  // The fallback while there is no stream: the job and its new metrics every POLL_MS, until it
  // has finished.
  function pollInstead() {
    const p = MF.poll(async () => {
      onStatus(await api(`/v1/jobs/${jobId}`));
      const names = [...new Set(charts.flatMap((c) => c.names).concat(heatmap ? heatmap.names() : [], [M.ELAPSED_S]))];
      const params = new URLSearchParams({ names: names.join(","), max_points: "100000", from_step: lastStep + 1 });
      const data = await api(`/v1/jobs/${jobId}/metrics?${params}`);
      const byStep = new Map();
      for (const s of data.series) for (const [step, v] of s.points) (byStep.get(step) || byStep.set(step, {}).get(step))[s.name] = v;
      [...byStep.keys()].sort((a, b) => a - b).forEach((step) => onMetrics(step, byStep.get(step)));
      if (FINISHED.has(job.status)) {
        p.stop();
        await loadCheckpoints();
      }
    }, { visible: POLL_MS, hidden: POLL_MS * 5 });
    return p;
  }

  // -- controls -------------------------------------------------------------------------------
  function applyView() {
    $("smoothing-value").textContent = Number($("smoothing").value).toFixed(2);
    const v = view();
    charts.forEach((c) => c.setView(v));
  }

  for (const id of ["smoothing", "log-y", "x-axis"]) $(id).addEventListener("input", applyView);
  $("reset-zoom").addEventListener("click", () => zoomTo(null, null));
  $("cancel").addEventListener("click", async () => {
    if (!confirm(`Cancel job ${job.name || job.id}? It stops at its next step.`)) return;
    try {
      onStatus(await api(`/v1/jobs/${jobId}/cancel`, { method: "POST" }));
    } catch (e) {
      MF.showError(e);
    }
  });

  async function main() {
    try {
      job = await api(`/v1/jobs/${jobId}`);
    } catch (e) {
      if (e instanceof ApiError && e.status === 404) {
        $("missing-id").textContent = jobId;
        $("not-found").hidden = false;
        return;
      }
      throw e;
    }
    $("content").hidden = false;
    MF.shown = { charts, heatmap }; // none until the job has curves
    queueAhead = job.queue_position ?? null;
    known = [job.attempt, job.progress.step];
    renderHead();
    $("spec").textContent = jsyaml.dump(job.spec, { lineWidth: 100 }); // in the API's order: the JobSpec's fields
    $("smoothing-value").textContent = Number($("smoothing").value).toFixed(2);
    if (charts.length) await loadHistory(); // drawn by renderHead where the job has curves
    following = true;
    openStream();
    if (job.status === STATUS.job.QUEUED) followQueue();
    await loadCheckpoints();
  }

  main().catch(MF.showError);
})();
