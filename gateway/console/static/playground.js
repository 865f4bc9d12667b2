"use strict";
// The tenant's playground: a streamed chat with the base model or one of its adapters, with
// the API's sampling settings, output constraints (response_format, vLLM's structured_outputs)
// and tools. What it sends is a /v1/chat/completions body; what the API refuses is shown in
// the API's words. Loaded after tenant.js (its loadAccount, usageAfter, requestsCounted).

const Playground = (() => {
  const { el, call } = Console;
  const $ = (id) => document.getElementById(id);

  let history = [];  // the conversation so far, as the API's messages
  let pending = [];  // tool calls of the last answer not answered yet: {id, name}

  // The output constraint the Output select names, into `body` (JSON text parsed here).
  const CONSTRAINTS = {
    text: null,
    json_object: { label: null, apply: (body) => { body.response_format = { type: "json_object" }; } },
    json_schema: {
      label: "JSON schema",
      apply: (body, text) => {
        body.response_format = { type: "json_schema", json_schema: { name: "answer", schema: parsed("The schema", text) } };
      },
    },
    regex: { label: "Regular expression (the whole answer)", apply: (body, text) => { body.structured_outputs = { regex: text }; } },
    choice: {
      label: "Choices (one a line)",
      apply: (body, text) => { body.structured_outputs = { choice: text.split("\n").filter(Boolean) }; },
    },
    grammar: { label: "Grammar (Lark or GBNF)", apply: (body, text) => { body.structured_outputs = { grammar: text }; } },
  };

  class InputError extends Error {}

  function parsed(what, text) {
    try { return JSON.parse(text); } catch (err) { throw new InputError(`${what} is not JSON: ${err.message}`); }
  }

  // Sampling fields, each only when set (the API's defaults otherwise).
  function sampling(body) {
    body.temperature = Number($("chat-temperature").value);
    body.top_p = Number($("chat-top-p").value);
    body.max_tokens = Number($("chat-max-tokens").value);
    const optional = { "chat-seed": "seed", "chat-top-k": "top_k", "chat-min-p": "min_p",
                       "chat-presence": "presence_penalty", "chat-frequency": "frequency_penalty",
                       "chat-repetition": "repetition_penalty" };
    for (const [id, field] of Object.entries(optional)) {
      if ($(id).value !== "") body[field] = Number($(id).value);
    }
    const stops = $("chat-stop").value.split("\n").filter(Boolean);
    if (stops.length) body.stop = stops;
  }

  function tools(body) {
    const text = $("chat-tools").value.trim();
    if (!text) return;
    body.tools = parsed("Tools", text);
    const choice = $("chat-tool-choice").value;
    body.tool_choice = choice.startsWith("function:")
      ? { type: "function", function: { name: choice.slice("function:".length) } }
      : choice;
    body.parallel_tool_calls = $("chat-parallel").checked;
  }

  // tool_choice offers each function the tools text names, once it parses.
  function toolChoices() {
    const select = $("chat-tool-choice");
    const chosen = select.value;
    let names = [];
    try {
      const list = JSON.parse($("chat-tools").value || "[]");
      names = Array.isArray(list) ? list.map((t) => t && t.function && t.function.name).filter((n) => typeof n === "string") : [];
    } catch { /* not JSON yet: the plain choices only */ }
    select.replaceChildren(...["auto", "required", "none"].map((c) => el("option", { value: c }, c)),
                           ...names.map((n) => el("option", { value: `function:${n}` }, `function ${n}`)));
    if ([...select.options].some((o) => o.value === chosen)) select.value = chosen;
  }

  // "Send as": the user, or the result of one of the last answer's tool calls.
  function roles() {
    $("chat-role").replaceChildren(el("option", { value: "user" }, "user"),
      ...pending.map((c) => el("option", { value: c.id }, `result of ${c.name} (${c.id})`)));
    if (pending.length) $("chat-role").value = pending[0].id;
  }

  // A transcript row: its role, its text, and (assistant) the tool calls it makes.
  function turn(role, text) {
    const node = el("div", { class: `turn ${role}` }, el("span", { class: "role" }, role),
                    el("div", {}, el("span", { class: "text" }, text), el("div", { class: "tool-calls" })));
    $("transcript").append(node);
    return node;
  }

  async function* sseEvents(response) {
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value.replaceAll("\r\n", "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        for (const line of event.split("\n")) {
          if (line.startsWith("data:")) {
            const data = line.slice(5).trim();
            if (data !== "[DONE]") yield JSON.parse(data);
          }
        }
      }
    }
  }

  // Decode speed: tokens after the first over the time after it. Output the API holds back
  // (a suffix that may begin a tool call) arrives in one late piece, which would make that
  // time a sliver: then the whole request's rate, said so.
  function speed(tokens, pieces, started, first, end) {
    if (first === null || tokens < 2) return "– tokens/s";
    if (pieces > 2) return `${((tokens - 1) / ((end - first) / 1000)).toFixed(1)} tokens/s`;
    return `${(tokens / ((end - started) / 1000)).toFixed(1)} tokens/s overall`;
  }

  function showError(err) {
    $("chat-error").textContent = err.message;
    const param = err.body && err.body.error && err.body.error.param;
    $("chat-error-param").textContent = param ? `(field: ${param})` : "";
  }

  // The message this turn sends: the user's, or a tool call's result.
  function outgoing(content) {
    const role = $("chat-role").value;
    if (role === "user") return { role: "user", content };
    return { role: "tool", tool_call_id: role, content };
  }

  async function send(event) {
    event.preventDefault();
    showError({ message: "" });
    const stats = $("chat-stats");
    const content = $("chat-input").value;
    const message = outgoing(content);
    const system = $("chat-system").value;
    const body = {
      model: $("chat-model").value, stream: true, stream_options: { include_usage: true },
      messages: [...(system ? [{ role: "system", content: system }] : []), ...history, message],
    };
    try {
      sampling(body);
      const constraint = CONSTRAINTS[$("chat-format").value];
      if (constraint) constraint.apply(body, $("chat-constraint").value);
      tools(body);
    } catch (err) {
      if (!(err instanceof InputError)) throw err;
      showError(err);
      return;
    }
    $("chat-send").disabled = true;
    const started = performance.now();
    let first = null, pieces = 0, usage = null, answer = "", finish = null;
    const calls = [];  // by index: {id, name, arguments}
    try {
      const response = await call("chat/completions", {
        method: "POST", headers: { "content-type": "application/json" }, body: JSON.stringify(body),
      });
      if (!response.ok) {
        const failed = await response.json().catch(() => null);
        throw new Console.ApiError(response.status, failed);
      }
      const limits = ["requests", "tokens"]
        .filter((kind) => response.headers.has(`x-ratelimit-remaining-${kind}`))
        .map((kind) => `${response.headers.get(`x-ratelimit-remaining-${kind}`)} ${kind} left this minute`);
      turn(message.role, message.role === "tool" ? `${message.tool_call_id}: ${content}` : content);
      const node = turn("assistant", "");
      const out = node.querySelector(".text");
      const callList = node.querySelector(".tool-calls");
      stats.textContent = "streaming…";
      for await (const chunk of sseEvents(response)) {
        if (chunk.error) throw new Console.ApiError(200, chunk);
        if (chunk.usage) usage = chunk.usage;
        const choice = chunk.choices && chunk.choices[0];
        if (!choice) continue;
        finish = choice.finish_reason ?? finish;
        const delta = choice.delta || {};
        if (delta.content || delta.tool_calls) {
          first = first ?? performance.now();
          pieces += 1;
        }
        if (delta.content) {
          answer += delta.content;
          out.textContent = answer;
        }
        for (const piece of delta.tool_calls || []) {
          const slot = calls[piece.index] = calls[piece.index] || { id: "", name: "", arguments: "" };
          slot.id = piece.id || slot.id;
          if (piece.function) {
            slot.name += piece.function.name || "";
            slot.arguments += piece.function.arguments || "";
          }
          callList.replaceChildren(...calls.filter(Boolean).map((c) =>
            el("div", { class: "tool-call", "data-call": c.id }, el("code", {}, `${c.name}(${c.arguments})`),
               el("span", { class: "muted" }, ` ${c.id}`))));
        }
      }
      const end = performance.now();
      const tokens = usage ? usage.completion_tokens : pieces;
      const ttft = first === null ? null : first - started;
      stats.textContent = `${tokens} tokens · TTFT ${ttft === null ? "–" : ttft.toFixed(0) + " ms"}` +
        ` · ${speed(tokens, pieces, started, first, end)}` + (finish ? ` · ${finish}` : "") +
        limits.map((l) => ` · ${l}`).join("");
      const made = calls.filter(Boolean);
      const reply = { role: "assistant", content: answer || null };
      if (made.length) {
        reply.tool_calls = made.map((c) => ({ id: c.id, type: "function", function: { name: c.name, arguments: c.arguments } }));
      }
      history.push(message, reply);
      pending = pending.filter((c) => c.id !== message.tool_call_id);
      if (made.length) pending = made.map((c) => ({ id: c.id, name: c.name }));
      roles();
      $("chat-input").value = "";
      loadAccount();
      usageAfter(requestsCounted + 1);
    } catch (err) {
      showError(err);
      stats.textContent = "";
    } finally {
      $("chat-send").disabled = false;
    }
  }

  function clear() {
    history = [];
    pending = [];
    roles();
    $("transcript").replaceChildren();
    $("chat-stats").textContent = "";
    showError({ message: "" });
  }

  function formatChanged() {
    const constraint = CONSTRAINTS[$("chat-format").value];
    const label = constraint && constraint.label;
    $("chat-constraint-label").hidden = !label;
    $("chat-constraint-name").textContent = label || "";
  }

  $("chat").addEventListener("submit", send);
  $("chat-clear").addEventListener("click", clear);
  $("chat-format").addEventListener("change", formatChanged);
  $("chat-tools").addEventListener("input", toolChoices);
  $("chat-send").disabled = false;  // disabled in the page until this handler is bound
  Console.ready();
  return { clear };
})();
