"""The parse stage (`gateway.parsing.parse`): a validated OpenAI body → one `ParsedRequest`.

What it settles between the endpoints (id prefix, max_tokens and its default, the top
logprobs the worker reports, best_of), and what it refuses before any lookup: fields the
gateway cannot honour and shapes past the settings' bounds, each a 400 naming its field.
"""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from gateway.errors import InvalidRequestError
from gateway.parsing import ParsedRequest, parse
from gateway.protocol import ChatCompletionRequest, CompletionRequest, ShapeLimits
from gateway.responses_api import ResponsesRequest

MODEL = "tiny-chat"
USER = [{"role": "user", "content": "Hi"}]
# Small bounds, so a test sits right at them.
LIMITS = ShapeLimits(
    max_stop_strings=2, max_stop_string_chars=4, max_stop_token_ids=3, max_chat_messages=2
)
WEATHER = {"type": "function", "function": {"name": "get_weather"}}


def completion(**fields: Any) -> CompletionRequest:
    """A /v1/completions body as the route validates it from JSON."""
    return CompletionRequest.model_validate({"model": MODEL, "prompt": "Hi", **fields})


def chat(**fields: Any) -> ChatCompletionRequest:
    """A /v1/chat/completions body as the route validates it from JSON."""
    return ChatCompletionRequest.model_validate({"model": MODEL, "messages": USER, **fields})


def refusal(body: CompletionRequest | ChatCompletionRequest) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as caught:
        parse(body, limits=LIMITS)
    assert caught.value.status == 400
    return caught.value


def assert_refused(body, *, param: str, message: str) -> None:
    error = refusal(body)
    assert (error.param, error.message) == (param, message)


# --- what each endpoint settles ------------------------------------------------------------------


def test_completion_defaults_to_16_tokens_and_no_logprobs():
    body = completion()
    assert parse(body, limits=LIMITS) == ParsedRequest(
        body=body,
        id_prefix="cmpl",
        prompt_param="prompt",
        max_tokens=None,
        default_max_tokens=16,
        logprobs=None,
        best_of=None,
    )


def test_chat_defaults_to_the_rest_of_the_context_and_no_logprobs():
    body = chat()
    assert parse(body, limits=LIMITS) == ParsedRequest(
        body=body,
        id_prefix="chatcmpl",
        prompt_param="messages",
        max_tokens=None,
        default_max_tokens=None,
        logprobs=None,
        best_of=None,
    )


def test_an_explicit_max_tokens_is_kept_beside_the_default():
    parsed = parse(completion(max_tokens=7), limits=LIMITS)
    assert (parsed.max_tokens, parsed.default_max_tokens) == (7, 16)
    parsed = parse(chat(max_tokens=7), limits=LIMITS)
    assert (parsed.max_tokens, parsed.default_max_tokens) == (7, None)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"max_completion_tokens": 5}, 5),
        ({"max_tokens": 9}, 9),
        ({"max_completion_tokens": 5, "max_tokens": 9}, 5),  # the newer name wins
    ],
)
def test_chat_max_completion_tokens_is_its_max_tokens(fields, expected):
    assert parse(chat(**fields), limits=LIMITS).max_tokens == expected


@pytest.mark.parametrize(("asked", "reported"), [(None, None), (0, 0), (3, 3), (20, 20)])
def test_completion_logprobs_is_the_count_of_top_logprobs(asked, reported):
    assert parse(completion(logprobs=asked), limits=LIMITS).logprobs == reported


@pytest.mark.parametrize(
    ("fields", "reported"),
    [
        ({}, None),
        ({"logprobs": False}, None),
        ({"logprobs": True}, 0),  # the chosen token's logprob, no alternatives
        ({"logprobs": True, "top_logprobs": 0}, 0),
        ({"logprobs": True, "top_logprobs": 4}, 4),
        ({"logprobs": False, "top_logprobs": 0}, None),  # 0 alternatives asks for nothing
    ],
)
def test_chat_logprobs_and_top_logprobs(fields, reported):
    assert parse(chat(**fields), limits=LIMITS).logprobs == reported


def test_chat_top_logprobs_without_logprobs_is_refused():
    assert_refused(
        chat(top_logprobs=3),
        param="top_logprobs",
        message="top_logprobs requires logprobs to be true",
    )


# --- best_of -------------------------------------------------------------------------------------


def test_best_of_generates_more_samples_and_forces_logprobs():
    """best_of ranks samples by cumulative logprob, so the worker must report them (0 top)."""
    parsed = parse(completion(n=2, best_of=5), limits=LIMITS)
    assert (parsed.best_of, parsed.samples, parsed.logprobs) == (5, 5, 0)


def test_best_of_keeps_the_logprobs_the_client_asked_for():
    parsed = parse(completion(n=1, best_of=3, logprobs=2), limits=LIMITS)
    assert (parsed.best_of, parsed.samples, parsed.logprobs) == (3, 3, 2)


@pytest.mark.parametrize(("n", "best_of"), [(1, None), (1, 1), (3, 3), (3, None)])
def test_best_of_equal_to_n_is_plain_sampling(n, best_of):
    parsed = parse(completion(n=n, best_of=best_of), limits=LIMITS)
    assert (parsed.best_of, parsed.samples, parsed.logprobs) == (None, n, None)


