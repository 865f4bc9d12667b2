"""Structured outputs, logit_bias and tool calls in the gateway: what reaches the worker,
what is refused before it does (400 naming the field, the worker never called), and how
answers holding tool calls come back, through the official `openai` client, a real uvicorn
gateway, real Redis and a `ScriptedWorker` that streams a scripted answer."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from tokenizers import Tokenizer

from gateway import metrics
from gateway.structured.grammar_checker import GrammarChecker, GrammarLimits
from gateway.structured.grammar_child import CRASHED
from gateway_support import MODEL_NAME, assert_error, gateway_settings, gateway_with_worker

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "maxLength": 8}},
    "required": ["answer"],
    "additionalProperties": False,
}
USER = [{"role": "user", "content": "hi"}]


def deep_ref_chain(depth: int) -> dict:
    """A schema whose `$ref`s chain `depth` deep: llguidance's compiler recurses once per
    link and overflows its stack (SIGSEGV) after a few thousand."""
    defs = {
        f"d{i}": {"type": "array", "items": {"$ref": f"#/$defs/d{i + 1}"}} for i in range(depth)
    }
    defs[f"d{depth}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


@pytest.fixture
async def live(redis_url, redis_prefix, model_dir, tmp_path):
    settings = gateway_settings(
        redis_url=redis_url,
        prefix=redis_prefix,
        model_dir=model_dir,
        store=tmp_path / "store",
        max_model_len=4096,  # the tools' system prompt is long in the test tokenizer's tokens
    )
    async with gateway_with_worker(settings) as live:
        yield live


def client_of(live) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"{live.gw.url}/v1", api_key=live.keys["acme"], max_retries=0
    )


def http_of(live) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {live.keys['acme']}"}
    return httpx.AsyncClient(base_url=live.gw.url, headers=headers, timeout=30)


# --- what reaches the worker -----------------------------------------------------------

FORWARDED = {
    "json_schema": (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "a", "schema": SCHEMA},
            }
        },
        "json_schema",
        json.dumps(SCHEMA, ensure_ascii=False),
    ),
    "json_object": ({"response_format": {"type": "json_object"}}, "json_object", ""),
    "structured_outputs.regex": (
        {"structured_outputs": {"regex": "[a-z]{3}"}},
        "regex",
        "[a-z]{3}",
    ),
    "structured_outputs.choice": (
        {"structured_outputs": {"choice": ["yes", "no"]}},
        "choice",
        '["yes", "no"]',
    ),
    "structured_outputs.grammar": (
        {"structured_outputs": {"grammar": 'root ::= "a" | "b"'}},
        "gbnf",
        'root ::= "a" | "b"',
    ),
    "guided_json as text": (
        {"guided_json": json.dumps(SCHEMA)},
        "json_schema",
        json.dumps(SCHEMA, ensure_ascii=False),
    ),
    "guided_choice": ({"guided_choice": ["x"]}, "choice", '["x"]'),
}


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("fields, fmt, text", FORWARDED.values(), ids=FORWARDED.keys())
async def test_the_constraint_reaches_the_worker(live, endpoint, fields, fmt, text):
    body = {"model": MODEL_NAME, "max_tokens": 4, **fields}
    body.update({"messages": USER} if endpoint == "chat" else {"prompt": "hi"})
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    async with http_of(live) as http:
        response = await http.post(path, json=body)
    assert response.status_code == 200, response.text
    sent = live.worker.requests[-1].params
    assert (sent.structured_output.format, sent.structured_output.text) == (fmt, text)


async def test_logit_bias_reaches_the_worker_and_free_text_has_no_constraint(live):
    async with client_of(live) as client:
        await client.chat.completions.create(
            model=MODEL_NAME, messages=USER, logit_bias={"5": -100, "17": 2.5}
        )
    sent = live.worker.requests[-1].params
    assert dict(sent.logit_bias) == {5: -100.0, 17: 2.5}
    assert not sent.HasField("structured_output")


async def test_the_clients_own_parse_sends_its_models_schema(live):
    from pydantic import BaseModel

    class Answer(BaseModel):
        answer: str

    live.worker.pieces = ('{"answer": ', '"Paris"', "}")
    async with client_of(live) as client:
        out = await client.chat.completions.parse(
            model=MODEL_NAME, messages=USER, response_format=Answer
        )
    assert out.choices[0].message.parsed == Answer(answer="Paris")
    sent = live.worker.requests[-1].params.structured_output
    assert sent.format == "json_schema"
    assert json.loads(sent.text)["properties"]["answer"]["type"] == "string"


# --- refused before the worker ---------------------------------------------------------


def with_schema(schema, **extra) -> dict:
    return {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "s", "schema": schema, **extra},
        }
    }


def with_tools(*tools, **extra) -> dict:
    return {"tools": list(tools), **extra}


def tool(name="f", parameters=None) -> dict:
    function = {"name": name}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


REFUSED = {
    "a misspelt type": (
        with_schema({"type": "object", "properties": {"a": {"type": "strin"}}}),
        "response_format.json_schema.schema",
        "'strin' is not valid",
    ),
    "an unsupported keyword": (
        with_schema({"type": "object", "dependentSchemas": {"a": {}}}),
        "response_format.json_schema.schema",
        'Unimplemented keys: ["dependentSchemas"]',
    ),
    "a dangling $ref": (
        with_schema({"$ref": "#/$defs/missing"}),
        "response_format.json_schema.schema",
        "does not exist",
    ),
    "a schema that is not an object": (
        {"guided_json": "[1, 2]"},
        "guided_json",
        "must be a JSON object",
    ),
    "a bad name": (
        with_schema(SCHEMA, name="no spaces"),
        "response_format.json_schema.name",
        "pattern",
    ),
    "json_schema without its json_schema": (
        {"response_format": {"type": "json_schema"}},
        "response_format.json_schema",
        "needs its json_schema",
    ),
    "an unknown response_format type": (
        {"response_format": {"type": "xml"}},
        "response_format.type",
        "",
    ),
    "two constraints": (
        {"response_format": {"type": "json_object"}, "guided_regex": "a+"},
        "guided_regex",
        "at most one constraint",
    ),
    "structured_outputs with two keys": (
        {"structured_outputs": {"regex": "a", "choice": ["a"]}},
        "structured_outputs",
        "exactly one",
    ),
    "a regex with a backreference": (
        {"structured_outputs": {"regex": r"(a)\1"}},
        "structured_outputs.regex",
        "backreferences are not supported",
    ),
    "an empty choice": ({"guided_choice": []}, "guided_choice", "at least one"),
    "a grammar past max_grammar_bytes": (
        {"guided_regex": "a" * (300 << 10)},
        "guided_regex",
        "at most 262144 are allowed",
    ),
    "a $ref chain that crashes llguidance": (
        with_schema(deep_ref_chain(3000)),
        "response_format.json_schema.schema",
        "could not be compiled",
    ),
    "too many logit_bias entries": (
        {"logit_bias": {str(i): 1 for i in range(301)}},
        "logit_bias",
        "at most 300",
    ),
    "a logit_bias key that is not a number": ({"logit_bias": {"a": 1}}, "logit_bias", "decimal"),
    "a logit_bias token past the vocabulary": (
        {"logit_bias": {"400": 1}},
        "logit_bias",
        "[0, 400)",
    ),
    "a logit_bias value past 100": ({"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
    "a tool's bad name": (with_tools(tool("a b")), "tools.0.function.name", "pattern"),
    "tools with one name twice": (
        with_tools(tool("f"), tool("f")),
        "tools.1.function.name",
        "unique",
    ),
    "too many tools": (with_tools(*[tool(f"f{i}") for i in range(129)]), "tools", "128"),
    "a tool's bad parameters": (
        with_tools(tool("a"), tool("b"), tool("c", {"type": "object", "properties": 3})),
        "tools.2.function.parameters",
        "is not of type 'object'",
    ),
    "a tool's unsupported keyword": (
        with_tools(tool("a", {"type": "object", "if": {"type": "object"}, "then": {}})),
        "tools.0.function.parameters",
        "Unimplemented keys",
    ),
    "tool_choice naming no tool": (
        with_tools(tool("a"), tool_choice={"type": "function", "function": {"name": "b"}}),
        "tool_choice.function.name",
        "not among the tools",
    ),
    "tool_choice required without tools": (
        {"tool_choice": "required"},
        "tool_choice",
        "needs tools",
    ),
    "the deprecated functions": ({"functions": [{"name": "f"}]}, "functions", "send tools"),
    "tools beside a response format": (
        with_tools(tool("a"), response_format={"type": "json_object"}),
        "response_format",
        "cannot be combined with tool calls",
    ),
}


@pytest.mark.parametrize("fields, param, says", REFUSED.values(), ids=REFUSED.keys())
async def test_refused_before_any_worker_call(live, fields, param, says):
    body = {"model": MODEL_NAME, "messages": USER, "max_tokens": 4, **fields}
    async with http_of(live) as http:
        response = await http.post("/v1/chat/completions", json=body)
    assert_error(response, 400, param=param, says=says)
    assert live.worker.requests == []


MESSAGES_REFUSED = {
    "a tool message without its call id": (
        [{"role": "tool", "content": "18 C"}],
        "messages.0.tool_call_id",
    ),
    "a user message with tool calls": (
        [
            {
                "role": "user",
                "content": "x",
                "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                ],
            }
        ],
        "messages.0.tool_calls",
    ),
    "arguments that are not JSON": (
        [
            USER[0],
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}
                ],
            },
        ],
        "messages.1.tool_calls.0.function.arguments",
    ),
}


@pytest.mark.parametrize("messages, param", MESSAGES_REFUSED.values(), ids=MESSAGES_REFUSED.keys())
async def test_malformed_tool_turns_are_refused(live, messages, param):
    async with http_of(live) as http:
        response = await http.post(
            "/v1/chat/completions", json={"model": MODEL_NAME, "messages": messages}
        )
    assert_error(response, 400, param=param)
    assert live.worker.requests == []


async def test_non_finite_logit_bias_is_refused(live):
    body = b'{"model": "%s", "prompt": "hi", "logit_bias": {"5": NaN}}' % MODEL_NAME.encode()
    async with http_of(live) as http:
        response = await http.post(
            "/v1/completions", content=body, headers={"Content-Type": "application/json"}
        )
    assert_error(response, 400, param="logit_bias.5")
    assert live.worker.requests == []


# --- tool calls come back --------------------------------------------------------------

CALL_PIECES = (
    "<tool_call>\n",
    '{"name": "get_weather", ',
    '"arguments": {"city": "Paris"}}',
    "\n</tool_call>",
)


@pytest.mark.parametrize("choice", ["auto", "required", "named"])
async def test_a_call_comes_back_as_tool_calls(live, choice):
    live.worker.pieces = CALL_PIECES
    tool_choice = (
        {"type": "function", "function": {"name": "get_weather"}} if choice == "named" else choice
    )
    async with client_of(live) as client:
        out = await client.chat.completions.create(
            model=MODEL_NAME, messages=USER, tools=[WEATHER_TOOL], tool_choice=tool_choice
        )
    [choice_out] = out.choices
    assert choice_out.finish_reason == "tool_calls"
    assert choice_out.message.content is None
    [call] = choice_out.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and len(call.id) == 29
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"city": "Paris"},
    )
    sent = live.worker.requests[-1]
    assert sent.params.structured_output.format == "lark"
    assert "%json" in sent.params.structured_output.text


async def test_tools_are_shown_in_the_fallback_system_prompt(live, model_dir):
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    async with client_of(live) as client:
        await client.chat.completions.create(model=MODEL_NAME, messages=USER, tools=[WEATHER_TOOL])
        prompt = tokenizer.decode(
            list(live.worker.requests[-1].prompt_token_ids), skip_special_tokens=False
        )
        assert "<tools>\n" + json.dumps(WEATHER_TOOL) + "\n</tools>" in prompt
        await client.chat.completions.create(
            model=MODEL_NAME, messages=USER, tools=[WEATHER_TOOL], tool_choice="none"
        )
    sent = live.worker.requests[-1]
    assert "<tools>" not in tokenizer.decode(list(sent.prompt_token_ids), skip_special_tokens=False)
    assert not sent.params.HasField("structured_output")


async def test_an_answer_in_text_under_auto_is_content(live):
    live.worker.pieces = ("It is ", "sunny.")
    async with client_of(live) as client:
        out = await client.chat.completions.create(
            model=MODEL_NAME, messages=USER, tools=[WEATHER_TOOL]
        )
    assert out.choices[0].message.content == "It is sunny."
    assert out.choices[0].message.tool_calls is None
    assert out.choices[0].finish_reason == "stop"


async def test_streamed_calls_come_as_one_delta_each(live):
    live.worker.pieces = ("Checking", " now.\n", *CALL_PIECES, "\n", *CALL_PIECES)
    async with client_of(live) as client:
        stream = await client.chat.completions.create(
            model=MODEL_NAME, messages=USER, tools=[WEATHER_TOOL], stream=True
        )
        chunks = [chunk async for chunk in stream]
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == "Checking now."
    calls = [call for d in deltas for call in d.tool_calls or []]
    assert [c.index for c in calls] == [0, 1]
    assert all(c.function.arguments == '{"city":"Paris"}' for c in calls)
    assert len({c.id for c in calls}) == 2
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    # No chunk carries held-back text: the tags never reach the client as content.
    assert not any("<tool" in (d.content or "") for d in deltas)


async def test_a_call_cut_short_by_max_tokens_stays_text(live):
    live.worker.pieces = CALL_PIECES
    async with client_of(live) as client:
        out = await client.chat.completions.create(
            model=MODEL_NAME, messages=USER, tools=[WEATHER_TOOL], max_tokens=2
        )
    assert out.choices[0].finish_reason == "length"
    assert out.choices[0].message.tool_calls is None
    assert out.choices[0].message.content == "".join(CALL_PIECES[:2]).strip()


async def test_a_tool_result_continues_the_conversation(live, model_dir):
    messages = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    ]
    async with client_of(live) as client:
        out = await client.chat.completions.create(
            model=MODEL_NAME, messages=messages, tools=[WEATHER_TOOL]
        )
    assert out.choices[0].message.content == "Hello, world!"
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    prompt = tokenizer.decode(
        list(live.worker.requests[-1].prompt_token_ids), skip_special_tokens=False
    )
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    assert f"<|im_start|>assistant\n<tool_call>\n{call}\n</tool_call><|im_end|>" in prompt
    assert "<|im_start|>user\n<tool_response>\n18 C\n</tool_response><|im_end|>" in prompt


# --- the grammar checker ---------------------------------------------------------------


def checker(**limits) -> GrammarChecker:
    values = {"max_bytes": 256 << 10, "cache_entries": 8, "children": 1, "timeout_s": 30.0}
    return GrammarChecker(GrammarLimits(**{**values, **limits}))


def checked(outcome: str) -> float:
    """Grammar checks so far with this outcome (the gateway's metric)."""
    sample = "switchboard_grammar_checks_total"
    return metrics.REGISTRY.get_sample_value(sample, {"outcome": outcome}) or 0.0


async def test_a_grammar_is_checked_once_and_then_answered_from_the_cache():
    grammars = checker()
    text = json.dumps(SCHEMA)
    try:
        valid, cached = checked("valid"), checked("cached")
        verdicts = await asyncio.gather(
            *[grammars.verdict("json_schema", text, tenant="t") for _ in range(5)]
        )
        assert verdicts == [""] * 5
        assert checked("valid") == valid + 1  # five requests at once: one check
        for _ in range(3):
            assert await grammars.verdict("json_schema", text, tenant="t") == ""
        assert (checked("valid"), checked("cached")) == (valid + 1, cached + 3)
    finally:
        await grammars.close()


async def test_the_cache_keeps_the_latest_verdicts():
    grammars = checker(cache_entries=2)
    try:
        for pattern in ("a", "b", "c"):
            await grammars.verdict("regex", pattern, tenant="t")
        valid = checked("valid")
        await grammars.verdict("regex", "c", tenant="t")  # kept
        assert checked("valid") == valid
        await grammars.verdict("regex", "a", tenant="t")  # the oldest: forgotten, checked again
        assert checked("valid") == valid + 1
    finally:
        await grammars.close()


async def test_a_grammar_that_kills_its_checker_is_refused_and_the_next_is_checked():
    grammars = checker()
    try:
        assert await grammars.verdict(
            "json_schema", json.dumps(deep_ref_chain(3000)), tenant="t"
        ) == (CRASHED)
        assert await grammars.verdict("regex", "[a-z]+", tenant="t") == ""
        assert await grammars.verdict("regex", "(", tenant="t") != ""
    finally:
        await grammars.close()


async def test_a_check_past_its_time_is_refused():
    grammars = checker(timeout_s=0.001)
    try:
        verdict = await grammars.verdict("json_schema", json.dumps(SCHEMA), tenant="t")
        assert verdict.startswith("checking it took longer than")
    finally:
        await grammars.close()


async def test_verdicts_are_cached_per_tenant():
    """A tenant's schema is not answered from another tenant's verdict (its time would tell
    that someone else sent it)."""
    grammars = checker()
    try:
        await grammars.verdict("regex", "[0-9]+x", tenant="a")
        valid = checked("valid")
        await grammars.verdict("regex", "[0-9]+x", tenant="b")
        assert checked("valid") == valid + 1
        await grammars.verdict("regex", "[0-9]+x", tenant="b")
        assert checked("valid") == valid + 1
    finally:
        await grammars.close()
