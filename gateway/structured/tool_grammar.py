"""The grammar a chat answer with tools must follow (llguidance's Lark dialect, which embeds
JSON schemas with `%json`), in the Hermes format the answer is parsed back from:

    <tool_call>
    {"name": <function name>, "arguments": <arguments, a JSON object>}
    </tool_call>

- "required": one or more such blocks, one per line (exactly one without parallel calls);
- a named function: exactly one block, of that function;
- "auto": free text in which every `<tool_call>` must open a valid block (llguidance's
  `StructTag`: a lazy lexeme ends the text at the trigger), so the model chooses between
  answering and calling; without parallel calls, at most one block and nothing after it.
  `<tool_call>` is plain text here (`assume_special=False`): the default model's tokenizer
  has no such special token.

Each call's schema is an `anyOf` of `{"name": {"const": f}, "arguments": parameters of f}`
(both required, nothing else), written as `json.dumps` writes JSON (`JSON_STYLE`), so a model
cannot pad a call with whitespace forever.
"""

from __future__ import annotations

import json
from typing import Any

from llguidance import StructTag

from gateway.structured.protocol import FunctionDefinition, NamedToolChoice, ToolChoice
from runtime.grammar_bounds import JSON_STYLE

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
# The embedded %json schemas get the worker's JSON style (JSON_STYLE) as their own
# llguidance options ("x-guidance"): they do not get the worker's defaults.
# Keywords whose values are JSON data, not schemas: a "$ref" key in them is not a reference.
DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
# Free text that holds no `<tool_call>` (what may stand before the one call, or alone).
TEXT_WITHOUT_CALL = r"/(.|\n)*/ & ~/(.|\n)*<tool_call>(.|\n)*/"


def tool_grammar(
    functions: list[FunctionDefinition], choice: ToolChoice, *, parallel: bool
) -> str | None:
    """The Lark grammar of an answer under ``choice``; None for "none" (free text)."""
    if choice == "none":
        return None
    if isinstance(choice, NamedToolChoice):
        named = [f for f in functions if f.name == choice.function.name]
        return _calls_only(call_schema(named), parallel=False)
    schema = call_schema(functions)
    if choice == "required":
        return _calls_only(schema, parallel=parallel)
    if parallel:
        tag = StructTag(
            trigger=TOOL_CALL_OPEN,
            begin=TOOL_CALL_OPEN + "\n",
            grammar=schema,
            end="\n" + TOOL_CALL_CLOSE,
        )
        return StructTag.to_grammar([tag], assume_special=False)
    return "\n".join(
        [
            "%llguidance {}",
            "start: call? tail",
            "tail: TEXT",
            "TEXT: " + TEXT_WITHOUT_CALL,
            r"ANY_TEXT: /(.|\n)*/",
            f"call_trigger[lazy]: ANY_TEXT {json.dumps(TOOL_CALL_OPEN)}",
            f"call: call_trigger {_block_rest(schema)}",
            "",
        ]
    )


def call_schema(functions: list[FunctionDefinition]) -> dict[str, Any]:
    """The JSON schema of one call of any of ``functions``. `$ref`s inside a function's
    parameters are re-rooted, as its parameters now sit inside this schema."""
    options = []
    for index, function in enumerate(functions):
        at = (
            f"/anyOf/{index}/properties/arguments"
            if len(functions) > 1
            else "/properties/arguments"
        )
        options.append(
            {
                "type": "object",
                "properties": {
                    "name": {"const": function.name},
                    "arguments": rerooted(function.parameters_schema, at),
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "x-guidance": JSON_STYLE}


def rerooted(schema: Any, at: str) -> Any:
    """``schema`` with each local `$ref` ("#…") pointing below the JSON pointer ``at``
    (values that are data, not schemas, are left as they are)."""
    if isinstance(schema, list):
        return [rerooted(item, at) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = "#" + at + value[1:]
        elif key in DATA_KEYWORDS:
            out[key] = value
        else:
            out[key] = rerooted(value, at)
    return out


def _block_rest(schema: dict[str, Any]) -> str:
    """What follows `<tool_call>` in a block, in Lark."""
    return f'"\\n" %json {json.dumps(schema)} {json.dumps(chr(10) + TOOL_CALL_CLOSE)}'


def _calls_only(schema: dict[str, Any], *, parallel: bool) -> str:
    start = 'start: call ("\\n" call)*' if parallel else "start: call"
    return "\n".join(
        [
            "%llguidance {}",
            start,
            f"call: {json.dumps(TOOL_CALL_OPEN)} {_block_rest(schema)}",
            "",
        ]
    )
