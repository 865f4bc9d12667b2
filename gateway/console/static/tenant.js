"use strict";
// The tenant's page: its adapters, its usage, its limits and keys (the playground is
// playground.js). Every call is the gateway's API (/v1/...) through the console bridge.

const { el, fill, json, call } = Console;
const $ = (id) => document.getElementById(id);
const baseModel = document.body.dataset.baseModel;

const adaptersTicket = Console.tickets();
const usageTicket = Console.tickets();
const accountTicket = Console.tickets();

// ---- adapters --------------------------------------------------------------------------

async function loadAdapters() {
  const current = adaptersTicket();
  const list = await json("adapters");
  if (!current()) return;
  const tbody = $("adapter-table").querySelector("tbody");
  $("adapter-empty").hidden = list.data.length > 0;
  fill(tbody, list.data.map((a) => [
    a.name, a.rank, a.target_modules.join(", "), Console.bytes(a.num_bytes),
    el("code", { title: a.adapter_id }, a.adapter_id.slice(0, 12)),
    el("span", { title: `content since ${Console.time(a.updated_at)}` },
       `v${a.version} · ${Console.time(a.updated_at)}`),
    Console.time(a.created_at),
    el("span", { class: "actions" },
       el("button", { type: "button", "data-replace": a.name, onclick: () => startReplace(a.name) }, "Replace…"),
       el("button", { type: "button", class: "danger", "data-name": a.name, onclick: () => removeAdapter(a.name) },
          "Delete")),
  ]));
  const select = $("chat-model");
  const chosen = select.value;
  select.replaceChildren(el("option", { value: baseModel }, `${baseModel} (base)`),
                         ...list.data.map((a) => el("option", { value: a.name }, a.name)));
  if ([...select.options].some((o) => o.value === chosen)) select.value = chosen;
}

async function removeAdapter(name) {
  if (!confirm(`Delete adapter ${name}?`)) return;
  try {
    await json(`adapters/${encodeURIComponent(name)}`, { method: "DELETE" });
    $("upload-status").textContent = `Deleted ${name}.`;
  } catch (err) {
    $("upload-status").textContent = err.message;
  }
  await loadAdapters();
}

// A new version of `name`: the upload form, set to replace it (the API's `replace=true`).
function startReplace(name) {
  $("upload-name").value = name;
  $("upload-replace").checked = true;
  $("upload-status").textContent = `Choose the new content for ${name}, then Upload.`;
  $("upload-file").focus();
}

// An XMLHttpRequest rather than fetch: only it reports upload progress.
function upload(event) {
  event.preventDefault();
  const status = $("upload-status");
  const progress = $("upload-progress");
  const data = new FormData();
  data.append("name", $("upload-name").value);
  if ($("upload-replace").checked) data.append("replace", "true");
  for (const id of ["upload-file", "upload-config", "upload-model"]) {
    const input = $(id);
    if (input.files.length) data.append(input.name, input.files[0]);
  }
  // A directory as `save_pretrained` wrote it: its two files, by name (the API names the rest).
  const fields = { "adapter_config.json": "adapter_config", "adapter_model.safetensors": "adapter_model" };
  for (const file of $("upload-dir").files) {
    if (fields[file.name]) data.append(fields[file.name], file);
  }
  const xhr = new XMLHttpRequest();
  xhr.open("POST", Console.apiBase + "adapters");
  xhr.setRequestHeader("X-CSRF-Token", Console.csrf);
  xhr.upload.onprogress = (e) => {
    if (!e.lengthComputable) return;
    progress.value = e.loaded / e.total;
    status.textContent = `Uploading… ${Math.floor((100 * e.loaded) / e.total)} % of ${Console.bytes(e.total)}`;
  };
  xhr.onload = async () => {
    progress.hidden = true;
    let body = null;
    try { body = JSON.parse(xhr.responseText); } catch { /* not JSON: shown by status */ }
    if (xhr.status === 401) { location.assign(document.body.dataset.login + "?expired=1"); return; }
    if (xhr.status >= 200 && xhr.status < 300) {
      const version = body.version > 1 ? ` version ${body.version}` : "";
      status.textContent = `Uploaded ${body.name}${version} (rank ${body.rank}).`;
      $("upload").reset();
      await loadAdapters();
      loadAccount();
    } else {
      const message = body && body.error ? body.error.message : `HTTP ${xhr.status}`;
      status.textContent = `Upload refused (${xhr.status}): ${message}`;
    }
  };
  xhr.onerror = () => { progress.hidden = true; status.textContent = "Upload failed: the connection closed."; };
  progress.value = 0;
  progress.hidden = false;
  status.textContent = "Uploading…";
  xhr.send(data);
}

