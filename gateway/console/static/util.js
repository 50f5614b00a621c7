// Shared by the console's modules: the key, the API, the page's state, DOM and number helpers.
export const KEY_SLOT = "ctxfuse.console.key";

export const $ = (sel) => document.querySelector(sel);
export const state = { previous: null, refreshing: false, series: {}, tenantSeries: {}, chat: [], models: [] };

// -- the key and the API ----------------------------------------------------------------------

export function key() {
  return sessionStorage.getItem(KEY_SLOT) || "";
}

// signed in: a key given, or an empty one on a server started open (nothing is asked before)
export function signedIn() {
  return sessionStorage.getItem(KEY_SLOT) !== null;
}

export function headers(extra) {
  const h = Object.assign({ "Content-Type": "application/json" }, extra || {});
  if (key()) h.Authorization = "Bearer " + key();
  return h;
}

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

export async function api(path, options) {
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

// a GET whose failure is shown in the notice: its body, or null
export async function fetched(path) {
  try {
    return await api(path);
  } catch (e) {
    notice(e.message);
    return null;
  }
}

export function notice(message) {
  const n = $("#notice");
  n.textContent = message || "";
  n.hidden = !message;
}

// -- small helpers ----------------------------------------------------------------------------

export function el(tag, attrs, ...children) {
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

export function fill(tbody, rows) {
  tbody.replaceChildren(...rows);
}

export function fmt(n, digits) {
  if (n === null || n === undefined || Number.isNaN(n)) return "–";
  if (typeof n !== "number") return String(n);
  return n.toLocaleString("en", { maximumFractionDigits: digits === undefined ? 2 : digits });
}

export function when(seconds) {
  return seconds ? new Date(seconds * 1000).toISOString().replace("T", " ").slice(0, 16) : "–";
}

export function bytes(n) {
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
export function total(metrics, name, where) {
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
