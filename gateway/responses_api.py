"""OpenAI's Responses API request (`POST /v1/responses`, text only), as a chat completion.

A Responses request is read here and turned into the `ChatCompletionRequest` it means, so it
runs on the one request pipeline (tenancy, quotas, fairness, accounting) as chat does:
`input` (a string, or message items, function calls and their outputs) and `instructions`
become messages; `text.format` becomes `response_format`; function tools and `tool_choice`
become chat's. What the gateway cannot honour is refused by name, never ignored:
`previous_response_id` and `conversation` (responses are not stored), `background`, tools
other than functions, content other than text, reasoning settings and `include`.
The answer is shaped by `gateway.responses_format`.
"""

from __future__ import annotations

import functools
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, ValidationError

from gateway.errors import InvalidRequestError
from gateway.protocol import (
    INT32_MAX,
    MAX_PARSED_MIX,
    AdapterWeight,
    ChatCompletionRequest,
    StreamOptions,
)
from gateway.request_model import MAX_PARSED_ITEMS, RequestModel, at_most

TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
ROLES = frozenset({"user", "system", "developer", "assistant"})
# OpenAI's bounds on metadata: pairs, and characters of each key and value.
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
# Chat's field names → this API's, for errors found in the chat request.
CHAT_NAMES = {
    "messages": "input",
    "response_format": "text.format",
    "max_completion_tokens": "max_output_tokens",
}


class ContentPart(RequestModel):
    type: str
    text: str | None = None


class InputItem(RequestModel):
    """One `input` item: a message, a function call the model made, or its output."""

    type: str = "message"
    role: str | None = None
    content: str | list[ContentPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[ContentPart] | None = None


class ResponsesTool(RequestModel):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FormatConfig(RequestModel):
    type: str = "text"
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(RequestModel):
    format: FormatConfig | None = None


class ResponsesRequest(RequestModel):
    endpoint: ClassVar[str] = "responses"  # the metrics label

    model: str
    input: Annotated[str | list[InputItem], at_most(MAX_PARSED_ITEMS)]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    tools: Annotated[list[ResponsesTool] | None, at_most(MAX_PARSED_ITEMS)] = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    user: str | None = None
    metadata: Annotated[dict[str, str] | None, at_most(MAX_PARSED_ITEMS)] = None
    # Accepted: nothing is stored whatever it says (so nothing can be referred to later).
    store: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=0)
    truncation: Literal["disabled"] | None = None
    # Refused when set (see the module docstring).
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    reasoning: Any = None
    include: list[str] | None = None
    prompt: Any = None
    max_tool_calls: int | None = None
    # Switchboard's, as in chat: a weighted mix of the caller's adapters.
    adapters: Annotated[list[AdapterWeight] | None, at_most(MAX_PARSED_MIX)] = None

    @property
    def include_usage(self) -> bool:
        return True  # `response.completed` carries it

    def check_supported(self) -> None:
        if self.previous_response_id is not None:
            raise InvalidRequestError(
                "previous_response_id is not supported: responses are not stored; send the "
                "whole conversation in input",
                param="previous_response_id",
            )
        refused = {
            "conversation": self.conversation,
            "background": self.background or None,
            "reasoning": self.reasoning,
            "include": self.include or None,
            "prompt": self.prompt,
            "max_tool_calls": self.max_tool_calls,
        }
        for name, value in refused.items():
            if value is not None:
                raise InvalidRequestError(f"{name} is not supported", param=name)
        metadata = self.metadata or {}
        if len(metadata) > MAX_METADATA_PAIRS or any(
            len(k) > MAX_METADATA_KEY or len(v) > MAX_METADATA_VALUE for k, v in metadata.items()
        ):
            raise InvalidRequestError(
                f"metadata holds at most {MAX_METADATA_PAIRS} pairs, keys of at most "
                f"{MAX_METADATA_KEY} characters and values of at most {MAX_METADATA_VALUE}",
                param="metadata",
            )

    @functools.cached_property
    def chat(self) -> ChatCompletionRequest:
        """The chat completion this request means (checked: 400 naming the field)."""
        self.check_supported()
        body: dict[str, Any] = {
            "model": self.model,
            "messages": self._messages(),
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "stream": self.stream,
            "parallel_tool_calls": self.parallel_tool_calls,
            "user": self.user,
        }
        if self.tools:
            body["tools"] = [_tool(tool, i) for i, tool in enumerate(self.tools)]
        if self.tool_choice is not None:
            body["tool_choice"] = _tool_choice(self.tool_choice)
        if self.text is not None and self.text.format is not None:
            body["response_format"] = _response_format(self.text.format)
        if self.adapters is not None:
            body["adapters"] = [a.model_dump() for a in self.adapters]
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as exc:
            error = exc.errors()[0]
            loc = [str(part) for part in error["loc"]]
            loc[:1] = CHAT_NAMES.get(loc[0], loc[0]).split(".") if loc else []
            param = ".".join(loc)
            raise InvalidRequestError(f"{param}: {error['msg']}", param=param) from exc

    def _messages(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return [*messages, {"role": "user", "content": self.input}]
        for index, item in enumerate(self.input):
            _add_item(messages, item, f"input.{index}")
        return messages


def _add_item(messages: list[dict[str, Any]], item: InputItem, param: str) -> None:
    if item.type == "message":
        if item.role not in ROLES:
            raise InvalidRequestError(f"role {item.role!r} is not supported", param=f"{param}.role")
        messages.append({"role": item.role, "content": _text(item.content, f"{param}.content")})
    elif item.type == "function_call":
        if not (item.call_id and item.name and item.arguments is not None):
            raise InvalidRequestError(
                "a function_call item needs call_id, name and arguments", param=param
            )
        call = {"id": item.call_id, "function": {"name": item.name, "arguments": item.arguments}}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant" and "tool_calls" in last:
            last["tool_calls"].append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif item.type == "function_call_output":
        if not item.call_id:
            raise InvalidRequestError("a function_call_output item needs its call_id", param=param)
        output = _text(item.output, f"{param}.output")
        messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
    else:
        raise InvalidRequestError(
            f"input item type {item.type[:64]!r} is not supported (messages, function_call and "
            "function_call_output only)",
            param=f"{param}.type",
        )


def _text(content: str | list[ContentPart] | None, param: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    for index, part in enumerate(content):
        if part.type not in TEXT_PARTS or part.text is None:
            raise InvalidRequestError(
                f"content part type {part.type[:64]!r} is not supported (text only)",
                param=f"{param}.{index}",
            )
    return "".join(part.text or "" for part in content)


def _tool(tool: ResponsesTool, index: int) -> dict[str, Any]:
    if tool.type != "function":
        raise InvalidRequestError(
            f"tool type {tool.type[:64]!r} is not supported (function tools only)",
            param=f"tools.{index}.type",
        )
    if tool.name is None:
        raise InvalidRequestError("a function tool needs a name", param=f"tools.{index}.name")
    function = {"name": tool.name, "description": tool.description, "parameters": tool.parameters}
    return {"type": "function", "function": function}


def _tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise InvalidRequestError(
            "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name'}",
            param="tool_choice",
        )
    return {"type": "function", "function": {"name": choice["name"]}}


def _response_format(fmt: FormatConfig) -> dict[str, Any]:
    if fmt.type != "json_schema":
        return {"type": fmt.type}
    if fmt.schema_ is None:
        raise InvalidRequestError("a json_schema format needs its schema", param="text.format")
    schema = {"name": fmt.name or "response", "schema": fmt.schema_}
    if fmt.description is not None:
        schema["description"] = fmt.description
    return {"type": "json_schema", "json_schema": schema}
