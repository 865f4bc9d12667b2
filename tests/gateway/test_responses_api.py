"""A Responses request as the chat completion it means, and what it refuses by name."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.errors import InvalidRequestError
from gateway.responses_api import ResponsesRequest

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}}


def request(**fields: Any) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "m", "input": "hi", **fields})


def messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    return [m.model_dump(exclude_none=True) for m in req.chat.messages]


def test_a_string_input_with_instructions_is_a_system_then_a_user_message():
    req = request(instructions="Be brief.", max_output_tokens=7, temperature=0.5)
    assert messages(req) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
    ]
    assert req.chat.max_completion_tokens == 7 and req.chat.temperature == 0.5


def test_items_with_calls_and_outputs_become_a_chat_turn_by_turn():
    req = request(
        input=[
            {"role": "developer", "content": [{"type": "input_text", "text": "rules"}]},
            {"type": "message", "role": "user", "content": "weather?"},
            {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "w", "arguments": '{"a":1}'},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {
                "type": "function_call_output",
                "call_id": "c2",
                "output": [{"type": "input_text", "text": "rain"}],
            },
            {"role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]},
        ]
    )
    got = messages(req)
    roles = ["developer", "user", "assistant", "tool", "tool", "assistant"]
    assert [m["role"] for m in got] == roles
    assert [c["id"] for c in got[2]["tool_calls"]] == ["c1", "c2"]  # one assistant turn
    assert got[3] == {"role": "tool", "content": "sunny", "tool_call_id": "c1"}
    assert got[4]["content"] == "rain" and got[5]["content"] == "Sunny."


def test_function_tools_tool_choice_and_text_format_are_chats():
    req = request(
        tools=[{"type": "function", "name": "w", "parameters": WEATHER, "strict": True}],
        tool_choice={"type": "function", "name": "w"},
        parallel_tool_calls=False,
        text={"format": {"type": "json_schema", "name": "x", "schema": WEATHER}},
    )
    chat = req.chat
    assert chat.tools[0].function.name == "w" and chat.tools[0].function.parameters == WEATHER
    assert chat.tool_choice.function.name == "w" and chat.parallel_tool_calls is False
    assert chat.response_format.json_schema.schema_ == WEATHER


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"background": True}, "background"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"tools": [{"type": "function"}]}, "tools.0.name"),
        ({"tools": [{"type": "function", "name": "bad name!"}]}, "tools.0.function.name"),
        ({"tool_choice": {"type": "web_search"}}, "tool_choice"),
        ({"input": [{"type": "reasoning"}]}, "input.0.type"),
        ({"input": [{"role": "critic", "content": "x"}]}, "input.0.role"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input.0.content.0"),
        ({"input": [{"type": "function_call", "name": "w"}]}, "input.0"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input.0"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"metadata": {"k": "v" * 513}}, "metadata"),
    ],
)
def test_what_it_cannot_honour_is_refused_by_name(fields, param):
    with pytest.raises(InvalidRequestError) as caught:
        request(**fields).chat  # noqa: B018
    assert caught.value.param == param
