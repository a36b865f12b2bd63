// New job: a form for the common fields and the raw spec (YAML or JSON) beside it, kept in step
// both ways; the examples as presets; dataset upload with a progress bar. The spec text is what
// is submitted, and the API decides what is valid: a 422 is shown at the field it names.
"use strict";

(function () {
  const { api, el, ApiError } = MF;
  const $ = (id) => document.getElementById(id);
  const form = $("form");
  const raw = $("raw");
  const fields = [...form.querySelectorAll("[data-path]")];
  const presets = JSON.parse($("presets").textContent);
  const BLANK = { model: { arch: "gpt" }, data: { builtin: "synthetic" }, optimizer: { name: "muon" } };
  let spec = {};
  let idempotencyKey = null; // one per spec text: a double click submits one job

  // -- the spec as a nested object ----------------------------------------------------------------
  function get(obj, path) {
    return path.split(".").reduce((o, k) => (o && typeof o === "object" ? o[k] : undefined), obj);
  }

  function set(obj, path, value) {
    const keys = path.split(".");
    let o = obj;
    for (const k of keys.slice(0, -1)) {
      if (typeof o[k] !== "object" || o[k] === null) o[k] = {};
      o = o[k];
    }
    if (value === undefined) delete o[keys[keys.length - 1]];
    else o[keys[keys.length - 1]] = value;
  }

  function prune(obj) {
    for (const [k, v] of Object.entries(obj)) {
      if (v && typeof v === "object" && !Array.isArray(v)) {
        prune(v);
        if (!Object.keys(v).length) delete obj[k];
      }
    }
    return obj;
  }

  // -- form <-> spec ------------------------------------------------------------------------------
  function visible(node) {
    return !node.closest("[hidden]");
  }

  function updateVisibility() {
    const show = (selector, on) => form.querySelectorAll(selector).forEach((n) => (n.hidden = !on));
    show(".moe-only", $("f-arch").value === "moe");
    show(".clip-only", $("f-optimizer").value === "muonclip");
    show(".muon-only", $("f-optimizer").value !== "adamw");
    show(".dataset-only", $("f-source").value === "dataset");
  }

  function readField(node) {
    const text = node.value.trim();
    if (text === "") return undefined;
    if (node.dataset.type === "int") return Number.isInteger(Number(text)) ? Number(text) : text;
    if (node.dataset.type === "float") return Number.isFinite(Number(text)) ? Number(text) : text;
    return text;
  }

  function formToSpec() {
    updateVisibility();
    const next = structuredClone(spec);
    for (const node of fields) set(next, node.dataset.path, visible(node) ? readField(node) : undefined);
    const source = $("f-source").value;
    for (const key of ["builtin", "dataset_id", "path"]) set(next, `data.${key}`, undefined);
    if (source.startsWith("builtin:")) set(next, "data.builtin", source.slice(8));
    else set(next, "data.dataset_id", $("f-dataset").value || undefined);
    spec = prune(next);
    writeRaw();
  }

  function specToForm() {
    for (const node of fields) {
      const value = get(spec, node.dataset.path);
      if (node.tagName === "SELECT" && node.id !== "f-dataset") {
        if (value !== undefined) node.value = String(value);
      } else node.value = value === undefined || value === null ? "" : String(value);
    }
    const data = spec.data || {};
    if (data.builtin) $("f-source").value = `builtin:${data.builtin}`;
    else if (data.dataset_id) {
      $("f-source").value = "dataset";
      ensureDatasetOption(data.dataset_id, data.dataset_id);
      $("f-dataset").value = data.dataset_id;
    }
    updateVisibility();
  }

  function writeRaw() {
    raw.value = jsyaml.dump(spec, { lineWidth: 100 });
    $("raw-error").hidden = true;
    idempotencyKey = null;
  }

  function readRaw() {
    let parsed;
    try {
      parsed = jsyaml.load(raw.value);
    } catch (e) {
      return showRawError(`Not valid YAML or JSON: ${e.reason || e.message}`);
    }
    if (!parsed || typeof parsed !== "object" || Array.isArray(parsed)) return showRawError("The spec must be a mapping.");
    $("raw-error").hidden = true;
    spec = parsed;
    idempotencyKey = null;
    specToForm();
    return true;
  }

  function showRawError(message) {
    $("raw-error").textContent = message;
    $("raw-error").hidden = false;
    return false;
  }

  // -- datasets -----------------------------------------------------------------------------------
  function ensureDatasetOption(id, text) {
    const select = $("f-dataset");
    if (![...select.options].some((o) => o.value === id)) select.append(el("option", { value: id }, text));
  }

  async function loadDatasets() {
    const page = await api("/v1/datasets?limit=100");
    for (const d of page.data) ensureDatasetOption(d.id, `${d.name} (${MF.fmt.bytes(d.bytes)}, ${d.id})`);
  }

  function upload() {
    const file = $("f-file").files[0];
    if (!file) return;
    const bar = $("upload-progress");
    const status = $("upload-status");
    const body = new FormData();
    body.append("file", file);
    body.append("name", file.name);
    const xhr = new XMLHttpRequest(); // fetch() cannot report upload progress
    xhr.open("POST", "/v1/datasets");
    xhr.responseType = "json";
    xhr.upload.addEventListener("progress", (e) => {
      if (e.lengthComputable) bar.value = e.loaded / e.total;
      status.textContent = `${MF.fmt.bytes(e.loaded)} of ${MF.fmt.bytes(file.size)}`;
    });
    xhr.addEventListener("load", () => {
      bar.hidden = true;
      $("upload").disabled = false;
      if (xhr.status === 201) {
        const d = xhr.response;
        status.textContent = `Uploaded ${d.name}: ${MF.fmt.bytes(d.bytes)}, ${d.id}`;
        ensureDatasetOption(d.id, `${d.name} (${MF.fmt.bytes(d.bytes)}, ${d.id})`);
        $("f-source").value = "dataset";
        $("f-dataset").value = d.id;
        formToSpec();
      } else {
        const e = (xhr.response && xhr.response.error) || { message: `HTTP ${xhr.status}` };
        status.textContent = `Upload failed: ${e.message}`;
      }
    });
    xhr.addEventListener("error", () => {
      bar.hidden = true;
      $("upload").disabled = false;
      status.textContent = "Upload failed: the connection broke.";
    });
    bar.value = 0;
    bar.hidden = false;
    $("upload").disabled = true;
    xhr.send(body);
  }

  // -- submit -------------------------------------------------------------------------------------
  function clearErrors() {
    form.querySelectorAll(".invalid").forEach((n) => n.classList.remove("invalid"));
    form.querySelectorAll(".field-error.for-field").forEach((n) => n.remove());
    $("form-error").hidden = true;
  }

  function fieldFor(param) {
    if (!param) return null;
    if (param.startsWith("data.dataset_id")) return $("f-source").value === "dataset" ? $("f-dataset") : $("f-source");
    if (param === "data" || param.startsWith("data.builtin")) return $("f-source");
    return fields.find((n) => n.dataset.path === param && visible(n)) || null;
  }

  function showApiError(e) {
    const node = fieldFor(e.param);
    const message = e.param ? `${e.message} (${e.param})` : e.message;
    if (node) {
      node.classList.add("invalid");
      node.closest(".field").append(el("p", { class: "field-error for-field", role: "alert" }, e.message));
      node.focus();
    } else if (e.param) {
      raw.classList.add("invalid");
      showRawError(message);
    } else {
      $("form-error").textContent = message;
      $("form-error").hidden = false;
    }
  }

  async function submit(event) {
    event.preventDefault();
    clearErrors();
    raw.classList.remove("invalid");
    clearTimeout(rawTimer);
    rawTimer = null;
    if (!readRaw()) return;
    idempotencyKey = idempotencyKey || crypto.randomUUID();
    $("submit").disabled = true;
    try {
      const response = await fetch("/v1/jobs", {
        method: "POST",
        credentials: "same-origin",
        headers: { "Content-Type": "application/json", Accept: "application/json", "Idempotency-Key": idempotencyKey },
        body: JSON.stringify(spec),
      });
      const data = await response.json();
      if (!response.ok) {
        const e = data.error || { message: `HTTP ${response.status}` };
        throw new ApiError(response.status, e.code, e.message, e.param);
      }
      location.assign(`/jobs/${data.id}`);
    } catch (e) {
      if (e instanceof ApiError && e.status === 401) return location.reload();
      showApiError(e instanceof ApiError ? e : { message: String(e.message || e), param: null });
      $("submit").disabled = false;
    }
  }

  function usePreset(name) {
    const preset = presets.find((p) => p.name === name);
    spec = structuredClone(preset ? preset.spec : BLANK);
    writeRaw();
    specToForm();
    clearErrors();
  }

  // -- wiring -------------------------------------------------------------------------------------
  $("preset").append(...presets.map((p) => el("option", { value: p.name }, p.name)));
  // Typing in the editor is read 300 ms after the last key; a form edit first takes in what was
  // typed, so neither side overwrites the other.
  let rawTimer = null;
  function flushRaw() {
    if (rawTimer === null) return;
    clearTimeout(rawTimer);
    rawTimer = null;
    readRaw();
  }
  raw.addEventListener("input", () => {
    clearTimeout(rawTimer);
    rawTimer = setTimeout(() => ((rawTimer = null), readRaw()), 300);
  });
  form.addEventListener("change", (e) => {
    flushRaw();
    if (e.target.id === "preset") return usePreset(e.target.value);
    if (e.target.id !== "f-file") formToSpec();
  });
  form.addEventListener("input", (e) => {
    if (!e.target.matches("input[data-path]")) return;
    flushRaw();
    formToSpec();
  });
  form.addEventListener("submit", submit);
  $("upload").addEventListener("click", upload);

  const first = presets.find((p) => p.spec && p.spec.data && p.spec.data.builtin) || presets[0];
  if (first) $("preset").value = first.name;
  usePreset(first ? first.name : "");
  loadDatasets().catch(MF.showError);
})();