def test_best_of_below_n_is_refused():
    assert_refused(
        completion(n=3, best_of=2), param="best_of", message="best_of must be at least n"
    )


def test_best_of_cannot_stream():
    assert_refused(
        completion(n=1, best_of=2, stream=True),
        param="best_of",
        message="best_of cannot be used with stream",
    )


def test_best_of_equal_to_n_may_stream():
    parsed = parse(completion(n=2, best_of=2, stream=True), limits=LIMITS)
    assert (parsed.best_of, parsed.samples) == (None, 2)


def test_chat_samples_are_n():
    assert parse(chat(n=4), limits=LIMITS).samples == 4


# --- fields the gateway cannot honour ------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        (
            {"max_tokens": 0},
            "max_tokens",
            "max_tokens may be 0 only with echo or prompt_logprobs (to score the prompt)",
        ),
        ({"suffix": "!"}, "suffix", "suffix is not supported"),
        (
            {"stream_options": {"include_usage": True}},
            "stream_options",
            "stream_options is only allowed when stream is true",
        ),
    ],
)
def test_completion_fields_it_cannot_honour_are_refused(fields, param, message):
    assert_refused(completion(**fields), param=param, message=message)


def test_an_empty_suffix_and_echo_false_are_accepted():
    assert parse(completion(suffix="", echo=False), limits=LIMITS).id_prefix == "cmpl"


@pytest.mark.parametrize(
    ("fields", "scored"),
    [
        ({}, None),
        ({"echo": True}, None),  # the prompt's text only
        ({"echo": True, "logprobs": 3}, 3),
        ({"logprobs": 3}, None),  # the completion's tokens only
        ({"echo": True, "logprobs": 2, "prompt_logprobs": 5}, 5),
        ({"prompt_logprobs": 0}, 0),
        ({"echo": True, "max_tokens": 0}, 0),  # scoring alone: the worker needs the pass
    ],
)
def test_the_prompt_is_scored_when_its_logprobs_are_shown(fields, scored):
    assert parse(completion(**fields), limits=LIMITS).prompt_logprobs == scored


@pytest.mark.parametrize("legacy", ["functions", "function_call"])
def test_chat_legacy_functions_are_refused_with_a_pointer_to_tools(legacy):
    value = [{"name": "f"}] if legacy == "functions" else "auto"
    assert_refused(
        chat(**{legacy: value}),
        param=legacy,
        message=f"{legacy} is not supported; send tools and tool_choice",
    )


def test_chat_stream_options_need_stream():
    assert_refused(
        chat(stream_options={"include_usage": True}),
        param="stream_options",
        message="stream_options is only allowed when stream is true",
    )


def test_stream_options_with_stream_are_accepted():
    parsed = parse(chat(stream=True, stream_options={"include_usage": True}), limits=LIMITS)
    assert parsed.body.include_usage


# --- logit_bias ----------------------------------------------------------------------------------


def test_logit_bias_at_its_bounds_is_accepted():
    bias = {str(i): 100.0 if i % 2 else -100.0 for i in range(300)}
    assert parse(completion(logit_bias=bias), limits=LIMITS).body.logit_bias == bias


@pytest.mark.parametrize(
    ("bias", "message"),
    [
        (
            {str(i): 1.0 for i in range(301)},
            "logit_bias may have at most 300 entries, got 301",
        ),
        ({"-1": 1.0}, "logit_bias keys must be token ids in decimal, got '-1'"),
        ({"abc": 1.0}, "logit_bias keys must be token ids in decimal, got 'abc'"),
        ({"12345678901": 1.0}, "logit_bias keys must be token ids in decimal, got '12345678901'"),
        ({"5": 100.5}, "logit_bias values must be in [-100, 100], got 100.5 for token 5"),
        ({"5": -101.0}, "logit_bias values must be in [-100, 100], got -101.0 for token 5"),
    ],
)
def test_logit_bias_past_openai_bounds_is_refused(bias, message):
    assert_refused(completion(logit_bias=bias), param="logit_bias", message=message)
    assert_refused(chat(logit_bias=bias), param="logit_bias", message=message)


# --- constraints on the output -------------------------------------------------------------------


def test_two_constraints_are_refused_naming_the_second():
    assert_refused(
        completion(response_format={"type": "json_object"}, guided_regex="[a-z]+"),
        param="guided_regex",
        message="at most one constraint on the output per request; this one sets "
        "response_format and guided_regex",
    )


def test_a_text_response_format_is_no_constraint():
    parsed = parse(completion(response_format={"type": "text"}, guided_regex="a"), limits=LIMITS)
    assert parsed.body.constrained_by == ["guided_regex"]


def test_json_schema_response_format_needs_its_schema():
    assert_refused(
        chat(response_format={"type": "json_schema"}),
        param="response_format.json_schema",
        message="response_format of type json_schema needs its json_schema",
    )


