"""Invalid Unicode anywhere in a body is a 400 naming the field, found once at the edge."""

from __future__ import annotations

import json

import pytest

from gateway.errors import InvalidRequestError
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.responses_api import ResponsesRequest
from gateway.text_check import check_text

TOOL = {
    "type": "function",
    "function": {"name": "f", "description": "d", "parameters": {"type": "object"}},
}
CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
LONE = "\ud800"

# (endpoint model, body with one lone surrogate, the field named)
CASES = {
    "prompt": (CompletionRequest, {"model": "m", "prompt": f"a{LONE}b"}, "prompt"),
    "model": (CompletionRequest, {"model": f"m{LONE}", "prompt": "x"}, "model"),
    "stop": (CompletionRequest, {"model": "m", "prompt": "x", "stop": ["ok", LONE]}, "stop.1"),
    "schema key": (
        CompletionRequest,
        {"model": "m", "prompt": "x", "guided_json": {"properties": {LONE: {}}}},
        "guided_json.properties",
    ),
    "schema value": (
        CompletionRequest,
        {"model": "m", "prompt": "x", "structured_outputs": {"json": {"title": LONE}}},
        "structured_outputs.json.title",
    ),
    "message": (
        ChatCompletionRequest,
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": LONE}],
        },
        "messages.1.content",
    ),
    "content part": (
        ChatCompletionRequest,
        {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": LONE}]}]},
        "messages.0.content.0.text",
    ),
    "tool description": (
        ChatCompletionRequest,
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [{**TOOL, "function": {**TOOL["function"], "description": LONE}}],
        },
        "tools.0.function.description",
    ),
    "tool_call_id": (
        ChatCompletionRequest,
        {
            "model": "m",
            "messages": [
                {"role": "assistant", "tool_calls": [CALL]},
                {"role": "tool", "content": "18 C", "tool_call_id": f"call_1{LONE}"},
            ],
        },
        "messages.1.tool_call_id",
    ),
    "responses input": (
        ResponsesRequest,
        {"model": "m", "input": [{"role": "user", "content": f"x{LONE}"}]},
        "input.0.content",
    ),
}


@pytest.mark.parametrize("model, body, param", CASES.values(), ids=CASES.keys())
@pytest.mark.parametrize("wire", ["escaped", "raw_bytes"])
def test_a_lone_surrogate_is_refused_naming_its_field(model, body, param, wire):
    raw = json.dumps(body).encode()  # escaped: "\ud800"
    if wire == "raw_bytes":  # the same code point as the bytes ED A0 80
        raw = json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass")
    parsed = model.model_validate(json.loads(raw))
    with pytest.raises(InvalidRequestError) as refused:
        check_text(parsed, raw)
    assert refused.value.param == param
    assert "not valid Unicode" in refused.value.message


def test_valid_text_passes_however_it_is_written():
    body = {"model": "m", "prompt": "caf\u00e9 \U0001f600 \\ud800 as text", "stop": ["\u00e9"]}
    for raw in (json.dumps(body).encode(), json.dumps(body, ensure_ascii=False).encode()):
        check_text(CompletionRequest.model_validate(json.loads(raw)), raw)


def test_a_body_without_escapes_is_not_walked():
    body = CompletionRequest.model_validate({"model": "m", "prompt": LONE})
    check_text(body, b'{"model": "m", "prompt": "plain"}')  # the bytes say: nothing to find
    with pytest.raises(InvalidRequestError):
        check_text(body)  # no bytes: walked
