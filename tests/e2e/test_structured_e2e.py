"""Structured outputs and tool calls end to end: real Redis, a real worker process (a tiny
random model), the real gateway under uvicorn, and the official `openai` client.

A random model walks wherever the grammar lets it, so every schema bounds its strings and
arrays (and objects allow no other properties): each answer must then end by the grammar
("stop") and validate against its schema (`jsonschema`), and each tool call's arguments
against the function's parameters. Last, hostile grammars next to a victim's stream.
"""

from __future__ import annotations

import json
import os
import re
import threading
from typing import Annotated, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from factories import add_byte_level_tokenizer, make_checkpoint
from runtime.embedded_redis import free_port
from runtime.stack import Stack

pytestmark = pytest.mark.slow

MAX_TOKENS = 300  # room for every bounded schema below to finish
SCHEMAS = {
    "nested-objects": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 6},
                    "address": {
                        "type": "object",
                        "properties": {"city": {"type": "string", "maxLength": 5}},
                        "required": ["city"],
                        "additionalProperties": False,
                    },
                },
                "required": ["name", "address"],
                "additionalProperties": False,
            }
        },
        "required": ["user"],
        "additionalProperties": False,
    },
    "enums": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "ok": {"type": "boolean"},
            "size": {"type": "string", "enum": ["S", "M", "L"]},
        },
        "required": ["color", "ok", "size"],
        "additionalProperties": False,
    },
    "arrays-with-bounds": {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"type": "string", "maxLength": 4},
                "minItems": 1,
                "maxItems": 3,
            },
            "scores": {
                "type": "array",
                "items": {"type": "integer", "minimum": -5, "maximum": 5},
                "maxItems": 4,
            },
        },
        "required": ["tags", "scores"],
        "additionalProperties": False,
    },
    "patterns": {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
            "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
        },
        "required": ["code", "date"],
        "additionalProperties": False,
    },
    "integer-ranges-and-optional-fields": {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 18, "maximum": 99},
            "floor": {"type": "integer", "minimum": -3, "maximum": 3},
            "nickname": {"type": "string", "maxLength": 4},
            "vip": {"type": "boolean"},
        },
        "required": ["age", "floor"],
        "additionalProperties": False,
    },
    "refs-and-any-of": {
        "type": "object",
        "properties": {
            "shape": {"anyOf": [{"$ref": "#/$defs/circle"}, {"$ref": "#/$defs/square"}]}
        },
        "required": ["shape"],
        "additionalProperties": False,
        "$defs": {
            "circle": {
                "type": "object",
                "properties": {"r": {"type": "integer", "minimum": 1, "maximum": 9}},
                "required": ["r"],
                "additionalProperties": False,
            },
            "square": {
                "type": "object",
                "properties": {"side": {"type": "integer", "minimum": 1, "maximum": 9}},
                "required": ["side"],
                "additionalProperties": False,
            },
        },
    },
}
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
PARAMETERS = {"get_weather": WEATHER, "get_time": TIME}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = make_checkpoint(
        tmp_path_factory.mktemp("structured-e2e"),
        vocab_size=512,
        max_position_embeddings=2048,  # the tools' system prompt is ~1 token a byte here
        eos_token_id=0,  # the tokenizer's <|endoftext|>
        seed=31,
    )
    return add_byte_level_tokenizer(path)


@pytest.fixture(scope="module")
def stack(tiny_model, redis_url, tmp_path_factory):
    with Stack(
        model=tiny_model,
        num_workers=1,
        redis_url=redis_url,
        gateway_port=free_port(),
        dtype="float32",
        key_prefix=f"sbstructured:{os.getpid()}:",
        home=tmp_path_factory.mktemp("structured-home"),
    ) as running:
        yield running


@pytest.fixture(scope="module")
def client(stack):
    key = stack.create_tenant_key("acme")
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=key, max_retries=0)


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model.name


def assert_valid_calls(calls, *, at_least: int = 0) -> None:
    """Every call names a tool and its arguments validate against that tool's parameters."""
    calls = calls or []
    assert len(calls) >= at_least
    for call in calls:
        assert call.type == "function" and re.fullmatch(r"call_[A-Za-z0-9]{24}", call.id)
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


# --- JSON schemas, regex, choice -------------------------------------------------------


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_answer_validates_against_its_schema(client, model, name):
    schema = SCHEMAS[name]
    out = client.chat.completions.create(
        model=model,
        messages=USER,
        max_tokens=MAX_TOKENS,
        n=3,
        seed=7,
        response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema}},
    )
    for choice in out.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), schema)


