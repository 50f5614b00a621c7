// The ctxfuse console: the operator's views over /console/api/ and a playground over the public
// OpenAI API. ES modules, no framework, no build step: the gateway serves these files as they are.
import { $, KEY_SLOT, key, signedIn, state } from "./util.js";
import { loadHeatmaps, refresh } from "./views.js";
import { createKey, loadKeys } from "./keys.js";
import { loadModels, send } from "./playground.js";

const REFRESH_MS = 2000;

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
