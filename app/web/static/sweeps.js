// The sweeps page: newest first, a status filter, "load more", polling while the tab is visible.
"use strict";

(function () {
  const { api, el, fmt, statusBadge, poll, STATUS } = MF;
  const PAGE = 20;
  const body = document.querySelector("#sweeps tbody");
  const filter = document.getElementById("status-filter");
  const more = document.getElementById("load-more");
  let sweeps = [];
  let nextAfter = null;
  const DONE = new Set(STATUS.trial_finished);

  function listUrl(limit, after) {
    const params = new URLSearchParams({ limit: String(limit) });
    if (filter.value) params.set("status", filter.value);
    if (after) params.set("after", after);
    return `/v1/sweeps?${params}`;
  }

  function row(s) {
    const counts = s.counts.by_status;
    const done = Object.entries(counts).reduce((n, [status, k]) => n + (DONE.has(status) ? k : 0), 0);
    const stopped = counts.stopped_early ? `, ${counts.stopped_early} stopped early` : "";
    const href = `/sweeps/${s.id}`;
    return el(
      "tr",
      { dataset: { id: s.id } },
      el("td", { class: "name", title: s.name || "" }, el("a", { href }, s.name || "(unnamed)")),
      el("td", { class: "id" }, el("a", { href }, s.id)),
      el("td", {}, statusBadge(s.status)),
      el("td", {}, `${done} / ${s.counts.total} finished${stopped}`),
      el("td", {}, s.best ? el("a", { href: `/jobs/${s.best.job_id}` }, `#${s.best.number}`) : "–"),
      el("td", { class: "num" }, s.best ? `${s.metric} ${fmt.num(s.best.metric)}` : "–"),
      el("td", { title: fmt.time(s.created_at) }, fmt.age(s.created_at))
    );
  }

  function render() {
    body.replaceChildren(...sweeps.map(row));
    document.getElementById("empty").hidden = sweeps.length > 0;
    more.hidden = !nextAfter;
    document.getElementById("count").textContent = sweeps.length ? `${sweeps.length} shown` : "";
  }

  async function refresh() {
    const page = await api(listUrl(Math.min(100, Math.max(PAGE, sweeps.length))));
    sweeps = page.data;
    nextAfter = page.next_after;
    render();
  }

  more.addEventListener("click", async () => {
    const page = await api(listUrl(PAGE, nextAfter));
    sweeps = sweeps.concat(page.data);
    nextAfter = page.next_after;
    render();
  });
  filter.addEventListener("change", () => refresh().catch(MF.showError));
  poll(refresh, { visible: 3000, hidden: 30000 });
})();
