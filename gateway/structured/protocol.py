"""The request fields that constrain a completion's output, as pydantic models: OpenAI's
`response_format`, `tools`, `tool_choice` and the messages' tool calls; vLLM's
`structured_outputs` and its older `guided_*` extras.

Shapes are checked here (names, types, counts); what needs a library (is this a JSON schema
llguidance can follow?) is checked by `gateway.structured.constraint` before a worker sees the
request.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from gateway.errors import InvalidRequestError
from gateway.request_model import RequestModel

# OpenAI's rule for function and response-format names.
NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"
MAX_TOOLS = 128  # OpenAI's limit
# A function without `parameters` takes none (OpenAI's meaning).
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


class JsonSchemaFormat(RequestModel):
    """`response_format.json_schema`: the schema the answer must follow."""

    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    # Accepted and ignored: every schema is followed strictly (the grammar allows nothing else).
    strict: bool | None = None


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JsonSchemaFormat | None = None

    def check(self) -> None:
        if self.type == "json_schema" and self.json_schema is None:
            raise InvalidRequestError(
                "response_format of type json_schema needs its json_schema",
                param="response_format.json_schema",
            )


class StructuredOutputsParams(RequestModel):
    """vLLM's `structured_outputs`: exactly one of its constraints."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark or GBNF (llguidance tells them apart)
    json_object: bool | None = None

    def given(self) -> list[str]:
        """The names of the constraints it sets."""
        values = {
            "json": self.json_,
            "regex": self.regex,
            "choice": self.choice,
            "grammar": self.grammar,
            "json_object": self.json_object or None,
        }
        return [name for name, value in values.items() if value is not None]


class FunctionDefinition(RequestModel):
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # accepted; calls always follow `parameters`

    @property
    def parameters_schema(self) -> dict[str, Any]:
        return NO_PARAMETERS if self.parameters is None else self.parameters

    def for_template(self) -> dict[str, Any]:
        """The tool as chat templates take it (transformers' `tools=`: OpenAI's shape)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters_schema
        return {"type": "function", "function": function}


class Tool(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(RequestModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends and returns it


class ToolCall(RequestModel):
    """A call an earlier assistant turn made (in `messages`)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


def effective_tool_choice(tools: list[Tool] | None, choice: ToolChoice | None) -> ToolChoice:
    """OpenAI's default: "auto" with tools, "none" without."""
    if choice is not None:
        return choice
    return "auto" if tools else "none"


def check_tools(
    tools: list[Tool] | None, choice: ToolChoice | None, *, constrained_by: str | None
) -> None:
    """Tool names unique; `tool_choice` names a given tool, or is "none" without tools;
    no other constraint (``constrained_by``: the field that sets one) beside calls."""
    choice = effective_tool_choice(tools, choice)
    names: set[str] = set()
    for index, tool in enumerate(tools or []):
        if tool.function.name in names:
            raise InvalidRequestError(
                f"tool names must be unique; {tool.function.name!r} is given twice",
                param=f"tools.{index}.function.name",
            )
        names.add(tool.function.name)
    if choice == "none":
        return
    if not tools:
        raise InvalidRequestError("tool_choice other than 'none' needs tools", param="tool_choice")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise InvalidRequestError(
            f"tool_choice names {choice.function.name!r}, which is not among the tools",
            param="tool_choice.function.name",
        )
    if constrained_by is not None:
        raise InvalidRequestError(
            f"{constrained_by} cannot be combined with tool calls; set tool_choice to 'none' "
            "or leave the output format out",
            param=constrained_by,
        )
