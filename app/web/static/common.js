// Shared by every page: the API client, a DOM builder that only ever sets text, formatting,
// status badges, a visibility-aware poller and sign-out. Everything hangs off window.MF.
"use strict";

(function () {
  class ApiError extends Error {
    constructor(status, code, message, param) {
      super(message);
      this.status = status;
      this.code = code;
      this.param = param;
    }
  }

  // fetch() against the same origin's /v1 API; the session cookie authenticates. JSON in, JSON
  // out; an error answer becomes an ApiError with the API's code, message and param.
  async function api(path, { method = "GET", body, signal } = {}) {
    const init = { method, signal, headers: { Accept: "application/json" }, credentials: "same-origin" };
    if (body !== undefined) {
      init.headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body);
    }
    const response = await fetch(path, init);
    if (response.status === 204) return null;
    let data = null;
    try {
      data = await response.json();
    } catch (_) {
      /* not JSON: handled below */
    }
    if (!response.ok) {
      const e = (data && data.error) || { code: "internal", message: `HTTP ${response.status}`, param: null };
      throw new ApiError(response.status, e.code, e.message, e.param);
    }
    return data;
  }

  // el("td", {class: "num", title: t}, "text", child, ...): attributes are set as attributes and
  // children appended as nodes or text nodes, never parsed as markup.
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value === undefined || value === null || value === false) continue;
      if (key === "dataset") Object.assign(node.dataset, value);
      else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
      else node.setAttribute(key, value === true ? "" : String(value));
    }
    for (const child of children.flat()) {
      if (child === undefined || child === null || child === false) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  const fmt = {
    num(v, digits = 4) {
      if (v === undefined || v === null || Number.isNaN(v)) return "–";
      if (v === 0) return "0";
      const a = Math.abs(v);
      if (a >= 1e5 || a < 1e-3) return v.toExponential(2);
      return Number(v.toPrecision(digits)).toString();
    },
    int(v) {
      return v === undefined || v === null ? "–" : Math.round(v).toLocaleString("en-US");
    },
    bytes(n) {
      const units = ["B", "KiB", "MiB", "GiB", "TiB"];
      let i = 0;
      while (n >= 1024 && i < units.length - 1) (n /= 1024), i++;
      return `${i ? n.toFixed(1) : n} ${units[i]}`;
    },
    duration(seconds) {
      if (seconds === undefined || seconds === null || !Number.isFinite(seconds)) return "–";
      const s = Math.max(0, Math.round(seconds));
      if (s < 60) return `${s}s`;
      if (s < 3600) return `${Math.floor(s / 60)}m ${s % 60}s`;
      if (s < 86400) return `${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m`;
      return `${Math.floor(s / 86400)}d ${Math.floor((s % 86400) / 3600)}h`;
    },
    age(iso) {
      return iso ? `${fmt.duration((Date.now() - Date.parse(iso)) / 1000)} ago` : "–";
    },
    time(iso) {
      return iso ? new Date(iso).toLocaleString() : "–";
    },
    // A hyperparameter: a fraction to 4 significant digits (an lr of 0.006160940191909269 is
    // 0.006161), whole numbers and words as they are, anything else as JSON.
    param(v) {
      if (typeof v === "number" && Number.isFinite(v) && !Number.isInteger(v)) return fmt.num(v);
      return v !== null && typeof v === "object" ? JSON.stringify(v) : String(v);
    },
    // A spec's data in a few words: its source and tokenizer ("pysource, bpe 4,096", "ds_…, the
    // model's tokenizer"; the synthetic task has its own tokens), and "inputs trained on" with
    // train_on_inputs.
    data(d) {
      if (d.builtin === "synthetic") return "synthetic task";
      const source = d.builtin || d.dataset_id || d.path || "–";
      const t = d.tokenizer ?? "byte";
      const tokenizer =
        typeof t === "string" ? t : t.type === "bpe" ? `bpe ${fmt.int(t.vocab_size)}` : "the model's tokenizer";
      return `${source}, ${tokenizer}${d.train_on_inputs ? ", inputs trained on" : ""}`;
    },
    // A spec's network in a few words: "gpt 2×64", a transformers model by its family ("llama 2×64").
    model(m) {
      return `${m.hf ? m.hf.config.model_type : m.arch} ${m.n_layer}×${m.d_model}`;
    },
  };

  // The server's statuses and metric names (contract.status, contract.metrics), embedded in
  // every page: no page spells one itself. M.head(l, h) names a head's max logit series.
  const CONTRACT = JSON.parse(document.getElementById("contract").textContent);
  const STATUS = CONTRACT.status;
  const FINISHED = new Set(STATUS.finished);
  const fill = (template, values) => template.replace(/\{(\w+)\}/g, (_, key) => String(values[key]));
  const M = {
    ...CONTRACT.metrics.names,
    head: (layer, head) => fill(CONTRACT.metrics.templates.head_max_logit, { layer, head }),
  };

  function statusBadge(status) {
    return el("span", { class: `status status-${status}` }, status);
  }

  // The job's running time: start to finish, or to now while it runs.
  function jobDuration(job) {
    if (!job.started_at) return null;
    const end = job.finished_at ? Date.parse(job.finished_at) : Date.now();
    return (end - Date.parse(job.started_at)) / 1000;
  }

  function progressBar(job) {
    const { step, total_steps: total } = job.progress;
    const share = total ? Math.min(1, step / total) : 0;
    return el(
      "div",
      { class: "progress", role: "progressbar", "aria-valuemin": 0, "aria-valuemax": total, "aria-valuenow": step },
      el("div", { class: `progress-fill status-bg-${job.status}`, style: `width:${(share * 100).toFixed(1)}%` }),
      el("span", { class: "progress-text" }, `${fmt.int(step)} / ${fmt.int(total)}`)
    );
  }

  // Calls fn every `visible` ms while the tab is visible and every `hidden` ms while it is not;
  // one call at a time, and at once when the tab becomes visible again.
  function poll(fn, { visible = 2000, hidden = 30000 } = {}) {
    let timer = null;
    let running = false;
    let stopped = false;
    async function tick() {
      if (stopped || running) return;
      running = true;
      clearTimeout(timer);
      try {
        await fn();
      } catch (e) {
        showError(e);
      } finally {
        running = false;
        if (!stopped) timer = setTimeout(tick, document.hidden ? hidden : visible);
      }
    }
    document.addEventListener("visibilitychange", () => {
      if (!document.hidden) tick();
    });
    tick();
    return { stop: () => ((stopped = true), clearTimeout(timer)), now: tick };
  }

  function banner(message, kind = "error") {
    const node = document.getElementById("banner");
    if (!node) return;
    node.textContent = message || "";
    node.className = `banner banner-${kind}`;
    node.hidden = !message;
  }

  function showError(e) {
    if (e instanceof ApiError && e.status === 401) {
      location.reload(); // the key is gone or revoked: the page turns into the sign-in form
      return;
    }
    banner(e instanceof ApiError ? `${e.message}${e.param ? ` (${e.param})` : ""}` : String(e.message || e));
  }

  // A performance mark once what was just drawn is on screen (the next frame), for measuring.
  function markDrawn(name) {
    requestAnimationFrame(() => performance.mark(name));
  }

  function query(name) {
    return new URLSearchParams(location.search).get(name);
  }

  document.addEventListener("DOMContentLoaded", () => {
    const out = document.getElementById("sign-out");
    if (out)
      out.addEventListener("click", async () => {
        await api("/v1/session", { method: "DELETE" });
        location.assign("/");
      });
  });

  window.MF = {
    ApiError, api, el, fmt, STATUS, FINISHED, M, statusBadge, jobDuration, progressBar, poll, banner, showError, query, markDrawn,
  };
})();
