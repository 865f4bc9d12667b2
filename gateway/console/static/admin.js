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
  if (!current()) return;
  fill($("tenant-table").querySelector("tbody"), rows);
  tenantChoices(tenants.map((t) => t.name));
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
    a.name, a.rank, a.target_modules.join(", "), Console.bytes(a.num_bytes), el("code", {}, a.adapter_id.slice(0, 12)),
    `v${Math.max(1, a.version ?? 0)} · ${Console.time(a.updated_at || a.created_at)}`]));
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

// Every tenant's usage (or one's), per day, tenant and model: the admin API's /admin/usage.
async function loadUsage() {
  const current = usageTicket();
  const { start, end } = Console.daysBack(Number($("usage-days").value));
  const tenant = $("usage-tenant").value;
  const only = tenant ? `&tenant=${encodeURIComponent(tenant)}` : "";
  const usage = await json(`usage?start_date=${start}&end_date=${end}${only}`);
  if (!current()) return;
  const days = [];
  for (let t = Date.parse(start); t <= Date.parse(end); t += 86400000) days.push(new Date(t).toISOString().slice(0, 10));
  const by = $("usage-by").value;
  const key = (row) => (by === "tenant" ? row.tenant : by === "model" ? row.model : `${row.tenant} · ${row.model}`);
  const series = {};
  for (const row of usage.data) {
    series[key(row)] = series[key(row)] || days.map(() => 0);
    series[key(row)][days.indexOf(row.date)] += row.total_tokens;
  }
  Console.barChart($("usage-chart"), days, series);
  const rows = usage.data.slice().sort((a, b) =>
    b.date.localeCompare(a.date) || a.tenant.localeCompare(b.tenant) || a.model.localeCompare(b.model));
  fill($("usage-table").querySelector("tbody"), rows.map((r) => [
    r.date, r.tenant, r.model, r.requests, r.prompt_tokens, r.completion_tokens, r.total_tokens]));
  $("usage-empty").hidden = rows.length > 0;
}

// The tenant filter's choices, kept when the list is read again.
function tenantChoices(names) {
  const select = $("usage-tenant");
  const chosen = select.value;
  select.replaceChildren(el("option", { value: "" }, "every tenant"),
                         ...names.map((name) => el("option", { value: name }, name)));
  if (names.includes(chosen)) select.value = chosen;
}

async function loadFleet() {
  const current = fleetTicket();
  const fleet = await json("workers");
  const workers = fleet.data;
  if (!current()) return;
  $("fleet-empty").hidden = workers.length > 0;
  fill($("pool-table").querySelector("tbody"), fleet.pools.map((p) => [
    p.base, el("code", {}, (p.base_id || "").slice(0, 12) || "–"), p.workers.join(", "),
    p.running, p.waiting, `${p.slots_used} of ${p.slots_total}`]));
  fill($("worker-table").querySelector("tbody"), workers.map((w) => {
    const used = w.total_kv_blocks ? 1 - w.free_kv_blocks / w.total_kv_blocks : 0;
    const named = (id) => (w.adapter_names[id] || []).join(", ") || `${id.slice(0, 12)} (no name)`;
    const inSlots = w.slot_adapters.filter(Boolean);
    const slots = el("div", { class: "held" },
      el("span", { class: "muted" }, `${inSlots.length} of ${w.slot_adapters.length} slots`),
      ...inSlots.map((id) => el("span", { "data-adapter": id }, named(id))));
    const host = el("div", { class: "held" },
      el("span", { class: "muted" },
         `${w.host_adapters.length} · ${Console.bytes(w.host_cache_bytes)} of ${Console.bytes(w.host_cache_limit)}`),
      ...w.host_adapters.map((id) => el("span", { "data-adapter": id }, named(id))));
    return [w.worker_id, w.base || "–", w.address, w.running, w.waiting, `${(used * 100).toFixed(0)} %`, slots, host,
            `${Math.max(0, Date.now() / 1000 - w.heartbeat_at).toFixed(0)} s ago`];
  }));
  fill($("service-table").querySelector("tbody"), workers.flatMap((w) => (w.tenant_service === null
    ? [[w.worker_id, "(no answer)", "", "", "", "", ""]]
    : w.tenant_service.map((t) => [w.worker_id, t.tenant || "–", t.weight, t.prefill_tokens, t.decode_tokens,
                                   t.virtual_counter.toFixed(1), `${(t.mean_queue_s * 1000).toFixed(0)} ms`]))));
}

for (const id of ["usage-days", "usage-tenant", "usage-by"]) $(id).addEventListener("change", loadUsage);
$("new-tenant-button").disabled = false;  // disabled in the page until its handler is bound
Console.ready();
loadTenants();
loadUsage();
loadFleet();
setInterval(() => loadFleet().catch(() => {}), 5000);
