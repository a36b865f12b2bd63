// The job page's "Parameter routing" section: GET /v1/jobs/{id}/routing as a summary line (each
// optimizer's parameters and values), the warnings of the job's log, and every parameter in a
// table, collapsed when long, the matrices no rule recognized highlighted with their warning.
// Until a worker has built the model the API says why there is no table; the section asks again
// as the job's events arrive, until it shows the latest attempt's table or the job has ended.
"use strict";

(function () {
  const { api, el, fmt, FINISHED } = MF;
  const OPEN_ROWS = 12; // a table of at most this many parameters is shown open
  const ASK_MS = 2000; // asked again at most this often while the table is not the latest attempt's

  function share(label, part, total) {
    const percent = total ? ` (${((100 * part.values) / total).toFixed(1)}%)` : "";
    const parameters = `${fmt.int(part.parameters)} parameter${part.parameters === 1 ? "" : "s"}`;
    return `${label}: ${parameters}, ${fmt.int(part.values)} values${percent}`;
  }

  function summaryLine(table) {
    const { muon, adamw, total } = table.summary;
    if (table.optimizer === "adamw") {
      return `AdamW steps all ${fmt.int(total.parameters)} parameters (${fmt.int(total.values)} values): the optimizer is adamw.`;
    }
    return `${share("Muon", muon, total.values)} · ${share("AdamW", adamw, total.values)}`;
  }

  function row(p) {
    return el(
      "tr",
      { class: p.warning ? "unrecognized" : null, dataset: { role: p.role } },
      el("td", { class: "mono" }, p.name),
      el("td", { class: "mono" }, p.shape.join(" × ")),
      el("td", {}, el("span", { class: `optimizer optimizer-${p.optimizer}` }, p.optimizer === "muon" ? "Muon" : "AdamW")),
      el("td", {}, p.reason, p.warning ? el("div", { class: "routing-warning" }, p.warning) : null),
      el("td", { class: "num" }, fmt.int(p.values))
    );
  }

  class RoutingSection {
    constructor(jobId, card) {
      this.jobId = jobId;
      this.card = card;
      this.attempt = 0; // the attempt whose table is shown (0: none yet)
      this.asked = null; // when the last answer was asked for, and whether the job had ended then
      this.pending = false;
    }

    $(selector) {
      return this.card.querySelector(selector);
    }

    // Called with every new state of the job: asks for the table while it is not the latest
    // attempt's, at most every ASK_MS, and no more once an answer came after the job ended.
    follow(job) {
      const ended = FINISHED.has(job.status);
      if (this.pending || (this.asked && (this.attempt >= job.attempt || this.asked.ended))) return;
      if (this.asked && Date.now() - this.asked.at < ASK_MS) return;
      this.asked = { at: Date.now(), ended };
      this.pending = true;
      this.load()
        .catch(MF.showError)
        .finally(() => (this.pending = false));
    }

    async load() {
      const table = await api(`/v1/jobs/${this.jobId}/routing`);
      if (table.state !== "recorded") {
        this.$("#routing-summary").textContent = table.message; // no table (yet): the API says why
        return;
      }
      this.attempt = table.attempt;
      this.render(table);
    }

    render(table) {
      const summary = this.$("#routing-summary");
      summary.textContent = summaryLine(table);
      summary.classList.remove("muted");
      const warnings = this.$("#routing-warnings");
      warnings.replaceChildren(...table.warnings.map((w) => el("li", {}, w)));
      warnings.hidden = table.warnings.length === 0;
      const details = this.$("#routing-details");
      details.hidden = false;
      details.open = table.parameters.length <= OPEN_ROWS;
      this.$("#routing-toggle").textContent = `Every parameter (${fmt.int(table.parameters.length)})`;
      this.$("tbody").replaceChildren(...table.parameters.map(row));
      MF.markDrawn("mf:routing");
    }
  }

  MF.RoutingSection = RoutingSection;
})();