// ---- usage -----------------------------------------------------------------------------

let requestsCounted = 0;  // requests in the usage last shown

// The gateway settles a request's usage just after its stream's last byte, so a read right
// after an answer can miss it: read until it counts `wanted` requests (or a minute passed).
async function usageAfter(wanted) {
  for (let wait = 250; wait < 60000; wait = Math.min(2 * wait, 4000)) {
    if (await loadUsage() >= wanted) return;
    await new Promise((done) => setTimeout(done, wait));
  }
}

// Draws the usage; returns how many requests it counts (-1 when a later call drew instead).
async function loadUsage() {
  const count = Number($("usage-days").value);
  const { start, end } = Console.daysBack(count);
  const current = usageTicket();
  const usage = await json(`usage?start_date=${start}&end_date=${end}`);
  if (!current()) return -1;
  const days = [];
  for (let t = Date.parse(start); t <= Date.parse(end); t += 86400000) days.push(new Date(t).toISOString().slice(0, 10));
  const series = {};
  for (const row of usage.data) {
    series[row.model] = series[row.model] || days.map(() => 0);
    series[row.model][days.indexOf(row.date)] += row.total_tokens;
  }
  Console.barChart($("usage-chart"), days, series);
  fill($("usage-table").querySelector("tbody"), usage.data.slice().reverse().map((r) => [
    r.date, r.model, r.requests, r.prompt_tokens, r.completion_tokens, r.total_tokens]));
  requestsCounted = usage.data.reduce((sum, r) => sum + r.requests, 0);
  return requestsCounted;
}

// ---- limits and keys -------------------------------------------------------------------

const LIMITS = {
  requests_per_minute: "Requests per minute", tokens_per_minute: "Tokens per minute",
  max_concurrent_requests: "Concurrent requests", daily_tokens: "Tokens today (UTC)",
  max_adapters: "Adapters", max_adapter_bytes: "Adapter storage",
};

async function loadAccount() {
  const current = accountTicket();
  const account = await json("account");
  if (!current()) return;
  const show = (name, n) => (n === null ? "–" : name === "max_adapter_bytes" ? Console.bytes(n) : n);
  fill($("limit-table").querySelector("tbody"), Object.entries(LIMITS).map(([name, label]) => {
    const limit = account.limits[name];
    const used = account.in_use[name];
    const left = limit === null ? "no limit" : show(name, Math.max(0, limit - (used ?? 0)));
    return [label, limit === null ? "no limit" : show(name, limit), show(name, used), left];
  }));
  const s = account.scheduling;
  $("scheduling").textContent = `Scheduling: ${Console.scheduling(s)} ` +
    "(your share of busy workers relative to other tenants').";
  const own = account.self_service_keys;
  $("self-service").hidden = !own;
  $("admin-keys").hidden = own;
  fill($("key-table").querySelector("tbody"), account.keys.map((k) => [
    el("code", {}, k.key_id), Console.time(k.created_at),
    el("span", {}, k.key_id === account.key_id ? "this session " : "",
       ...(own ? [el("button", { type: "button", class: "danger", onclick: () => revokeKey(k.key_id) }, "Revoke")] : [])),
  ]));
}

async function revokeKey(keyId) {
  if (!confirm(`Revoke ${keyId}? Whoever uses it is refused from now on.`)) return;
  try {
    await json(`account/keys/${encodeURIComponent(keyId)}`, { method: "DELETE" });
  } catch (err) {
    $("key-error").textContent = err.message;
  }
  await loadAccount();  // revoking this session's own key signs it out here
}

$("new-key").addEventListener("click", async () => {
  $("key-error").textContent = "";
  try {
    const key = await json("account/keys", { method: "POST" });
    await loadAccount();
    $("new-key-value").textContent = `New key (shown once): ${key.key}`;
  } catch (err) {
    $("key-error").textContent = err.message;
  }
});

$("upload").addEventListener("submit", upload);
$("upload-button").disabled = false;  // disabled in the page until this handler is bound
$("usage-days").addEventListener("change", loadUsage);
loadAdapters();
loadUsage();
loadAccount();
