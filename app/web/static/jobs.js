// The jobs page: newest first, a status filter and one that hides sweeps' trials, "load more",
// polling while the tab is visible (slower while hidden), and checkboxes that open the compare
// page. A trial links its sweep, named once its sweep has been read.
"use strict";

(function () {
  const { api, el, fmt, statusBadge, progressBar, jobDuration, poll, M } = MF;
  const PAGE = 20;
  const MAX_REFRESH = 100; // the API's largest page: rows beyond it are refreshed when loaded again
  const MAX_COMPARE = 20;
  const body = document.querySelector("#jobs tbody");
  const filter = document.getElementById("status-filter");
  const hideTrials = document.getElementById("hide-trials");
  const more = document.getElementById("load-more");
  const compare = document.getElementById("compare");
  const selectAll = document.getElementById("select-all");
  let jobs = []; // newest first
  let nextAfter = null;
  const selected = new Set();
  const sweepNames = new Map(); // sweep id -> its name (null: unnamed or unreadable), once asked

  function listUrl(limit, after) {
    const params = new URLSearchParams({ limit: String(limit) });
    if (filter.value) params.set("status", filter.value);
    if (hideTrials.checked) params.set("trials", "false");
    if (after) params.set("after", after);
    return `/v1/jobs?${params}`;
  }

  // The trial's sweep: a link named after the sweep once it is known (its id until then).
  function sweepCell(job) {
    if (!job.sweep_id) return el("td", { class: "sweep" });
    const name = sweepNames.get(job.sweep_id);
    return el(
      "td",
      { class: "sweep" },
      el("a", { href: `/sweeps/${encodeURIComponent(job.sweep_id)}`, title: `A trial of sweep ${job.sweep_id}` }, name || job.sweep_id)
    );
  }

  // The latest val_loss and the step it was measured at.
  function valLossCell(job) {
    const value = (job.summary || {})[M.VAL_LOSS];
    const step = job.val_loss_step;
    const at = value !== undefined && value !== null && step !== undefined && step !== null;
    return el(
      "td",
      { class: "num", title: at ? `at step ${fmt.int(step)}` : null },
      fmt.num(value),
      at ? el("span", { class: "at-step" }, ` @ ${fmt.int(step)}`) : null
    );
  }

  // Reads the name of every sweep not asked for yet, then draws the rows again.
  async function nameSweeps() {
    const unknown = [...new Set(jobs.map((j) => j.sweep_id).filter((id) => id && !sweepNames.has(id)))];
    if (!unknown.length) return;
    for (const id of unknown) sweepNames.set(id, null); // asked once
    const found = await Promise.all(unknown.map((id) => api(`/v1/sweeps/${encodeURIComponent(id)}`).catch(() => null)));
    found.forEach((sweep, i) => sweepNames.set(unknown[i], sweep ? sweep.name : null));
    render();
  }

  function row(job) {
    const s = job.summary || {};
    const box = el("input", { type: "checkbox", "aria-label": `Select ${job.name || job.id}` });
    box.checked = selected.has(job.id);
    box.addEventListener("change", () => {
      box.checked ? selected.add(job.id) : selected.delete(job.id);
      updateCompare();
    });
    return el(
      "tr",
      { dataset: { id: job.id } },
      el("td", {}, box),
      el("td", { class: "name", title: job.name || "" }, el("a", { href: `/jobs/${job.id}` }, job.name || "(unnamed)")),
      el("td", { class: "id" }, el("a", { href: `/jobs/${job.id}` }, job.id)),
      sweepCell(job),
      el("td", {}, statusBadge(job.status)),
      el("td", {}, progressBar(job)),
      el("td", { class: "num" }, fmt.num(s[M.LOSS])),
      valLossCell(job),
      el("td", { class: "num" }, fmt.num(s[M.ATTN_MAX_LOGIT])),
      el("td", { class: "num" }, fmt.int(s[M.TOKENS_PER_S])),
      el("td", { title: fmt.time(job.created_at) }, fmt.age(job.created_at)),
      el("td", {}, fmt.duration(jobDuration(job)))
    );
  }

  function render() {
    body.replaceChildren(...jobs.map(row));
    const filtered = Boolean(filter.value) || hideTrials.checked;
    document.getElementById("empty").hidden = jobs.length > 0 || filtered; // the tenant has no job at all
    document.getElementById("no-match").hidden = jobs.length > 0 || !filtered;
    const outside = hideTrials.checked ? " outside sweeps" : "";
    document.getElementById("no-match-text").textContent = `No ${filter.value ? `${filter.value.replace("_", " ")} ` : ""}jobs${outside}.`;
    more.hidden = !nextAfter;
    document.getElementById("count").textContent = jobs.length ? `${jobs.length} shown` : "";
    selectAll.checked = jobs.length > 0 && jobs.every((j) => selected.has(j.id));
    updateCompare();
  }

  function updateCompare() {
    const n = selected.size;
    compare.disabled = n < 2 || n > MAX_COMPARE;
    compare.textContent = n ? `Compare selected (${n})` : "Compare selected";
    compare.title = n > MAX_COMPARE ? `At most ${MAX_COMPARE} jobs` : "";
  }

  // The loaded window again (the newest MAX_REFRESH rows), keeping older rows loaded beyond it.
  async function refresh() {
    const limit = Math.min(MAX_REFRESH, Math.max(PAGE, jobs.length));
    const page = await api(listUrl(limit));
    const oldest = page.data.length ? page.data[page.data.length - 1].id : null;
    const tail = oldest && page.has_more ? jobs.filter((j) => j.id < oldest) : [];
    jobs = page.data.concat(tail);
    if (!tail.length) nextAfter = page.next_after;
    render();
    await nameSweeps();
  }

  async function reload() {
    const page = await api(listUrl(PAGE));
    jobs = page.data;
    nextAfter = page.next_after;
    render();
    await nameSweeps();
  }

  more.addEventListener("click", async () => {
    const page = await api(listUrl(PAGE, nextAfter));
    jobs = jobs.concat(page.data);
    nextAfter = page.next_after;
    render();
    await nameSweeps();
  });
  filter.addEventListener("change", () => reload().catch(MF.showError));
  hideTrials.addEventListener("change", () => reload().catch(MF.showError));
  document.getElementById("clear-filters").addEventListener("click", () => {
    filter.value = "";
    hideTrials.checked = false;
    reload().catch(MF.showError);
  });
  selectAll.addEventListener("change", () => {
    for (const j of jobs) selectAll.checked ? selected.add(j.id) : selected.delete(j.id);
    render();
  });
  compare.addEventListener("click", () => {
    location.assign(`/compare?jobs=${[...selected].join(",")}`);
  });

  poll(refresh, { visible: 2000, hidden: 30000 });
})();
