"use strict";
// The tenant's batches: each one's status, progress, counts and files, a cancel button while
// it runs, and a form that uploads a JSONL file and starts a batch on it. Every call is the
// gateway's API (/v1/files, /v1/batches) through the console bridge; the list refreshes
// every few seconds while a batch is not final.

(() => {
  const { el, fill, json, call } = Console;
  const $ = (id) => document.getElementById(id);
  const FINAL = new Set(["completed", "failed", "expired", "cancelled"]);
  const ticket = Console.tickets();
  let timer = null;

  function progress(batch) {
    const counts = batch.request_counts;
    const done = counts.completed + counts.failed;
    const bar = el("progress", { max: String(Math.max(counts.total, 1)), value: String(done) });
    return el("span", { title: `${done} of ${counts.total} lines` }, bar);
  }

  // A file's bytes through the bridge (it needs the CSRF header, so no plain link), saved.
  async function download(fileId, name) {
    const response = await call(`files/${encodeURIComponent(fileId)}/content`);
    if (!response.ok) { $("batch-status").textContent = `Download refused (${response.status}).`; return; }
    const url = URL.createObjectURL(await response.blob());
    const link = el("a", { href: url, download: name });
    document.body.append(link);
    link.click();
    link.remove();
    URL.revokeObjectURL(url);
  }

  function files(batch) {
    const links = [["input", batch.input_file_id], ["output", batch.output_file_id], ["errors", batch.error_file_id]];
    return el("span", { class: "actions" }, ...links.filter(([, id]) => id).map(([label, id]) =>
      el("button", { type: "button", title: id, onclick: () => download(id, `${batch.id}_${label}.jsonl`) }, label)));
  }

  async function cancel(batchId) {
    try {
      await json(`batches/${encodeURIComponent(batchId)}/cancel`, { method: "POST" });
    } catch (err) {
      $("batch-status").textContent = err.message;
    }
    await load();
  }

  async function load() {
    const current = ticket();
    const list = await json("batches?limit=100");
    if (!current()) return;
    $("batch-empty").hidden = list.data.length > 0;
    fill($("batch-table").querySelector("tbody"), list.data.map((b) => [
      el("code", {}, b.id), b.status, b.endpoint, progress(b),
      `${b.request_counts.completed} / ${b.request_counts.failed} / ${b.request_counts.total}`,
      Console.time(b.created_at), files(b),
      FINAL.has(b.status) || b.status === "cancelling" ? ""
        : el("button", { type: "button", class: "danger", onclick: () => cancel(b.id) }, "Cancel"),
    ]));
    clearTimeout(timer);
    if (list.data.some((b) => !FINAL.has(b.status))) timer = setTimeout(load, 3000);
  }

  async function submit(event) {
    event.preventDefault();
    const status = $("batch-status");
    const data = new FormData();
    data.append("purpose", "batch");
    data.append("file", $("batch-file").files[0]);
    try {
      const response = await call("files", { method: "POST", body: data });
      const uploaded = await response.json().catch(() => null);
      if (!response.ok) throw new Error((uploaded && uploaded.error && uploaded.error.message) || `HTTP ${response.status}`);
      const batch = await json("batches", { method: "POST", body: {
        input_file_id: uploaded.id, endpoint: $("batch-endpoint").value, completion_window: "24h" } });
      status.textContent = `Started ${batch.id} on ${uploaded.filename}.`;
      $("batch-form").reset();
    } catch (err) {
      status.textContent = `Refused: ${err.message}`;
    }
    await load();
  }

  $("batch-form").addEventListener("submit", submit);
  $("batch-submit").disabled = false;  // disabled in the page until this handler is bound
  load();
})();
