"""Tools and tool turns in the prompt: through the model's own chat template when it reads
`tools` (as transformers' `apply_chat_template(tools=...)` passes them), else through a
fallback in the Hermes / Qwen2.5 style that any template can render:

- the tools are listed, one JSON object a line, inside `<tools></tools>` in a system message
  (after the conversation's own system message, if any), with the instruction to answer
  with `<tool_call>` blocks;
- an assistant's earlier calls become `<tool_call>\\n{"name", "arguments"}\\n</tool_call>`
  blocks after its content;
- tool results become a user message wrapping each (consecutive ones together) in
  `<tool_response>\\n…\\n</tool_response>`.

Either way the model answers in the Hermes format (`gateway.structured.tool_grammar`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from gateway.structured.tool_grammar import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def template_input(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, *, native: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and the `tools` variable to render: unchanged for a template that reads
    `tools` (``native``), the fallback's messages and no `tools` otherwise. ``tools`` are
    OpenAI's tool objects, None when the model is not to see any."""
    if native:
        return messages, tools
    return fallback_messages(messages, tools), None


def fallback_messages(
    messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """Plain `{"role", "content"}` messages in the Hermes style (see the module docstring)."""
    out: list[dict[str, Any]] = []
    previous = None
    for message in messages:
        role = message["role"]
        if role == "tool":
            response = f"<tool_response>\n{message['content']}\n</tool_response>"
            if previous == "tool":
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response})
        else:
            content = message["content"]
            if message.get("tool_calls"):
                blocks = [call_block(call["function"]) for call in message["tool_calls"]]
                content = "\n".join([content, *blocks] if content else blocks)
            out.append({"role": role, "content": content})
        previous = role
    if tools:
        out = _with_tools_prompt(out, tools)
    return out


def call_block(function: dict[str, Any]) -> str:
    """One call as the model writes it; `arguments` is a JSON value (already parsed)."""
    call = {"name": function["name"], "arguments": function["arguments"]}
    return f"{TOOL_CALL_OPEN}\n{json.dumps(call, ensure_ascii=False)}\n{TOOL_CALL_CLOSE}"


def tools_prompt(tools: list[dict[str, Any]]) -> str:
    listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return TOOLS_PROMPT.format(tools=listed)


def _with_tools_prompt(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    prompt = tools_prompt(tools)
    if messages and messages[0]["role"] == "system":
        system = messages[0]["content"]
        merged = f"{system}\n\n{prompt}" if system else prompt
        return [{"role": "system", "content": merged}, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]
