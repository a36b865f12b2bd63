// The jobs page: newest first, a status filter, "load more", polling while the tab is visible
// (slower while hidden), and checkboxes that open the compare page.
"use strict";

(function () {
  const { api, el, fmt, statusBadge, progressBar, jobDuration, poll, M } = MF;
  const PAGE = 20;
  const MAX_REFRESH = 100; // the API's largest page: rows beyond it are refreshed when loaded again
  const MAX_COMPARE = 20;
  const body = document.querySelector("#jobs tbody");
  const filter = document.getElementById("status-filter");
  const more = document.getElementById("load-more");
  const compare = document.getElementById("compare");
  const selectAll = document.getElementById("select-all");
  let jobs = []; // newest first
  let nextAfter = null;
  const selected = new Set();

  function listUrl(limit, after) {
    const params = new URLSearchParams({ limit: String(limit) });
    if (filter.value) params.set("status", filter.value);
    if (after) params.set("after", after);
    return `/v1/jobs?${params}`;
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
      el("td", {}, statusBadge(job.status)),
      el("td", {}, progressBar(job)),
      el("td", { class: "num" }, fmt.num(s[M.LOSS])),
      el("td", { class: "num" }, fmt.num(s[M.VAL_LOSS])),
      el("td", { class: "num" }, fmt.num(s[M.ATTN_MAX_LOGIT])),
      el("td", { class: "num" }, fmt.int(s[M.TOKENS_PER_S])),
      el("td", { title: fmt.time(job.created_at) }, fmt.age(job.created_at)),
      el("td", {}, fmt.duration(jobDuration(job)))
    );
  }

  function render() {
    body.replaceChildren(...jobs.map(row));
    document.getElementById("empty").hidden = jobs.length > 0;
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
  }

  async function reload() {
    const page = await api(listUrl(PAGE));
    jobs = page.data;
    nextAfter = page.next_after;
    render();
  }

  more.addEventListener("click", async () => {
    const page = await api(listUrl(PAGE, nextAfter));
    jobs = jobs.concat(page.data);
    nextAfter = page.next_after;
    render();
  });
  filter.addEventListener("change", () => reload().catch(MF.showError));
  selectAll.addEventListener("change", () => {
    for (const j of jobs) selectAll.checked ? selected.add(j.id) : selected.delete(j.id);
    render();
  });
  compare.addEventListener("click", () => {
    location.assign(`/compare?jobs=${[...selected].join(",")}`);
  });

  poll(refresh, { visible: 2000, hidden: 30000 });
})();
