"""`null` for an optional field means its default, in every request model (OpenAI's rule; the
SDK sends `None` as `null`): each optional field of each model, walked one at a time; a
required field stays required."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ValidationError

from gateway import protocol, responses_api, template_switches
from gateway.batch import routes as batch_routes
from gateway.request_model import RequestModel
from gateway.structured import protocol as structured

# The smallest valid body of each request model; every RequestModel must be listed here.
MINIMAL: dict[type[BaseModel], dict] = {
    protocol.CompletionRequest: {"model": "m", "prompt": "hi"},
    protocol.ChatCompletionRequest: {"model": "m", "messages": [{"role": "user"}]},
    protocol.StreamOptions: {},
    protocol.AdapterWeight: {"name": "a", "weight": 0.5},
    protocol.TextPart: {"type": "text"},
    protocol.ChatMessage: {"role": "user"},
    template_switches.ChatTemplateKwargs: {},
    structured.JsonSchemaFormat: {"name": "n", "schema": {}},
    structured.ResponseFormat: {},
    structured.StructuredOutputsParams: {},
    structured.FunctionDefinition: {"name": "f"},
    structured.Tool: {"type": "function", "function": {"name": "f"}},
    structured.NamedFunction: {"name": "f"},
    structured.NamedToolChoice: {"type": "function", "function": {"name": "f"}},
    structured.FunctionCall: {"name": "f", "arguments": "{}"},
    structured.ToolCall: {"id": "c", "function": {"name": "f", "arguments": "{}"}},
    responses_api.ResponsesRequest: {"model": "m", "input": "hi"},
    responses_api.ContentPart: {"type": "input_text"},
    responses_api.InputItem: {},
    responses_api.ResponsesTool: {"type": "function"},
    responses_api.FormatConfig: {},
    responses_api.TextConfig: {},
    batch_routes.CreateBatch: {
        "input_file_id": "file-1",
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
    },
    batch_routes.ExpiresAfter: {"anchor": "created_at", "seconds": 3600},
}


def request_models() -> list[type[BaseModel]]:
    """Every subclass of RequestModel, however deep (in the modules imported above)."""
    found, todo = [], [RequestModel]
    while todo:
        for sub in todo.pop().__subclasses__():
            found.append(sub)
            todo.append(sub)
    return found


def optional_fields() -> list[tuple[type[BaseModel], str]]:
    return [
        (model, info.alias or name)
        for model in MINIMAL
        for name, info in model.model_fields.items()
        if not info.is_required()
    ]


def required_fields() -> list[tuple[type[BaseModel], str]]:
    return [
        (model, info.alias or name)
        for model in MINIMAL
        for name, info in model.model_fields.items()
        if info.is_required()
    ]


def test_every_request_model_is_walked():
    abstract = {protocol.SamplingFields}  # shared fields: walked through both endpoints
    assert set(request_models()) - abstract == set(MINIMAL)


@pytest.mark.parametrize(
    ("model", "key"), optional_fields(), ids=lambda v: getattr(v, "__name__", v)
)
def test_null_for_an_optional_field_is_its_default(model, key):
    default = model.model_validate(MINIMAL[model])
    nulled = model.model_validate({**MINIMAL[model], key: None})
    assert nulled.model_dump() == default.model_dump()


@pytest.mark.parametrize(
    ("model", "key"), required_fields(), ids=lambda v: getattr(v, "__name__", v)
)
def test_null_for_a_required_field_is_refused(model, key):
    with pytest.raises(ValidationError):
        model.model_validate({**MINIMAL[model], key: None})


def test_null_inside_nested_parts_is_their_default():
    body = protocol.ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [{"role": "user", "content": [{"type": "text", "text": None}]}],
            "stream": True,
            "stream_options": {"include_usage": None},
            "response_format": {"type": None},
            "tools": [{"type": "function", "function": {"name": "f", "parameters": None}}],
        }
    )
    assert body.messages[0].content[0].text is None
    assert body.stream_options.include_usage is False
    assert body.response_format.type == "text"
    assert body.tools[0].function.parameters_schema == structured.NO_PARAMETERS
