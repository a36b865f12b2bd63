// New job: a form for the common fields and the raw spec (YAML or JSON) beside it, kept in step
// both ways; the examples as presets; dataset upload with a progress bar. The spec text is what
// is submitted, and the API decides what is valid: a 422 is shown at the field it names.
//
// The form shows exactly the spec: a field the spec leaves out shows what the server makes of it
// (the page's spec-defaults), marked "(default)", and editing a control changes that field alone.
// Switching the architecture or optimizer also removes the fields that apply only to the one left
// (experts, top_k, tau), which the API would reject.
"use strict";

(function () {
  const { api, el, ApiError } = MF;
  const $ = (id) => document.getElementById(id);
  const form = $("form");
  const raw = $("raw");
  const fields = [...form.querySelectorAll("[data-path]")];
  const presets = JSON.parse($("presets").textContent);
  const defaults = JSON.parse($("spec-defaults").textContent);
  const BLANK = { model: { arch: "gpt" }, data: { builtin: "synthetic" }, optimizer: { name: "muon" } };
  const SOURCES = ["builtin", "dataset_id", "path"]; // a spec gives exactly one
  // Fields the API refuses where they are hidden: switching away removes them from the spec.
  const EXCLUSIVE = ".moe-only [data-path], .clip-only [data-path], .exclusive [data-path]";
  let spec = {};
  let idempotencyKey = null; // one per spec text: a double click submits one job

  // -- the spec as a nested object ----------------------------------------------------------------
  function get(obj, path) {
    return path.split(".").reduce((o, k) => (o && typeof o === "object" ? o[k] : undefined), obj);
  }

  // Sets one field; undefined removes it, and the sections it leaves empty.
  function set(obj, path, value) {
    const keys = path.split(".");
    const last = keys.pop();
    const chain = [obj];
    for (const k of keys) {
      const o = chain[chain.length - 1];
      if (typeof o[k] !== "object" || o[k] === null || Array.isArray(o[k])) {
        if (value === undefined) return;
        o[k] = {};
      }
      chain.push(o[k]);
    }
    if (value !== undefined) return void (chain[chain.length - 1][last] = value);
    delete chain[chain.length - 1][last];
    for (let i = keys.length - 1; i >= 0 && !Object.keys(chain[i + 1]).length; i--) delete chain[i][keys[i]];
  }

  // What the server makes of a field the spec leaves out; null where nothing.
  function defaultOf(path) {
    const name = get(spec, "optimizer.name") ?? defaults.base["optimizer.name"];
    const by = defaults.by[`${get(spec, "model.arch")} ${name}`] || {};
    return (path in by ? by[path] : defaults.base[path]) ?? null;
  }

  // -- spec -> form -------------------------------------------------------------------------------
  function visible(node) {
    return !node.closest("[hidden]");
  }

  function updateVisibility() {
    const show = (selector, on) => form.querySelectorAll(selector).forEach((n) => (n.hidden = !on));
    const optimizer = get(spec, "optimizer.name") ?? defaultOf("optimizer.name");
    show(".moe-only", get(spec, "model.arch") === "moe");
    show(".sized-only", get(spec, "model.arch") !== "hf"); // an hf model's sizes are its config's
    show(".hf-only", get(spec, "model.arch") === "hf");
    $("hf-summary").textContent = hfSummary(get(spec, "model.hf.config"), get(spec, "model.hf.model_id"));
    show(".clip-only", defaultOf("optimizer.qk_clip_tau") !== null); // muonclip, normuonclip: the contract's tau
    show(".muon-only", optimizer !== "adamw");
    show(".dataset-only", $("f-source").value === "dataset");
    show(".corpus-only", $("f-source").value !== "builtin:synthetic"); // the task has its own tokens
  }

  // A transformers config in a line; it is edited in the spec.
  function hfSummary(config, modelId) {
    if (modelId) return `the config, weights and tokenizer of model ${modelId}`;
    if (!config || typeof config !== "object") return "model.hf.config: not set (write it in the spec)";
    const layers = config.num_hidden_layers ?? config.n_layer;
    const width = config.hidden_size ?? config.n_embd;
    const heads = config.num_attention_heads ?? config.n_head;
    const kv = config.num_key_value_heads;
    const grouped = kv && kv !== heads ? ` (${kv} key/value)` : "";
    return `${config.model_type}: ${layers} layers × ${width}, ${heads} heads${grouped}; its config is edited in the spec`;
  }

  // A value the form has no control for (an object: a BPE tokenizer), in a few words.
  function summary(value) {
    if (value.type === "bpe" && Number.isInteger(value.vocab_size)) return `bpe, ${value.vocab_size.toLocaleString("en-US")} tokens`;
    if (value.type === "model") return "the model's own";
    return JSON.stringify(value);
  }

  // Selects the option for `value`, adding one (class extra) where the select has none.
  function choose(select, value, text) {
    select.querySelectorAll("option.extra").forEach((o) => o.remove());
    if (![...select.options].some((o) => o.value === value)) select.append(el("option", { value, class: "extra" }, text));
    select.value = value;
  }

  function showField(node) {
    const value = get(spec, node.dataset.path);
    const text = value === undefined || value === null ? "" : String(value);
    const fallback = defaultOf(node.dataset.path);
    if (node.tagName === "SELECT") {
      node.options[0].textContent = fallback === null ? "(not set)" : `${fallback} (default)`;
      if (node.id === "f-dataset" && text) ensureDatasetOption(text, text);
      if (value !== null && typeof value === "object") choose(node, "(object)", `${summary(value)} (set in the spec)`);
      else choose(node, text, `${text} (not a choice)`);
      return;
    }
    node.value = text;
    node.classList.toggle("unshown", node.value !== text); // a number input refuses other text
    if (node.value !== text) node.placeholder = `${JSON.stringify(value)} in the spec`;
    else if (node.dataset.type) node.placeholder = fallback === null ? "" : `${fallback} (default)`;
  }

  function showSource() {
    const data = get(spec, "data") || {};
    const given = SOURCES.filter((k) => data[k] !== undefined && data[k] !== null);
    const select = $("f-source");
    if (given.length > 1) choose(select, "several", `several: ${given.join(", ")}`);
    else if (!given.length) {
      if (select.value !== "dataset") choose(select, "", "(not set)"); // else: no dataset chosen yet
    } else if (given[0] === "dataset_id") choose(select, "dataset");
    else if (given[0] === "path") choose(select, "path", `path: ${data.path} (muonforge train only)`);
    else choose(select, `builtin:${data.builtin}`, `builtin: ${data.builtin} (not a choice)`);
  }

  // Shows the spec in every control but `except` (the one being edited, which shows what was typed).
  function specToForm(except) {
    if (except !== $("f-source")) showSource();
    if (except !== $("f-model")) showModel();
    updateVisibility();
    for (const node of fields) if (node !== except) showField(node);
  }

  // -- form -> spec -------------------------------------------------------------------------------
  function readField(node) {
    const text = node.value;
    if (text.trim() === "") return undefined;
    if (node.dataset.type === "int") return Number.isInteger(Number(text)) ? Number(text) : text;
    if (node.dataset.type === "float") return Number.isFinite(Number(text)) ? Number(text) : text;
    return text;
  }

  function setSource(value) {
    $("f-source").querySelectorAll("option.extra").forEach((o) => o.remove());
    const data = get(spec, "data");
    if (data && typeof data === "object") SOURCES.forEach((key) => delete data[key]); // data keeps its place
    const first = [...$("f-dataset").options].find((o) => o.value);
    if (value.startsWith("builtin:")) set(spec, "data.builtin", value.slice(8));
    else if (value === "dataset" && first) set(spec, "data.dataset_id", $("f-dataset").value || first.value);
    else if (data && typeof data === "object" && !Object.keys(data).length) delete spec.data;
  }

  // Starting from an uploaded or staged model takes its config, weights and tokenizer; back to a
  // config, the spec's own config (if any) and the byte tokenizer.
  function setModel(id) {
    set(spec, "model.hf.model_id", id || undefined);
    if (id) set(spec, "model.hf.config", undefined);
    if (id) set(spec, "data.tokenizer", { type: "model" });
    else if (get(spec, "data.tokenizer.type") === "model") set(spec, "data.tokenizer", undefined);
  }

  // Takes one control's edit into the spec and the spec text.
  function edit(node) {
    if (node.id === "f-source") setSource(node.value);
    else if (node.id === "f-model") setModel(node.value);
    else set(spec, node.dataset.path, readField(node));
    if (node.id === "f-arch" || node.id === "f-optimizer") {
      updateVisibility();
      for (const n of form.querySelectorAll(EXCLUSIVE)) if (!visible(n)) set(spec, n.dataset.path, undefined);
    }
    writeRaw();
    specToForm(node);
  }

  function writeRaw() {
    raw.value = jsyaml.dump(spec, { lineWidth: 100 });
    $("raw-error").hidden = true;
    idempotencyKey = null;
  }

  function readRaw(except) {
    let parsed;
    try {
      parsed = jsyaml.load(raw.value, { schema: jsyaml.CORE_SCHEMA }); // JSON's types: no dates
    } catch (e) {
      return showRawError(`Not valid YAML or JSON: ${e.reason || e.message}`);
    }
    if (!parsed || typeof parsed !== "object" || Array.isArray(parsed)) return showRawError("The spec must be a mapping.");
    $("raw-error").hidden = true;
    spec = parsed;
    idempotencyKey = null;
    specToForm(except);
    return true;
  }

  function showRawError(message) {
    $("raw-error").textContent = message;
    $("raw-error").hidden = false;
    return false;
  }

  // -- datasets -----------------------------------------------------------------------------------
  // A dataset in the list: its name, format, size and id.
  function datasetLabel(d) {
    return `${d.name} (${d.format}, ${MF.fmt.bytes(d.bytes)}, ${d.id})`;
  }

  function ensureDatasetOption(id, text) {
    const select = $("f-dataset");
    const option = [...select.options].find((o) => o.value === id);
    if (!option) select.append(el("option", { value: id }, text));
    else if (option.text === id) option.text = text; // a spec's id, named once the list has loaded
  }

  async function loadDatasets() {
    const page = await api("/v1/datasets?limit=100");
    for (const d of page.data) ensureDatasetOption(d.id, datasetLabel(d));
  }

  function uploadDataset() {
    sendFile("/v1/datasets", $("f-file"), $("upload"), $("upload-progress"), $("upload-status"), (d) => {
      ensureDatasetOption(d.id, datasetLabel(d));
      $("f-source").value = "dataset";
      $("f-dataset").value = d.id;
      edit($("f-source"));
      return `Uploaded ${d.name}: ${d.format}, ${MF.fmt.bytes(d.bytes)}, ${d.id}`;
    });
  }

  // -- models -------------------------------------------------------------------------------------
  // A model in the list: its name, family, size and id (a staged one's says so: staged:<name>).
  const compact = new Intl.NumberFormat("en-US", { notation: "compact" });
  function modelLabel(m) {
    return `${m.name} (${m.model_type}, ${compact.format(m.parameters)} parameters, ${m.id})`;
  }

  function ensureModelOption(id, text) {
    const select = $("f-model");
    const option = [...select.options].find((o) => o.value === id);
    if (!option) select.append(el("option", { value: id }, text));
    else if (option.text === id) option.text = text;
  }

  function showModel() {
    const id = get(spec, "model.hf.model_id");
    if (id) ensureModelOption(id, id);
    $("f-model").value = id || "";
  }

  async function loadModels() {
    const page = await api("/v1/models?limit=100");
    for (const m of page.data) ensureModelOption(m.id, modelLabel(m));
  }

  function uploadModel() {
    sendFile("/v1/models", $("f-model-file"), $("upload-model"), $("model-progress"), $("model-status"), (m) => {
      ensureModelOption(m.id, modelLabel(m));
      $("f-model").value = m.id;
      edit($("f-model"));
      return `Uploaded ${m.name}: ${m.model_type}, ${MF.fmt.bytes(m.bytes)}, ${m.id}`;
    });
  }

  // Posts the input's file with a progress bar; `done(created)` takes the 201's body and says
  // what to show; an error shows the API's message.
  function sendFile(url, input, button, bar, status, done) {
    const file = input.files[0];
    if (!file) return;
    const body = new FormData();
    body.append("file", file);
    body.append("name", file.name);
    const xhr = new XMLHttpRequest(); // fetch() cannot report upload progress
    xhr.open("POST", url);
    xhr.responseType = "json";
    xhr.upload.addEventListener("progress", (e) => {
      if (e.lengthComputable) bar.value = e.loaded / e.total;
      status.textContent = `${MF.fmt.bytes(e.loaded)} of ${MF.fmt.bytes(file.size)}`;
    });
    const end = (message) => {
      bar.hidden = true;
      button.disabled = false;
      status.textContent = message;
    };
    xhr.addEventListener("load", () => {
      if (xhr.status === 201) return end(done(xhr.response));
      const e = (xhr.response && xhr.response.error) || { message: `HTTP ${xhr.status}` };
      end(`Upload failed: ${e.message}`);
    });
    xhr.addEventListener("error", () => end("Upload failed: the connection broke."));
    bar.value = 0;
    bar.hidden = false;
    button.disabled = true;
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
  function flushRaw(except) {
    if (rawTimer === null) return;
    clearTimeout(rawTimer);
    rawTimer = null;
    readRaw(except);
  }
  raw.addEventListener("input", () => {
    clearTimeout(rawTimer);
    rawTimer = setTimeout(() => ((rawTimer = null), readRaw()), 300);
  });
  form.addEventListener("change", (e) => {
    if (e.target.id === "preset") {
      clearTimeout(rawTimer);
      rawTimer = null;
      return usePreset(e.target.value);
    }
    if (e.target.tagName !== "SELECT") return; // inputs are taken in as they are typed
    flushRaw(e.target);
    edit(e.target);
  });
  form.addEventListener("input", (e) => {
    if (!e.target.matches("input[data-path]")) return;
    flushRaw(e.target);
    edit(e.target);
  });
  form.addEventListener("submit", submit);
  $("upload").addEventListener("click", uploadDataset);
  $("upload-model").addEventListener("click", uploadModel);

  // Opens on the quickest preset that runs as it is: a builtin corpus, one process, and the least
  // work (tokens trained x layers x width squared).
  function work(s) {
    const value = (path) => Number(get(s, path) ?? defaults.base[path]);
    if (!get(s, "data.builtin") || value("resources.nproc") * value("resources.nnodes") > 1) return Infinity;
    const tokens = value("train.steps") * value("train.batch_size") * value("model.seq_len");
    return tokens * value("model.n_layer") * value("model.d_model") ** 2;
  }
  const first = presets.reduce((best, p) => (best && !(work(p.spec) < work(best.spec)) ? best : p), null);
  if (first) $("preset").value = first.name;
  usePreset(first ? first.name : "");
  loadDatasets().catch(MF.showError);
  loadModels().catch(MF.showError);
})();