@pytest.mark.parametrize("name", ["nested-objects", "arrays-with-bounds"])
def test_streamed_completions_validate_too(client, model, name):
    schema = SCHEMAS[name]
    stream = client.completions.create(
        model=model,
        prompt="JSON:",
        max_tokens=MAX_TOKENS,
        seed=3,
        stream=True,
        extra_body={
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": schema},
            }
        },
    )
    chunks = [c for c in stream if c.choices]
    assert chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads("".join(c.choices[0].text for c in chunks)), schema)


class City(BaseModel):
    name: Annotated[str, Field(max_length=8)]
    population: Annotated[int, Field(ge=0, le=999)]


class Trip(BaseModel):
    mode: Literal["car", "train", "plane"]
    stops: Annotated[list[City], Field(max_length=2)]
    nights: Annotated[int, Field(ge=1, le=14)]


def test_the_clients_own_parse_with_a_pydantic_model(client, model):
    out = client.chat.completions.parse(
        model=model, messages=USER, max_tokens=MAX_TOKENS, seed=11, response_format=Trip
    )
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, Trip)
    assert message.parsed == Trip.model_validate_json(message.content)


def test_any_json_object(client, model):
    out = client.chat.completions.create(
        model=model,
        messages=USER,
        max_tokens=MAX_TOKENS,
        n=2,
        seed=5,
        response_format={"type": "json_object"},
    )
    for choice in out.choices:
        if choice.finish_reason == "stop":  # a random walk may fill max_tokens with keys
            assert isinstance(json.loads(choice.message.content), dict)
        else:
            assert choice.message.content.startswith("{")


@pytest.mark.parametrize("stream", [False, True])
def test_regex_and_choice_through_extra_body(client, model, stream):
    cases = [
        ({"structured_outputs": {"regex": "[ab]{2,5}-(yes|no)"}}, r"[ab]{2,5}-(yes|no)"),
        ({"guided_choice": ["alpha", "beta", "gamma delta"]}, r"alpha|beta|gamma delta"),
        ({"structured_outputs": {"grammar": 'root ::= "x" [0-9] [0-9]?'}}, r"x[0-9]{1,2}"),
    ]
    for extra, pattern in cases:
        out = client.completions.create(
            model=model, prompt="answer:", max_tokens=40, seed=1, stream=stream, extra_body=extra
        )
        if stream:
            chunks = [c for c in out if c.choices]
            text = "".join(c.choices[0].text for c in chunks)
            finish = chunks[-1].choices[0].finish_reason
        else:
            text, finish = out.choices[0].text, out.choices[0].finish_reason
        assert finish == "stop" and re.fullmatch(pattern, text), (extra, text)


def test_logit_bias_forces_a_token(client, model, tiny_model):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    token = tokenizer.encode("fox", add_special_tokens=False).ids[0]
    out = client.completions.create(
        model=model, prompt="hello", max_tokens=5, logit_bias={str(token): 100}, seed=2
    )
    assert tokenizer.encode(out.choices[0].text, add_special_tokens=False).ids == [token] * 5


# --- tools --------------------------------------------------------------------------------

NAMED = {"type": "function", "function": {"name": "get_time"}}


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_required_and_named_calls_validate(client, model, choice, parallel):
    out = client.chat.completions.create(
        model=model,
        messages=USER,
        tools=TOOLS,
        tool_choice=NAMED if choice == "named" else "required",
        parallel_tool_calls=parallel,
        max_tokens=MAX_TOKENS,
        n=2,
        seed=13,
    )
    for sample in out.choices:
        calls = sample.message.tool_calls
        assert_valid_calls(calls, at_least=1)
        if choice == "named" or not parallel:
            assert sample.finish_reason == "tool_calls" and len(calls) == 1
        if choice == "named":
            assert calls[0].function.name == "get_time"
        assert sample.message.content is None


def test_auto_answers_in_text_or_with_valid_calls(client, model):
    out = client.chat.completions.create(
        model=model, messages=USER, tools=TOOLS, max_tokens=64, n=4, seed=17
    )
    for sample in out.choices:
        assert_valid_calls(sample.message.tool_calls)
        if sample.message.tool_calls:
            assert sample.finish_reason in ("tool_calls", "length")
        else:
            assert sample.finish_reason in ("stop", "length")


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_streamed_calls_validate(client, model, choice):
    stream = client.chat.completions.create(
        model=model,
        messages=USER,
        tools=TOOLS,
        tool_choice=choice,
        parallel_tool_calls=False,
        max_tokens=MAX_TOKENS if choice == "required" else 64,
        seed=19,
        stream=True,
    )
    chunks = [c for c in stream if c.choices]
    calls = [call for c in chunks for call in c.choices[0].delta.tool_calls or []]
    assert [call.index for call in calls] == list(range(len(calls)))
    assert_valid_calls(calls, at_least=1 if choice == "required" else 0)
    if calls and choice == "required":
        assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_tool_result_continues_the_conversation(client, model):
    first = client.chat.completions.create(
        model=model, messages=USER, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, max_tokens=MAX_TOKENS, seed=23,
    )  # fmt: skip
    call = first.choices[0].message.tool_calls[0]
    messages = [
        *USER,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"},
    ]
    out = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, max_tokens=32, seed=29
    )
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert_valid_calls(out.choices[0].message.tool_calls)
    assert out.usage.prompt_tokens > first.usage.prompt_tokens


