// The ctxfuse console: the operator's views over /console/api/ and a playground over the public
// OpenAI API. No framework, no build step: the gateway serves this file as it is.
"use strict";

const REFRESH_MS = 2000;
const HISTORY = 90; // points kept per chart (3 minutes at the refresh interval)
const KEY_SLOT = "ctxfuse.console.key";

const $ = (sel) => document.querySelector(sel);
const state = { previous: null, refreshing: false, series: {}, tenantSeries: {}, chat: [], models: [] };

// -- the key and the API ----------------------------------------------------------------------

function key() {
  return sessionStorage.getItem(KEY_SLOT) || "";
}

// signed in: a key given, or an empty one on a server started open (nothing is asked before)
function signedIn() {
  return sessionStorage.getItem(KEY_SLOT) !== null;
}

function headers(extra) {
  const h = Object.assign({ "Content-Type": "application/json" }, extra || {});
  if (key()) h.Authorization = "Bearer " + key();
  return h;
}

class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

async function api(path, options) {
  const resp = await fetch(path, Object.assign({ headers: headers() }, options || {}));
  const text = await resp.text();
  let body = null;
  try {
    body = text ? JSON.parse(text) : null;
  } catch (_) {
    body = null;
  }
  if (!resp.ok) {
    const message = body && body.error ? body.error.message : resp.status + " " + resp.statusText;
    throw new ApiError(resp.status, message);
  }
  return body;
}

function notice(message) {
  const n = $("#notice");
  n.textContent = message || "";
  n.hidden = !message;
}

// -- small helpers ----------------------------------------------------------------------------

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v;
    else if (k === "dataset") Object.assign(e.dataset, v);
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c === null || c === undefined ? "" : c);
  return e;
}

function fill(tbody, rows) {
  tbody.replaceChildren(...rows);
}

function fmt(n, digits) {
  if (n === null || n === undefined || Number.isNaN(n)) return "–";
  if (typeof n !== "number") return String(n);
  return n.toLocaleString("en", { maximumFractionDigits: digits === undefined ? 2 : digits });
}

function when(seconds) {
  return seconds ? new Date(seconds * 1000).toISOString().replace("T", " ").slice(0, 16) : "–";
}

function bytes(n) {
  if (!n) return "0";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) {
    n /= 1024;
    i++;
  }
  return fmt(n, 1) + " " + units[i];
}

// sum of a metric's samples whose labels match `where`
function total(metrics, name, where) {
  let sum = 0;
  let seen = false;
  const keep = typeof where === "function" ? where : (labels) => Object.entries(where || {}).every(([k, v]) => labels[k] === v);
  for (const [labels, value] of metrics[name] || []) {
    if (!keep(labels)) continue;
    sum += value;
    seen = true;
  }
  return seen ? sum : null;
}

// -- charts: a line per series, drawn on a canvas ---------------------------------------------

const COLOURS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#ca8a04"];

function push(store, name, value) {
  const s = (store[name] = store[name] || []);
  s.push(value);
  if (s.length > HISTORY) s.shift();
}

function draw(canvasId, lines) {
  const c = document.getElementById(canvasId);
  if (!c) return;
  const g = c.getContext("2d");
  g.clearRect(0, 0, c.width, c.height);
  const values = lines.flatMap((l) => l.points.filter((v) => v !== null));
  const top = Math.max(1e-9, ...values);
  g.font = "11px sans-serif";
  g.fillStyle = "#6b7280";
  g.fillText(fmt(top, 2), 4, 12);
  lines.forEach((line, i) => {
    g.strokeStyle = COLOURS[i % COLOURS.length];
    g.lineWidth = 1.5;
    g.beginPath();
    let started = false;
    line.points.forEach((v, x) => {
      if (v === null) return;
      const px = (x / (HISTORY - 1)) * (c.width - 8) + 4;
      const py = c.height - 4 - (v / top) * (c.height - 20);
      if (started) g.lineTo(px, py);
      else g.moveTo(px, py);
      started = true;
    });
    g.stroke();
    if (line.label) {
      g.fillStyle = COLOURS[i % COLOURS.length];
      g.fillText(line.label, 60 + i * 90, 12);
    }
  });
}

