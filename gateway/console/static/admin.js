"use strict";
// The admin's page: tenants (quotas, scheduling, keys), everyone's usage, the fleet. Every
// call is the gateway's admin API (/admin/...) through the console bridge.

const { el, fill, json } = Console;
const $ = (id) => document.getElementById(id);
const QUOTAS = ["requests_per_minute", "tokens_per_minute", "max_concurrent_requests", "daily_tokens",
                "max_adapters", "max_adapter_bytes"];
let selected = null;

const show = (target) => (err) => { $(target).textContent = err.message; };
const path = (tenant, rest = "") => `tenants/${encodeURIComponent(tenant)}${rest}`;

const tenantsTicket = Console.tickets();
const usageTicket = Console.tickets();
const fleetTicket = Console.tickets();

async function loadTenants() {
  const current = tenantsTicket();
  const tenants = (await json("tenants")).data;
  const rows = await Promise.all(tenants.map(async (t) => {
    const [quota, used, scheduling] = await Promise.all([
      json(path(t.name, "/quotas")), json(path(t.name, "/quotas/in-use")), json(path(t.name, "/scheduling"))]);
    const limit = (name) => (quota[name] === null ? "–" : `${quota[name]} (${used[name]} in use)`);
    return [t.name, Console.time(t.created_at), limit("requests_per_minute"), limit("tokens_per_minute"),
            limit("max_concurrent_requests"), limit("daily_tokens"),
            Console.scheduling(scheduling),
            el("button", { type: "button", "data-tenant": t.name, onclick: () => select(t.name) }, "Manage")];
  }));
  if (current()) fill($("tenant-table").querySelector("tbody"), rows);
}

async function select(tenant) {
  selected = tenant;
  $("new-key-value").textContent = "";
  $("detail-error").textContent = "";
  const [quota, scheduling, keys, adapters, selfService] = await Promise.all([
    json(path(tenant, "/quotas")), json(path(tenant, "/scheduling")), json(path(tenant, "/keys")),
    json(path(tenant, "/adapters")), json(path(tenant, "/self-service"))]);
  $("self-service-keys").checked = selfService.keys;
  for (const field of QUOTAS) $(`q-${field}`).value = quota[field] ?? "";
  $("s-tier").value = scheduling.tier ?? "";
  $("s-weight").value = scheduling.tier ? "" : scheduling.weight;
  fill($("key-table").querySelector("tbody"), keys.data.map((k) => [
    el("code", {}, k.key_id), Console.time(k.created_at),
    el("button", { type: "button", class: "danger", onclick: () => revoke(k.key_id) }, "Revoke")]));
  fill($("detail-adapters").querySelector("tbody"), adapters.data.map((a) => [
    a.name, a.rank, a.target_modules.join(", "), Console.bytes(a.num_bytes), el("code", {}, a.adapter_id.slice(0, 12))]));
  // Named and shown only now that its form holds its values: an edit made while they loaded
  // would be overwritten by them, and saved as the old quotas.
  $("detail-name").textContent = tenant;
  $("tenant-detail").hidden = false;
  $("tenant-detail").scrollIntoView();
}

async function revoke(keyId) {
  if (!confirm(`Revoke ${keyId}? Its holder is signed out at once.`)) return;
  await json(`keys/${encodeURIComponent(keyId)}`, { method: "DELETE" }).catch(show("detail-error"));
  await select(selected);
}

$("new-tenant").addEventListener("submit", async (event) => {
  event.preventDefault();
  $("tenant-error").textContent = "";
  try {
    await json("tenants", { method: "POST", body: { name: $("new-tenant-name").value } });
    $("new-tenant").reset();
    await loadTenants();
  } catch (err) { show("tenant-error")(err); }
});

$("quota").addEventListener("submit", async (event) => {
  event.preventDefault();
  const body = {};
  for (const field of QUOTAS) {
    const value = $(`q-${field}`).value;
    if (value !== "") body[field] = Number(value);
  }
  try {
    await json(path(selected, "/quotas"), { method: "PUT", body });
    $("detail-error").textContent = "";
    await loadTenants();
  } catch (err) { show("detail-error")(err); }
});

$("scheduling").addEventListener("submit", async (event) => {
  event.preventDefault();
  const tier = $("s-tier").value.trim();
  const body = tier ? { tier } : { weight: Number($("s-weight").value) };
  try {
    await json(path(selected, "/scheduling"), { method: "PUT", body });
    $("detail-error").textContent = "";
    await loadTenants();
  } catch (err) { show("detail-error")(err); }
});

$("self-service-keys").addEventListener("change", async (event) => {
  try {
    await json(path(selected, "/self-service"), { method: "PUT", body: { keys: event.target.checked } });
  } catch (err) { show("detail-error")(err); }
});

$("new-key").addEventListener("click", async () => {
  try {
    const key = await json(path(selected, "/keys"), { method: "POST" });
    await select(selected);
    $("new-key-value").textContent = `New key (shown once): ${key.key}`;
  } catch (err) { show("detail-error")(err); }
});

async function loadUsage() {
  const current = usageTicket();
  const { start, end } = Console.daysBack(Number($("usage-days").value));
  const usage = await json(`usage?start_date=${start}&end_date=${end}`);
  if (!current()) return;
  const days = [];
  for (let t = Date.parse(start); t <= Date.parse(end); t += 86400000) days.push(new Date(t).toISOString().slice(0, 10));
  const series = {};
  for (const row of usage.data) {
    series[row.tenant] = series[row.tenant] || days.map(() => 0);
    series[row.tenant][days.indexOf(row.date)] += row.total_tokens;
  }
  Console.barChart($("usage-chart"), days, series);
}

async function loadFleet() {
  const current = fleetTicket();
  const workers = (await json("workers")).data;
  if (!current()) return;
  $("fleet-empty").hidden = workers.length > 0;
  fill($("worker-table").querySelector("tbody"), workers.map((w) => {
    const used = w.total_kv_blocks ? 1 - w.free_kv_blocks / w.total_kv_blocks : 0;
    const held = w.adapters.map((id) => (w.adapter_names[id] || []).join(", ") || id.slice(0, 12));
    return [w.worker_id, w.address, w.running, w.waiting, `${(used * 100).toFixed(0)} %`,
            held.length ? held.join("; ") : "–", `${Math.max(0, Date.now() / 1000 - w.heartbeat_at).toFixed(0)} s ago`];
  }));
  fill($("service-table").querySelector("tbody"), workers.flatMap((w) => (w.tenant_service === null
    ? [[w.worker_id, "(no answer)", "", "", "", "", ""]]
    : w.tenant_service.map((t) => [w.worker_id, t.tenant || "–", t.weight, t.prefill_tokens, t.decode_tokens,
                                   t.virtual_counter.toFixed(1), `${(t.mean_queue_s * 1000).toFixed(0)} ms`]))));
}

$("usage-days").addEventListener("change", loadUsage);
loadTenants();
loadUsage();
loadFleet();
setInterval(() => loadFleet().catch(() => {}), 5000);