@pytest.mark.parametrize(
    ("outputs", "sets"),
    [({}, "none"), ({"regex": "a", "choice": ["x"]}, "regex, choice")],
)
def test_structured_outputs_sets_exactly_one_constraint(outputs, sets):
    assert_refused(
        completion(structured_outputs=outputs),
        param="structured_outputs",
        message="structured_outputs must set exactly one of json, regex, choice, grammar "
        f"and json_object; it sets {sets}",
    )


def test_a_constraint_beside_tool_calls_is_refused():
    assert_refused(
        chat(tools=[WEATHER], response_format={"type": "json_object"}),
        param="response_format",
        message="response_format cannot be combined with tool calls; set tool_choice to "
        "'none' or leave the output format out",
    )


def test_a_constraint_beside_tools_that_may_not_be_called_is_accepted():
    parsed = parse(
        chat(tools=[WEATHER], tool_choice="none", response_format={"type": "json_object"}),
        limits=LIMITS,
    )
    assert not parsed.body.calls_tools


def test_tool_choice_must_name_a_given_tool():
    assert_refused(
        chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "other"}}),
        param="tool_choice.function.name",
        message="tool_choice names 'other', which is not among the tools",
    )


def test_tool_choice_without_tools_is_refused():
    assert_refused(
        chat(tool_choice="required"),
        param="tool_choice",
        message="tool_choice other than 'none' needs tools",
    )


def test_tool_names_are_unique():
    assert_refused(
        chat(tools=[WEATHER, WEATHER]),
        param="tools.1.function.name",
        message="tool names must be unique; 'get_weather' is given twice",
    )


def test_tool_messages_name_the_call_they_answer():
    messages = [*USER, {"role": "tool", "content": "18 C"}]
    assert_refused(
        chat(messages=messages),
        param="messages.1.tool_call_id",
        message="a tool message needs the tool_call_id it answers",
    )


def test_only_assistant_messages_carry_tool_calls():
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [{"role": "user", "content": "Hi", "tool_calls": [call]}]
    assert_refused(
        chat(messages=messages),
        param="messages.0.tool_calls",
        message="only assistant messages carry tool_calls",
    )


# --- shapes past the settings' bounds ------------------------------------------------------------


@pytest.mark.parametrize("make", [completion, chat])
def test_stop_strings_at_their_bounds_are_accepted(make):
    parsed = parse(make(stop=["abcd", "wxyz"], stop_token_ids=[1, 2, 3]), limits=LIMITS)
    assert parsed.body.stop_strings == ["abcd", "wxyz"]


@pytest.mark.parametrize("make", [completion, chat])
@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"stop": ["a", "b", "c"]}, "stop", "at most 2 stop strings are allowed, got 3"),
        ({"stop": "abcde"}, "stop", "a stop string may have at most 4 characters"),
        ({"stop": ["a", "abcde"]}, "stop", "a stop string may have at most 4 characters"),
        (
            {"stop_token_ids": [1, 2, 3, 4]},
            "stop_token_ids",
            "at most 3 stop_token_ids are allowed, got 4",
        ),
    ],
)
def test_stop_shapes_past_their_bounds_are_refused(make, fields, param, message):
    assert_refused(make(**fields), param=param, message=message)


def test_chat_messages_past_their_bound_are_refused():
    assert parse(chat(messages=USER * 2), limits=LIMITS).body.messages[1].content == "Hi"
    assert_refused(
        chat(messages=USER * 3), param="messages", message="at most 2 messages are allowed, got 3"
    )


def test_what_cannot_be_honoured_is_named_before_a_shape():
    """`check_supported` runs first: a body with both faults names the unsupported field."""
    error = refusal(completion(suffix="!", stop=["a", "b", "c"]))
    assert error.param == "suffix"


def test_a_tool_message_answers_an_earlier_call():
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    asked = {"role": "assistant", "content": None, "tool_calls": [call]}
    answer = {"role": "tool", "content": "18 C", "tool_call_id": "call_1"}
    parse(chat(messages=[asked, answer]), limits=LIMITS)
    for messages, index in (
        ([{**answer, "tool_call_id": "call_2"}, asked], 0),  # no call before it
        ([asked, {**answer, "tool_call_id": "call_2"}], 1),  # no call of that id
    ):
        assert_refused(
            chat(messages=messages),
            param=f"messages.{index}.tool_call_id",
            message="messages with role 'tool' must be a response to a preceding message "
            "with 'tool_calls'; no earlier tool call has the id 'call_2'",
        )


@pytest.mark.parametrize(
    "model, field, body",
    [
        (ChatCompletionRequest, "messages", {"messages": [{"role": "user", "content": "hi"}]}),
        (ResponsesRequest, "input", {"input": [{"role": "user", "content": "hi"}]}),
    ],
)
def test_a_list_past_the_parsed_bound_is_refused_by_its_length(model, field, body):
    """Refused before its items are validated (on the event loop: 100,000 messages held it
    for seconds), naming the field."""
    many = {"model": "m", field: body[field] * 100_000}
    with pytest.raises(ValidationError) as refused:
        model.model_validate(many)
    (error,) = refused.value.errors()
    assert error["loc"] == (field,) and "at most 4096 items" in error["msg"]
