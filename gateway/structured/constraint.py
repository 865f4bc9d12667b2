"""A request's constraint on its output, as the worker takes it (`StructuredOutput`): from
`response_format`, vLLM's `structured_outputs` or `guided_*`, or a chat's tools
(`gateway.structured.tool_grammar`), checked (`gateway.structured.grammar_checker`) before any
worker sees it.

| field | format | text |
|---|---|---|
| `response_format` json_object, `structured_outputs.json_object` | json_object | "" |
| `response_format` json_schema, `structured_outputs.json`, `guided_json` | json_schema | schema |
| `structured_outputs.regex`, `guided_regex` | regex | pattern |
| `structured_outputs.choice`, `guided_choice` | choice | JSON list of strings |
| `structured_outputs.grammar`, `guided_grammar` | gbnf | Lark or GBNF |
| `tools` with tool_choice other than "none" | lark | the tool-call grammar |
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from gateway.errors import InvalidRequestError
from gateway.protocol import ChatCompletionRequest, SamplingFields
from gateway.structured.grammar_checker import GrammarChecker
from gateway.structured.protocol import effective_tool_choice
from gateway.structured.tool_grammar import tool_grammar
from rpc import worker_pb2

# What each format is called in messages.
DESCRIPTIONS = {
    "json_schema": "JSON schema",
    "regex": "regex",
    "choice": "choice",
    "gbnf": "grammar",
    "lark": "tool-call grammar",
}


@dataclass(frozen=True, slots=True)
class Constraint:
    """What the output must match: a `StructuredOutput` with the field it came from."""

    format: str
    text: str
    param: str

    def to_proto(self) -> worker_pb2.StructuredOutput:
        return worker_pb2.StructuredOutput(format=self.format, text=self.text)


async def constraint_for(
    body: SamplingFields, *, checker: GrammarChecker, tenant: str
) -> Constraint | None:
    """The request's checked constraint (in ``tenant``'s turn on the checker), or None for
    free text; a 400 naming the field when it is malformed, too large, or a grammar
    llguidance cannot follow."""
    if isinstance(body, ChatCompletionRequest) and body.calls_tools:
        return await _tool_constraint(body, checker=checker, tenant=tenant)
    constraint = requested_constraint(body)
    if constraint is not None and constraint.format != "json_object":
        what = DESCRIPTIONS[constraint.format]
        await checker.check(
            constraint.format, constraint.text, param=constraint.param, what=what, tenant=tenant
        )
    return constraint


def requested_constraint(body: SamplingFields) -> Constraint | None:
    """The constraint the body's output fields ask for (at most one is set: `parse`)."""
    response_format = body.response_format
    if response_format is not None and response_format.type == "json_object":
        return Constraint("json_object", "", "response_format")
    if response_format is not None and response_format.type == "json_schema":
        assert response_format.json_schema is not None  # `parse` checked it
        schema = response_format.json_schema.schema_
        return _schema(schema, "response_format.json_schema.schema")
    extras = body.structured_outputs
    if extras is not None:
        if extras.json_object:
            return Constraint("json_object", "", "structured_outputs.json_object")
        return _constraint(
            schema=extras.json_,
            regex=extras.regex,
            choice=extras.choice,
            grammar=extras.grammar,
            prefix="structured_outputs.",
        )
    return _constraint(
        schema=body.guided_json,
        regex=body.guided_regex,
        choice=body.guided_choice,
        grammar=body.guided_grammar,
        prefix="guided_",
    )


def _constraint(
    *,
    schema: dict[str, Any] | str | None,
    regex: str | None,
    choice: list[str] | None,
    grammar: str | None,
    prefix: str,
) -> Constraint | None:
    if schema is not None:
        return _schema(schema, prefix + "json")
    if regex is not None:
        return Constraint("regex", regex, prefix + "regex")
    if choice is not None:
        if not choice:
            raise InvalidRequestError("choice needs at least one string", param=prefix + "choice")
        return Constraint("choice", _dumps(choice, prefix + "choice"), prefix + "choice")
    if grammar is not None:
        return Constraint("gbnf", grammar, prefix + "grammar")
    return None


def _schema(schema: dict[str, Any] | str, param: str) -> Constraint:
    """A JSON schema given as an object or as JSON text (vLLM takes both), as text."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError) as exc:
            raise InvalidRequestError(f"the JSON schema is not JSON: {exc}", param=param) from exc
    if not isinstance(schema, dict):
        raise InvalidRequestError("a JSON schema must be a JSON object", param=param)
    return Constraint("json_schema", _dumps(schema, param), param)


def _dumps(value: Any, param: str) -> str:
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (ValueError, RecursionError) as exc:
        raise InvalidRequestError(f"cannot be used as given: {exc}", param=param) from exc


async def _tool_constraint(
    body: ChatCompletionRequest, *, checker: GrammarChecker, tenant: str
) -> Constraint:
    """Each tool's parameters checked as a JSON schema (so an error names its tool), then
    the grammar of the answer under tool_choice."""
    tools = body.tools or []
    texts = [
        _dumps(tool.function.parameters_schema, f"tools.{index}.function.parameters")
        for index, tool in enumerate(tools)
    ]
    size = sum(len(text.encode("utf-8", "surrogatepass")) for text in texts)
    if size > checker.limits.max_bytes:  # the grammar holds them all: refused before it is built
        raise InvalidRequestError(
            f"the tools' parameters are {size} bytes of JSON schema; at most "
            f"{checker.limits.max_bytes} are allowed",
            param="tools",
        )
    for index, text in enumerate(texts):
        param = f"tools.{index}.function.parameters"
        await checker.check("json_schema", text, param=param, what="JSON schema", tenant=tenant)
    choice = effective_tool_choice(body.tools, body.tool_choice)
    functions = [tool.function for tool in tools]
    grammar = tool_grammar(functions, choice, parallel=body.parallel_tool_calls)
    assert grammar is not None  # tool_choice is not "none" here
    await checker.check("lark", grammar, param="tools", what=DESCRIPTIONS["lark"], tenant=tenant)
    return Constraint("lark", grammar, "tools")