// a mean over the interval between two snapshots: (sum now - sum then) / (count now - count then)
function meanOver(now, then, name, scale) {
  const ds = total(now.metrics, name + "_sum") - total(then.metrics, name + "_sum");
  const dc = total(now.metrics, name + "_count") - total(then.metrics, name + "_count");
  return dc > 0 ? (ds / dc) * scale : null;
}

function rateOver(now, then, name, where) {
  const dt = now.time - then.time;
  const a = total(now.metrics, name, where);
  const b = total(then.metrics, name, where);
  return dt > 0 && a !== null ? Math.max(0, a - (b || 0)) / dt : null;
}

// -- the snapshot and its views ---------------------------------------------------------------

async function refresh() {
  if (!signedIn()) {
    notice("Sign in with the server's key (--api-key); on a server started without one, leave it empty.");
    return;
  }
  if (state.refreshing) return; // a slow answer is not asked for again before it comes
  state.refreshing = true;
  let snap;
  try {
    snap = await api("/console/api/snapshot");
  } catch (e) {
    notice(e.status === 401 || e.status === 403 ? "Sign in with the server's key: " + e.message : e.message);
    return;
  } finally {
    state.refreshing = false;
  }
  notice("");
  const then = state.previous;
  state.previous = snap;
  renderServer(snap);
  renderFleet(snap);
  renderEngine(snap);
  renderUsage(snap, then);
  if (then) {
    push(state.series, "ttft", meanOver(snap, then, "ctxfuse_time_to_first_token_seconds", 1000));
    push(state.series, "itl", meanOver(snap, then, "ctxfuse_inter_token_latency_seconds", 1000));
    push(state.series, "queue", meanOver(snap, then, "ctxfuse_request_queue_seconds", 1000));
    push(state.series, "tps", rateOver(snap, then, "ctxfuse_generation_tokens_total"));
    // the OpenAI API's requests: the console's own polling and the probes are not traffic
    const onlyApi = (labels) => labels.route.startsWith("/v1/");
    push(state.series, "rps", rateOver(snap, then, "ctxfuse_http_requests_total", onlyApi));
    const dq = total(snap.metrics, "ctxfuse_prefix_cache_queries_total") - total(then.metrics, "ctxfuse_prefix_cache_queries_total");
    const dh = total(snap.metrics, "ctxfuse_prefix_cache_hits_total") - total(then.metrics, "ctxfuse_prefix_cache_hits_total");
    push(state.series, "hit", dq > 0 ? (100 * dh) / dq : null);
  }
  if (snap.engine) {
    push(state.series, "kv", 100 * snap.engine.kv_usage);
    push(state.series, "running", snap.engine.num_running);
    push(state.series, "waiting", snap.engine.num_waiting);
  }
  const s = state.series;
  draw("chart-ttft", [{ points: s.ttft || [] }]);
  draw("chart-itl", [{ points: s.itl || [] }]);
  draw("chart-queue", [{ points: s.queue || [] }]);
  draw("chart-tps", [{ points: s.tps || [] }]);
  draw("chart-hit", [{ points: s.hit || [] }]);
  draw("chart-rps", [{ points: s.rps || [] }]);
  draw("chart-kv", [{ points: s.kv || [] }]);
  draw("chart-batch", [
    { points: s.running || [], label: "running" },
    { points: s.waiting || [], label: "waiting" },
  ]);
}

function renderServer(snap) {
  const srv = snap.server;
  const up = Math.round(snap.time - srv.started);
  $("#server-line").replaceChildren(
    el("span", { class: "pill" }, srv.role),
    el("span", { class: srv.not_ready ? "pill bad" : "pill good" }, srv.not_ready ? "not ready: " + srv.not_ready : "ready"),
    el("span", { class: "muted" }, "up " + fmt(up / 60, 1) + " min"),
  );
}