def schema_format(schema: dict) -> dict:
    return {
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    }


def test_bad_schemas_and_tools_are_400s_naming_the_problem(client, model):
    misspelt = {"type": "object", "properties": {"a": {"type": "strin"}}}
    bad_tool = {"type": "function", "function": {"name": "t", "parameters": misspelt}}
    refusals = [
        (
            schema_format({"type": "object", "dependentSchemas": {}}),
            "response_format.json_schema.schema",
            "dependentSchemas",
        ),
        ({"tools": [TOOLS[0], bad_tool]}, "tools.1.function.parameters", "strin"),
        ({"logit_bias": {"100000": 1}}, "logit_bias", "must be token ids in [0, "),
    ]
    for extra, param, says in refusals:
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=model, messages=USER, extra_body=extra)
        assert refused.value.body["param"] == param
        assert says in refused.value.body["message"]


# --- hostile grammars next to a victim -------------------------------------------------


def deep_ref_chain(depth: int) -> dict:
    defs = {
        f"d{i}": {"type": "array", "items": {"$ref": f"#/$defs/d{i + 1}"}} for i in range(depth)
    }
    defs[f"d{depth}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def lark_chain(depth: int) -> str:
    rules = "\n".join(f'x{i}: x{i + 1} "a"' for i in range(depth))
    return f'start: x0\n{rules}\nx{depth}: "b"'


HOSTILE = {
    # Kill llguidance's compiler (stack overflow): the gateway's checker dies instead.
    "a $ref chain": schema_format(deep_ref_chain(3000)),
    "a Lark rule chain": {"structured_outputs": {"grammar": lark_chain(3000)}},
    # Valid but costly: each step's parser work is bounded (LLParserLimits).
    "nested counted repetition": {"guided_regex": "((a|b){1,100}c){1,100}(d{1,50}){1,50}"},
    "a 5000-value enum": {"guided_json": {"enum": [f"value-{i}" for i in range(5000)]}},
    # The parser's bound (max_items_in_row) ends this one after its first token: the
    # worker fails that request alone, a 400 with a short message.
    "an alternation of many words": {"guided_choice": [f"w{i}" * 3 for i in range(3000)]},
}


class Victim:
    """Another tenant's greedy stream, which must stay what it is alone."""

    def __init__(self, stack: Stack, model: str) -> None:
        self.url = f"{stack.base_url}/v1/completions"
        self.headers = {"Authorization": f"Bearer {stack.create_tenant_key('victim')}"}
        self.body = {
            "model": model,
            "prompt": "the victim's prompt",
            "max_tokens": 48,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        self.expected = self.stream()

    def stream(self) -> str:
        text = []
        with httpx.stream("POST", self.url, json=self.body, headers=self.headers, timeout=120) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text.append(json.loads(line[6:])["choices"][0]["text"])
        return "".join(text)


@pytest.fixture(scope="module")
def victim(stack, model):
    return Victim(stack, model)


@pytest.mark.parametrize("attack", [pytest.param(v, id=k) for k, v in HOSTILE.items()])
def test_a_hostile_grammar_fails_alone(stack, client, model, victim, attack):
    results, failures, done = [], [], threading.Event()

    def victim_loop() -> None:
        while not done.is_set() or not results:
            try:
                results.append(victim.stream())
            except Exception as exc:  # reported below
                failures.append(exc)
                return

    thread = threading.Thread(target=victim_loop, daemon=True)
    thread.start()
    try:
        response = client.with_options(timeout=120).chat.completions.with_raw_response.create(
            model=model, messages=USER, max_tokens=16, extra_body=attack
        )
        status = response.status_code
    except openai.APIStatusError as exc:
        status = exc.status_code
        assert exc.body["message"]  # the gateway's refusals also name the param
    finally:
        done.set()
        thread.join(timeout=300)
    assert status == 200 or 400 <= status < 500, status
    assert not thread.is_alive() and not failures, failures
    assert results and all(r == victim.expected for r in results)
    # The gateway and the worker both live on: the next request is served.
    assert client.completions.create(model=model, prompt="hi", max_tokens=2).choices
