// Tenants' keys: list, make (the secret shown once), revoke.
import { $, api, el, fetched, fill, fmt, notice, when } from "./util.js";

export async function loadKeys() {
  const listed = await fetched("/console/api/keys");
  if (!listed) return;
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

export function number(form, name) {
  const v = form.elements[name].value.trim();
  return v === "" ? null : Number(v);
}

export async function createKey(event) {
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

export async function revokeKey(id) {
  try {
    await api("/console/api/keys/" + encodeURIComponent(id) + "/revoke", { method: "POST" });
  } catch (e) {
    notice(e.message);
  }
  loadKeys();
}