function renderFleet(snap) {
  const fleet = snap.fleet;
  $("#fleet-none").hidden = !!fleet;
  $("#backends").hidden = !fleet;
  $("#versions").hidden = !fleet;
  if (!fleet) return;
  const keys = fleet.backends.reduce((n, b) => n + b.prefix_keys, 0);
  fill(
    $("#backends tbody"),
    fleet.backends.map((b) =>
      el(
        "tr",
        { dataset: { backend: b.name } },
        el("td", {}, b.name),
        el("td", {}, b.url),
        el("td", {}, b.kind || "–"),
        el("td", {}, b.version),
        el("td", { class: b.reachable ? "good" : "bad" }, b.draining ? "draining" : b.reachable ? "up" : "down"),
        el("td", { class: b.circuit === "closed" ? "good" : "bad" }, b.circuit),
        el("td", {}, fmt(b.in_flight, 0)),
        el("td", {}, fmt(b.load, 2)),
        el("td", {}, fmt(b.prefix_keys, 0)),
        el("td", {}, keys ? fmt((100 * b.prefix_keys) / keys, 0) + "%" : "–"),
        el("td", {}, fmt(b.max_model_len, 0)),
      ),
    ),
  );
  fill(
    $("#versions tbody"),
    Object.entries(fleet.versions).map(([v, st]) =>
      el("tr", {}, el("td", {}, v), el("td", { class: st === "rolled_back" ? "bad" : "" }, st), el("td", {}, fmt(fleet.weights[v], 2))),
    ),
  );
  $("#rollbacks").replaceChildren(...fleet.rollbacks.map((r) => el("li", { class: "bad" }, r.description)));
}

function renderEngine(snap) {
  const e = snap.engine;
  $("#engine-none").hidden = !!e;
  $("#engine").hidden = !e;
  if (!e) return;
  const hit = e.prefix_queried_tokens ? (100 * e.prefix_hit_tokens) / e.prefix_queried_tokens : null;
  const accepted = e.spec_draft_tokens ? (100 * e.spec_accepted_tokens) / e.spec_draft_tokens : null;
  const rows = [
    ["running requests", fmt(e.num_running, 0)],
    ["waiting requests", fmt(e.num_waiting, 0)],
    ["KV cache in use", fmt(100 * e.kv_usage, 1) + "% of " + fmt(e.num_blocks, 0) + " blocks"],
    ["KV stored as", e.kv_dtype || "–"],
    ["KV bytes per token", fmt(e.kv_bytes_per_token, 0)],
    ["prefix-cache hit rate (since start)", hit === null ? "–" : fmt(hit, 1) + "%"],
    ["grammars compiled / reused", fmt(e.grammar_cache_misses, 0) + " / " + fmt(e.grammar_cache_hits, 0)],
    ["speculative tokens accepted", accepted === null ? "–" : fmt(accepted, 1) + "% of " + fmt(e.spec_draft_tokens, 0)],
  ];
  fill($("#engine tbody"), rows.map(([k, v]) => el("tr", {}, el("th", {}, k), el("td", {}, v))));
  $("#tiers-none").hidden = e.kv_tiers.length > 0;
  $("#tiers").hidden = e.kv_tiers.length === 0;
  fill(
    $("#tiers tbody"),
    e.kv_tiers.map((t) =>
      el(
        "tr",
        {},
        el("td", {}, t.tier),
        el("td", {}, t.dtype || e.kv_dtype || "–"),
        el("td", {}, fmt(t.blocks, 0)),
        el("td", {}, bytes(t.bytes)),
        el("td", {}, bytes(t.capacity_bytes)),
        el("td", {}, t.capacity_bytes ? fmt((100 * t.bytes) / t.capacity_bytes, 1) + "%" : "–"),
        el("td", {}, fmt(t.hits, 0)),
        el("td", {}, fmt(t.misses, 0)),
      ),
    ),
  );
}

