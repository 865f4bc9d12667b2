"use strict";
// Shared by the console's pages: API calls through the bridge, DOM building, a bar chart.
// Every value from the server or a tenant is put in the page as text (textContent), never
// as HTML.

const Console = (() => {
  const csrf = document.querySelector('meta[name="csrf-token"]').content;
  const { api: apiBase, login } = document.body.dataset;

  class ApiError extends Error {
    constructor(status, body) {
      super((body && body.error && body.error.message) || `HTTP ${status}`);
      this.status = status;
      this.body = body;
    }
  }

  // A call to the gateway's API as this page's user; a 401 (a revoked key) signs out.
  async function call(path, options = {}) {
    const headers = new Headers(options.headers || {});
    headers.set("X-CSRF-Token", csrf);
    const response = await fetch(apiBase + path, { ...options, headers, credentials: "same-origin" });
    if (response.status === 401) {
      location.assign(login + "?expired=1");
      return new Promise(() => {});  // the page is going away: nothing more to do
    }
    return response;
  }

  async function json(path, options = {}) {
    if (options.body !== undefined && typeof options.body !== "string") {
      options = { ...options, body: JSON.stringify(options.body),
                  headers: { "content-type": "application/json" } };
    }
    const response = await call(path, options);
    const body = await response.json().catch(() => null);
    if (!response.ok) throw new ApiError(response.status, body);
    return body;
  }

  // el("td", {class: "x"}, "text", child): strings become text nodes.
  function el(tag, attrs = {}, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs)) {
      if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
      else node.setAttribute(key, value);
    }
    for (const child of children) {
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  function fill(tbody, rows) {
    tbody.replaceChildren(...rows.map((cells) =>
      el("tr", {}, ...cells.map((c) => el("td", {}, c)))));
  }

  function bytes(n) {
    const units = ["B", "KiB", "MiB", "GiB"];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
    return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
  }

  function time(unix) {
    return new Date(unix * 1000).toISOString().replace("T", " ").slice(0, 16) + " UTC";
  }

  function daysBack(count) {
    const end = new Date();
    const start = new Date(end.getTime() - (count - 1) * 86400000);
    return { start: start.toISOString().slice(0, 10), end: end.toISOString().slice(0, 10) };
  }

  // Stacked bars: one per label (day), one colour per series (model or tenant).
  function barChart(svg, labels, series) {
    const NS = "http://www.w3.org/2000/svg";
    const width = 640, height = 200, pad = 28;
    const names = Object.keys(series);
    const totals = labels.map((_, i) => names.reduce((sum, n) => sum + series[n][i], 0));
    const top = Math.max(1, ...totals);
    const band = (width - pad) / Math.max(1, labels.length);
    svg.setAttribute("viewBox", `0 0 ${width} ${height + 40}`);
    const shape = (tag, attrs, text) => {
      const node = document.createElementNS(NS, tag);
      for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
      if (text !== undefined) node.textContent = text;
      return node;
    };
    const nodes = [shape("text", { x: 0, y: 12, class: "axis" }, `${top} tokens`)];
    labels.forEach((label, i) => {
      let y = height;
      names.forEach((name, j) => {
        if (!series[name][i]) return;
        const h = (series[name][i] / top) * (height - 20);
        y -= h;
        const bar = shape("rect", { x: pad + i * band + 2, y, width: Math.max(1, band - 4), height: h,
                                    class: `series-${j % 6}` });
        bar.append(shape("title", {}, `${name} ${label}: ${series[name][i]}`));
        nodes.push(bar);
      });
      if (labels.length <= 10 || i % Math.ceil(labels.length / 10) === 0) {
        nodes.push(shape("text", { x: pad + i * band, y: height + 14, class: "axis" }, label.slice(5)));
      }
    });
    names.forEach((name, j) => {
      nodes.push(shape("rect", { x: pad + j * 150, y: height + 24, width: 10, height: 10,
                                 class: `series-${j % 6}` }));
      nodes.push(shape("text", { x: pad + 14 + j * 150, y: height + 33, class: "axis" }, name));
    });
    svg.replaceChildren(...nodes);
  }

  // A tenant's scheduling (GET .../scheduling or the account's) in words.
  function scheduling(s) {
    const from = { tier: `tier ${s.tier}`, weight: "own weight", default: "default tier" }[s.source];
    return `${from ?? s.source}, weight ${s.weight}`;
  }

  // For a loader called again before its last call answered: `const current = ticket();`
  // before its awaits, `if (!current()) return;` after them, so only the latest call renders.
  function tickets() {
    let issued = 0;
    return () => {
      const mine = ++issued;
      return () => mine === issued;
    };
  }

  // The page's last script calls this once every handler is bound: until then its forms'
  // buttons are disabled (a form sent before would be the browser's own GET to the page).
  function ready() {
    document.body.dataset.ready = "1";
  }

  return { ready, tickets, scheduling, ApiError, call, json, el, fill, bytes, time, daysBack, barChart, csrf, apiBase };
})();
