"""A chat answer's text → its content and tool calls, whole or as it streams.

Calls are Hermes blocks (`gateway.structured.tool_grammar`): `<tool_call>\\n{"name", "arguments"}\\n
</tool_call>`. The content is the text outside the blocks, with leading and trailing
whitespace stripped (the response's null when nothing is left); a block whose JSON is not a
call stays in the content as it was written. Each call gets a fresh id ("call_" + 24
letters and digits) and its arguments re-serialized as compact JSON text, as OpenAI returns
them.

`ToolCallStream` is the incremental form, one per sample: it passes content on as it comes,
holds back what could still turn out to start `<tool_call>` (and whitespace that could end
up trailing), and buffers each block until `</tool_call>`. Fed any split of a text and then
finished, it gives exactly what `parse_tool_calls` gives for the whole text.
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass, field
from typing import Any

from gateway.structured.tool_grammar import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

ID_ALPHABET = string.ascii_letters + string.digits
ID_CHARS = 24


@dataclass(frozen=True, slots=True)
class ParsedCall:
    id: str
    name: str
    arguments: str  # JSON text

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True, slots=True)
class ToolOutput:
    """An answer, or a piece of a streamed one: content and the calls completed in it."""

    content: str
    calls: list[ParsedCall] = field(default_factory=list)

    def __add__(self, other: ToolOutput) -> ToolOutput:
        return ToolOutput(self.content + other.content, self.calls + other.calls)


def parse_tool_calls(text: str) -> ToolOutput:
    """The whole answer's content (stripped; "" when none) and calls."""
    stream = ToolCallStream()
    return stream.feed(text) + stream.finish()


def new_call_id() -> str:
    return "call_" + "".join(secrets.choice(ID_ALPHABET) for _ in range(ID_CHARS))


def parsed_call(block: str) -> ParsedCall | None:
    """The call a block's inside (between the tags) holds; None if it holds none."""
    try:
        call = json.loads(block)
    except (ValueError, RecursionError):
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    if "arguments" not in call:
        return None
    arguments = json.dumps(call["arguments"], ensure_ascii=False, separators=(",", ":"))
    return ParsedCall(id=new_call_id(), name=call["name"], arguments=arguments)


class ToolCallStream:
    """One sample's answer, fed as it streams: `feed` each delta, `finish` at its end."""

    def __init__(self) -> None:
        self._buffer = ""  # text not yet passed on: a possible tag start, or a block
        self._in_block = False
        self._held_space = ""  # whitespace passed on only if more content follows
        self._started = False  # content other than whitespace was passed on
        self.calls_made = 0

    def feed(self, text: str) -> ToolOutput:
        self._buffer += text
        content: list[str] = []
        calls: list[ParsedCall] = []
        while True:
            if self._in_block:
                end = self._buffer.find(TOOL_CALL_CLOSE)
                if end < 0:
                    break
                block, self._buffer = self._buffer[:end], self._buffer[end + len(TOOL_CALL_CLOSE) :]
                self._in_block = False
                call = parsed_call(block)
                if call is None:
                    content.append(TOOL_CALL_OPEN + block + TOOL_CALL_CLOSE)
                else:
                    calls.append(call)
                continue
            start = self._buffer.find(TOOL_CALL_OPEN)
            if start < 0:
                keep = _partial_tag(self._buffer)
                content.append(self._buffer[: len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep :]
                break
            content.append(self._buffer[:start])
            self._buffer = self._buffer[start + len(TOOL_CALL_OPEN) :]
            self._in_block = True
        self.calls_made += len(calls)
        return ToolOutput(self._pass_on("".join(content)), calls)

    def finish(self) -> ToolOutput:
        """The rest: an unfinished block is content, as written; trailing space is dropped."""
        rest = (TOOL_CALL_OPEN if self._in_block else "") + self._buffer
        self._buffer, self._in_block = "", False
        text = self._pass_on(rest)
        self._held_space = ""
        return ToolOutput(text)

    def _pass_on(self, text: str) -> str:
        """``text`` as content: no leading whitespace, trailing whitespace held back."""
        text = self._held_space + text
        if not self._started:
            text = text.lstrip()
        kept = text.rstrip()
        self._held_space = text[len(kept) :]
        self._started = self._started or bool(kept)
        return kept


def _partial_tag(text: str) -> int:
    """The length of the longest end of ``text`` that `<tool_call>` starts with."""
    for length in range(min(len(text), len(TOOL_CALL_OPEN) - 1), 0, -1):
        if TOOL_CALL_OPEN.startswith(text[-length:]):
            return length
    return 0