function renderUsage(snap, then) {
  const m = snap.metrics;
  $("#usage-scope").textContent = "Counted since each server started: " + snap.server.usage + ".";
  const tenants = new Set((m.ctxfuse_tenant_requests_total || []).map(([l]) => l.tenant));
  for (const [l] of m.ctxfuse_tenant_tokens_total || []) tenants.add(l.tenant);
  const rows = [];
  for (const t of [...tenants].sort()) {
    const requests = total(m, "ctxfuse_tenant_requests_total", { tenant: t });
    let errors = 0;
    for (const [l, v] of m.ctxfuse_tenant_requests_total || []) if (l.tenant === t && !l.status.startsWith("2")) errors += v;
    const now = then ? rateOver(snap, then, "ctxfuse_tenant_tokens_total", { tenant: t }) : null;
    push(state.tenantSeries, t, now);
    rows.push(
      el(
        "tr",
        { dataset: { tenant: t } },
        el("td", {}, t),
        el("td", {}, fmt(requests, 0)),
        el("td", {}, fmt(errors, 0)),
        el("td", {}, fmt(total(m, "ctxfuse_tenant_tokens_total", { tenant: t, kind: "prompt" }), 0)),
        el("td", {}, fmt(total(m, "ctxfuse_tenant_tokens_total", { tenant: t, kind: "generation" }), 0)),
        el("td", {}, fmt(now, 1)),
      ),
    );
  }
  fill($("#usage tbody"), rows);
  draw(
    "chart-tenants",
    Object.entries(state.tenantSeries).map(([t, points]) => ({ points, label: t })),
  );
}

// the long-context benchmark's heatmaps: fetched with the key (an <img> cannot send it), shown as blobs
async function loadHeatmaps() {
  let listed;
  try {
    listed = await api("/console/api/longctx");
  } catch (e) {
    notice(e.message);
    return;
  }
  const none = $("#heatmaps-none");
  none.hidden = listed.heatmaps.length > 0;
  none.textContent = "No heatmaps in " + listed.directory + ": run `ctxfuse bench longctx` (or start the server with --bench-results DIR).";
  for (const img of document.querySelectorAll("#heatmaps img")) URL.revokeObjectURL(img.src);
  const figures = [];
  for (const name of listed.heatmaps) {
    const resp = await fetch("/console/api/longctx/" + encodeURIComponent(name), { headers: headers() });
    if (!resp.ok) continue;
    const img = el("img", { src: URL.createObjectURL(await resp.blob()), alt: name, class: "heatmap" });
    figures.push(el("figure", {}, el("figcaption", {}, name), img));
  }
  $("#heatmaps").replaceChildren(...figures);
}

// -- tenants' keys ----------------------------------------------------------------------------

async function loadKeys() {
  let listed;
  try {
    listed = await api("/console/api/keys");
  } catch (e) {
    notice(e.message);
    return;
  }
  const now = Date.now() / 1000;
  fill(
    $("#keys tbody"),
    listed.data.map((k) => {
      const st = k.revoked_at ? "revoked" : k.expires_at && k.expires_at < now ? "expired" : "active";
      const revoke = st === "active" ? el("button", { class: "revoke", onclick: () => revokeKey(k.id) }, "Revoke") : "";
      return el(
        "tr",
        { dataset: { key: k.id } },
        el("td", {}, el("code", {}, k.shown)),
        el("td", {}, k.tenant),
        el("td", {}, k.name),
        el("td", {}, when(k.created_at)),
        el("td", {}, when(k.expires_at)),
        el("td", {}, k.models ? k.models.join(", ") : "all"),
        el("td", {}, fmt(k.rpm, 0)),
        el("td", {}, fmt(k.tpm, 0)),
        el("td", {}, fmt(k.max_concurrent, 0)),
        el("td", { class: st === "active" ? "good" : "bad" }, st),
        el("td", {}, revoke),
      );
    }),
  );
}

function number(form, name) {
  const v = form.elements[name].value.trim();
  return v === "" ? null : Number(v);
}

async function createKey(event) {
  event.preventDefault();
  const form = event.target;
  const models = form.elements.models.value.split(",").map((s) => s.trim()).filter(Boolean);
  const days = number(form, "expires_days");
  const body = {
    tenant: form.elements.tenant.value.trim(),
    name: form.elements.name.value.trim(),
    models: models.length ? models : null,
    rpm: number(form, "rpm"),
    tpm: number(form, "tpm"),
    max_concurrent: number(form, "max_concurrent"),
    expires_in_s: days === null ? null : days * 86400,
  };
  try {
    const made = await api("/console/api/keys", { method: "POST", body: JSON.stringify(body) });
    $("#secret-value").textContent = made.key;
    $("#secret").hidden = false;
    notice("");
    form.reset();
  } catch (e) {
    $("#secret").hidden = true;
    notice(e.message);
  }
  loadKeys();
}

