// The snapshot and the views drawn from it: the server line, the fleet, the engine, usage by tenant.
import { $, api, el, fetched, fill, fmt, bytes, headers, notice, signedIn, state, total } from "./util.js";
import { draw, meanOver, push, rateOver } from "./charts.js";

export async function refresh() {
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

export function renderServer(snap) {
  const srv = snap.server;
  $("#keys-note").hidden = srv.keys_managed;
  $("#new-key button[type=submit]").disabled = !srv.keys_managed;
  const up = Math.round(snap.time - srv.started);
  $("#server-line").replaceChildren(
    el("span", { class: "pill" }, srv.role),
    el("span", { class: srv.not_ready ? "pill bad" : "pill good" }, srv.not_ready ? "not ready: " + srv.not_ready : "ready"),
    el("span", { class: "muted" }, "up " + fmt(up / 60, 1) + " min"),
  );
}

export function renderFleet(snap) {
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

export function renderEngine(snap) {
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

export function renderUsage(snap, then) {
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
export async function loadHeatmaps() {
  const listed = await fetched("/console/api/longctx");
  if (!listed) return;
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