async function revokeKey(id) {
  try {
    await api("/console/api/keys/" + encodeURIComponent(id) + "/revoke", { method: "POST" });
  } catch (e) {
    notice(e.message);
  }
  loadKeys();
}

// -- playground -------------------------------------------------------------------------------

async function loadModels() {
  try {
    const listed = await api("/v1/models");
    state.models = listed.data.map((m) => m.id);
  } catch (e) {
    notice(e.message);
    return;
  }
  $("#model").replaceChildren(...state.models.map((id) => el("option", { value: id }, id)));
}

// events of a text/event-stream response, as they arrive
async function* sse(resp) {
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) if (line.startsWith("data: ")) yield line.slice(6);
    }
  }
}

function confidenceHue(p) {
  return Math.round(120 * Math.max(0, Math.min(1, 1 + Math.log10(Math.max(p, 1e-12)) / 4)));
}

// a JSON value with each leaf coloured by the probability of the tokens that wrote it
function confidenceTree(value, confidence, pointer) {
  if (value !== null && typeof value === "object") {
    const list = Array.isArray(value);
    const items = Object.entries(value).map(([k, v]) => {
      const child = pointer + "/" + String(k).replace(/~/g, "~0").replace(/\//g, "~1");
      return el("li", {}, list ? "" : el("span", { class: "field" }, k + ": "), confidenceTree(v, confidence, child));
    });
    return el("ul", { class: "tree" }, ...items);
  }
  const p = confidence[pointer];
  const attrs = { class: "leaf", dataset: { pointer } };
  if (p !== undefined) {
    attrs.title = pointer + ": p = " + p.toPrecision(3);
    attrs.dataset.p = String(p);
  }
  const label = p === undefined ? "" : " " + (p >= 0.01 ? (100 * p).toFixed(0) + "%" : p.toExponential(1));
  const leaf = el("span", attrs, JSON.stringify(value), el("small", {}, label));
  // green (certain) to red (1e-4 or less), on a log scale: a value's tokens multiply their
  // probabilities, so a long value is rarely near 1. Set through the CSSOM, which the CSP allows.
  if (p !== undefined) leaf.style.background = "hsl(" + confidenceHue(p) + ", 70%, 85%)";
  return leaf;
}

function parsed(text, id) {
  try {
    return text.trim() ? JSON.parse(text) : null;
  } catch (e) {
    throw new Error(id + " is not valid JSON: " + e.message);
  }
}

async function send(event) {
  event.preventDefault();
  const prompt = $("#prompt").value.trim();
  if (!prompt) return;
  let schema;
  let tools;
  try {
    schema = parsed($("#schema").value, "the schema");
    tools = parsed($("#tools").value, "the tools");
  } catch (e) {
    notice(e.message);
    return;
  }
  state.chat.push({ role: "user", content: prompt });
  $("#prompt").value = "";
  const body = {
    model: $("#model").value,
    messages: state.chat,
    stream: true,
    stream_options: { include_usage: true },
    max_tokens: Number($("#max-tokens").value) || 128,
    temperature: Number($("#temperature").value),
  };
  if (schema) {
    body.response_format = { type: "json_schema", json_schema: { name: "answer", schema, strict: true } };
    body.ctxfuse = { field_confidence: true };
  }
  if (tools) {
    body.tools = tools;
    body.tool_choice = $("#tool-choice").value;
  }
  const turn = el("div", { class: "turn" }, el("p", { class: "user" }, prompt));
  const answer = el("pre", { class: "assistant" });
  const meta = el("p", { class: "meta muted" }, "waiting…");
  turn.append(answer, meta);
  $("#transcript").append(turn);
  $("#send").disabled = true;
  const started = performance.now();
  let first = null;
  let text = "";
  let usage = null;
  let result = null;
  const calls = [];
  try {
    const resp = await fetch("/v1/chat/completions", { method: "POST", headers: headers(), body: JSON.stringify(body) });
    if (!resp.ok) {
      const err = await resp.json().catch(() => null);
      throw new Error(err && err.error ? err.error.message : resp.status + " " + resp.statusText);
    }
    for await (const data of sse(resp)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        const d = choice.delta || {};
        if (d.content) {
          if (first === null) first = performance.now();
          text += d.content;
          answer.textContent = text;
        }
        for (const tc of d.tool_calls || []) {
          if (first === null) first = performance.now();
          const c = (calls[tc.index] = calls[tc.index] || { name: "", arguments: "" });
          if (tc.function && tc.function.name) c.name += tc.function.name;
          if (tc.function && tc.function.arguments) c.arguments += tc.function.arguments;
          answer.textContent = calls.map((x) => x.name + "(" + x.arguments + ")").join("\n");
        }
        if (choice.ctxfuse) result = choice.ctxfuse;
      }
    }
  } catch (e) {
    meta.textContent = "error: " + e.message;
    meta.className = "meta bad";
    state.chat.pop();
    $("#send").disabled = false;
    return;
  }
  const done = performance.now();
  state.chat.push(calls.length ? { role: "assistant", content: null, tool_calls: calls.map((c, i) => ({ id: "call_" + i, type: "function", function: c })) } : { role: "assistant", content: text });
  if (calls.length) state.chat.pop(); // a tool call needs the tool's answer before the next turn: start over
  if (result && result.field_confidence && text) {
    try {
      answer.replaceChildren(confidenceTree(JSON.parse(text), result.field_confidence, ""));
      answer.classList.add("structured");
    } catch (_) {
      /* not JSON after all: the text stays */
    }
  }
  const generated = usage ? usage.completion_tokens : null;
  const cached = usage && usage.prompt_tokens_details ? usage.prompt_tokens_details.cached_tokens : 0;
  const seconds = (done - (first || done)) / 1000;
  meta.replaceChildren(
    el("span", { class: "ttft" }, "first token " + fmt(first === null ? null : first - started, 0) + " ms"),
    " · ",
    el("span", {}, fmt(generated, 0) + " tokens" + (generated && seconds > 0 ? " at " + fmt(generated / seconds, 1) + "/s" : "")),
    " · ",
    el("span", { class: "cached" }, "prompt " + fmt(usage ? usage.prompt_tokens : null, 0) + " tokens, " + fmt(cached, 0) + " cached"),
    result && result.valid === false ? el("span", { class: "bad" }, " · invalid: " + (result.error || "")) : "",
  );
  $("#send").disabled = false;
}

// -- wiring -----------------------------------------------------------------------------------

function show(view) {
  for (const b of document.querySelectorAll("#tabs button")) b.classList.toggle("active", b.dataset.view === view);
  for (const s of document.querySelectorAll(".view")) s.hidden = s.id !== "view-" + view;
  if (signedIn() && view === "tenants") loadKeys();
  if (signedIn() && view === "engine") loadHeatmaps();
  if (signedIn() && view === "playground" && !state.models.length) loadModels();
  location.hash = view;
}

function signIn(event) {
  event.preventDefault();
  const k = $("#key").value.trim();
  sessionStorage.setItem(KEY_SLOT, k);
  $("#key").value = "";
  $("#who").textContent = k ? "key set" : "no key";
  state.previous = null;
  state.models = [];
  refresh();
  const active = document.querySelector("#tabs button.active");
  if (active) show(active.dataset.view);
}

document.addEventListener("DOMContentLoaded", () => {
  for (const b of document.querySelectorAll("#tabs button")) b.addEventListener("click", () => show(b.dataset.view));
  $("#signin").addEventListener("submit", signIn);
  $("#new-key").addEventListener("submit", createKey);
  $("#chat").addEventListener("submit", send);
  $("#clear").addEventListener("click", () => {
    state.chat = [];
    $("#transcript").replaceChildren();
  });
  $("#who").textContent = signedIn() ? (key() ? "key set" : "no key") : "";
  const start = (location.hash || "#fleet").slice(1);
  show(["fleet", "tenants", "engine", "playground"].includes(start) ? start : "fleet");
  refresh();
  setInterval(refresh, REFRESH_MS);
});
