"""What clients and evaluation tools expect of the API, against the real stack (Redis, a worker
process on a tiny random model, the gateway under uvicorn) through the official `openai`
client: echo and prompt logprobs on /v1/completions (as lm-evaluation-harness's
`local-completions` scores text) equal to transformers / peft in fp32, the caller's own
adapters in /v1/models, the Responses API (create, stream, parse, function calls), every
optional argument None, and hostile values refused with OpenAI's errors."""

from __future__ import annotations

import inspect
import json
import os
from typing import Annotated

import httpx
import jsonschema
import openai
import pytest
import torch
from peft import PeftModel
from pydantic import BaseModel, Field

from factories import add_byte_level_tokenizer, load_hf_model, make_checkpoint, make_peft_adapter
from runtime.embedded_redis import free_port
from runtime.stack import Stack

pytestmark = pytest.mark.slow

TOL = 1e-4
TEXT = "héllo world, the quick brown fox"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = make_checkpoint(
        tmp_path_factory.mktemp("surface-model"),
        vocab_size=512,
        max_position_embeddings=2048,  # the tools' system prompt is ~1 token a byte here
        eos_token_id=0,
        seed=23,
    )
    return add_byte_level_tokenizer(path)


@pytest.fixture(scope="module")
def adapter_dir(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("surface-adapter") / "sql"
    return make_peft_adapter(tiny_model, out, rank=4, targets=["q_proj", "v_proj", "up_proj"])


@pytest.fixture(scope="module")
def stack(tiny_model, adapter_dir, redis_url, tmp_path_factory):
    with Stack(
        model=tiny_model,
        num_workers=1,
        redis_url=redis_url,
        gateway_port=free_port(),
        dtype="float32",
        key_prefix=f"sbsurface:{os.getpid()}:",
        home=tmp_path_factory.mktemp("surface-home"),
    ) as running:
        running.create_tenant_key("acme")
        running.create_tenant_key("other")
        for tenant, name in (("acme", "sql"), ("other", "secret")):
            body = {"name": name, "path": str(adapter_dir)}
            running.admin("POST", f"/tenants/{tenant}/adapters", json=body)
        yield running


@pytest.fixture(scope="module")
def client(stack):
    key = stack.create_tenant_key("acme")
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=key, max_retries=0)


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model.name


@pytest.fixture(scope="module")
def reference(tiny_model, adapter_dir):
    """Each prompt token's logprob (tokens 1..P-1) and its row, by transformers / peft."""
    peft = PeftModel.from_pretrained(load_hf_model(tiny_model), adapter_dir).eval()

    def logprobs(ids: list[int], adapter: bool) -> torch.Tensor:
        with torch.no_grad():
            if adapter:
                logits = peft(input_ids=torch.tensor([ids])).logits[0]
            else:
                with peft.disable_adapter():
                    logits = peft(input_ids=torch.tensor([ids])).logits[0]
        return torch.log_softmax(logits.float(), dim=-1)[:-1]

    return logprobs


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tiny_model / "tokenizer.json"))


@pytest.mark.parametrize("which", ["base", "adapter"])
def test_echo_scores_the_prompt_as_transformers_does(client, model, tokenizer, reference, which):
    """lm-evaluation-harness's loglikelihood request: token ids, echo, logprobs, max_tokens 0."""
    ids = tokenizer.encode(TEXT).ids
    out = client.completions.create(
        model=model if which == "base" else "sql",
        prompt=ids,
        echo=True,
        logprobs=2,
        max_tokens=0,
        temperature=0,
    )
    choice = out.choices[0]
    assert choice.text == TEXT
    assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == len(ids)
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    expected = reference(ids, which == "adapter")
    for p, token in enumerate(ids[1:]):
        assert abs(lp.token_logprobs[p + 1] - expected[p, token].item()) <= TOL
        # Keyed by text: two tokens with one text keep the likelier one.
        best = torch.topk(expected[p], 2).values.tolist()
        top = lp.top_logprobs[p + 1]
        assert max(top.values()) == pytest.approx(best[0], abs=TOL)
        assert all(min(abs(v - b) for b in best) <= TOL for v in top.values())
    # text_offset: where each token's text starts in the echoed text.
    pieces = [tokenizer.decode(ids[:i]) for i in range(len(ids))]
    assert lp.text_offset == [len(piece.rstrip("\ufffd")) for piece in pieces]


@pytest.mark.parametrize("which", ["base", "adapter"])
def test_a_loglikelihood_as_lm_evaluation_harness_reads_it(
    client, model, tokenizer, reference, which
):
    """lm-eval's `local-completions` payload (echo, logprobs 1, max_tokens 1, token ids) and
    its reading: the continuation's logprobs are token_logprobs[ctxlen:-1], greedy when each
    equals the top entry."""
    context, continuation = tokenizer.encode("the quick").ids, tokenizer.encode(" brown fox").ids
    ids = context + continuation
    out = client.completions.create(
        model=model if which == "base" else "sql",
        prompt=[ids],
        echo=True,
        logprobs=1,
        max_tokens=1,
        temperature=0,
        seed=1234,
    )
    lp = out.choices[0].logprobs
    ctxlen = len(context)
    got = sum(lp.token_logprobs[ctxlen:-1])
    expected = reference(ids, which == "adapter")
    want = sum(expected[p - 1, ids[p]].item() for p in range(ctxlen, len(ids)))
    assert abs(got - want) <= TOL * len(continuation)
    greedy = all(
        tok == max(top.values())
        for tok, top in zip(lp.token_logprobs[ctxlen:-1], lp.top_logprobs[ctxlen:-1], strict=True)
    )
    argmax = [expected[p - 1].argmax().item() == ids[p] for p in range(ctxlen, len(ids))]
    assert greedy == all(argmax)


def test_echo_then_completion_and_vllm_prompt_logprobs(client, model, tokenizer, reference):
    ids = tokenizer.encode(TEXT).ids
    out = client.completions.create(
        model=model,
        prompt=TEXT,
        echo=True,
        logprobs=0,
        max_tokens=3,
        temperature=0,
        extra_body={"prompt_logprobs": 1, "ignore_eos": True},
    )
    choice = out.choices[0]
    assert choice.text.startswith(TEXT) and len(choice.logprobs.tokens) == len(ids) + 3
    assert choice.logprobs.text_offset[len(ids)] == len(TEXT)  # the completion follows
    rows = choice.model_extra["prompt_logprobs"]
    assert rows[0] is None and len(rows) == len(ids)
    expected = reference(ids, False)
    for p, token in enumerate(ids[1:]):
        entry = rows[p + 1][str(token)]
        assert abs(entry["logprob"] - expected[p, token].item()) <= TOL


def test_echo_streams_the_prompt_first(client, model, tokenizer):
    stream = client.completions.create(
        model=model, prompt=TEXT, echo=True, max_tokens=4, temperature=0, stream=True
    )
    text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    assert text.startswith(TEXT) and len(text) > len(TEXT)


def test_hostile_scoring_values_are_refused_by_name(stack, model):
    key = stack.create_tenant_key("mallory")
    headers = {"Authorization": f"Bearer {key}"}
    cases = [
        ({"echo": True, "logprobs": 21}, "logprobs"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -1}, "max_tokens"),
    ]
    for extra, param in cases:
        body = {"model": model, "prompt": "hi", **extra}
        r = httpx.post(f"{stack.base_url}/v1/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 400, (extra, r.text)
        assert r.json()["error"]["param"] == param, (extra, r.text)


def test_models_lists_the_callers_adapters_with_their_parent(client, model):
    listed = {m.id: m for m in client.models.list().data}
    assert set(listed) == {model, "sql"}  # never another tenant's ("secret")
    assert listed["sql"].model_extra["parent"] == model
    assert listed["sql"].owned_by == "acme"
    assert listed[model].model_extra["parent"] is None
    # The SDK's models.retrieve: one entry, the caller's own only.
    assert client.models.retrieve("sql") == listed["sql"]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("secret")


# --- the Responses API --------------------------------------------------------------------

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOL = {"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": True}


class Answer(BaseModel):
    word: Annotated[str, Field(max_length=6)]
    ok: bool


def usage_of(stack, key: str, model: str) -> tuple[int, int]:
    """The tenant's (prompt, completion) tokens today for ``model``, from /v1/usage."""
    headers = {"Authorization": f"Bearer {key}"}
    rows = httpx.get(f"{stack.base_url}/v1/usage", headers=headers, timeout=30).json()["data"]
    row = next((r for r in rows if r["model"] == model), {})
    return row.get("prompt_tokens", 0), row.get("completion_tokens", 0)


def test_responses_are_charged_as_chat_is(stack, model):
    key = stack.create_tenant_key("payer")
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=key, max_retries=0)
    before = usage_of(stack, key, model)
    out = client.responses.create(model=model, input="hi", max_output_tokens=3)
    after = usage_of(stack, key, model)
    assert after[0] - before[0] == out.usage.input_tokens
    assert after[1] - before[1] == out.usage.output_tokens > 0


def test_responses_create_with_instructions_and_usage(client, model):
    out = client.responses.create(
        model=model,
        instructions="Answer briefly.",
        input="What is the weather?",
        max_output_tokens=5,
        temperature=0,
    )
    assert out.object == "response" and out.output[0].type == "message"
    assert out.output_text == out.output[0].content[0].text
    assert out.usage.output_tokens <= 5 and out.usage.input_tokens > 0
    assert out.status in {"completed", "incomplete"}
    if out.status == "incomplete":
        assert out.incomplete_details.reason == "max_output_tokens"


def test_responses_stream_events_add_up_to_the_response(client, model):
    with client.responses.stream(
        model=model, input=[{"role": "user", "content": "hi"}], max_output_tokens=6
    ) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    # Cut short by max_output_tokens it ends "incomplete", as OpenAI's does (the SDK's
    # get_final_response only takes "completed").
    assert kinds[-1] in {"response.completed", "response.incomplete"}
    final = events[-1].response
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert final.output_text == deltas
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert final.usage.output_tokens > 0


def test_responses_function_call_and_its_output_round_trip(client, model):
    out = client.responses.create(
        model=model, input="Weather in Paris?", tools=[TOOL], tool_choice="required"
    )
    calls = [item for item in out.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    follow = client.responses.create(
        model=model,
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "type": "function_call",
                "call_id": calls[0].call_id,
                "name": calls[0].name,
                "arguments": calls[0].arguments,
            },
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"},
        ],
        tools=[TOOL],
        tool_choice="none",
        max_output_tokens=4,
    )
    assert follow.output[0].type == "message"


def test_responses_streamed_function_call(client, model):
    with client.responses.stream(
        model=model, input="Weather?", tools=[TOOL], tool_choice="required"
    ) as stream:
        final = stream.get_final_response()
    calls = [item for item in final.output if item.type == "function_call"]
    assert calls and json.loads(calls[0].arguments)["unit"] in {"c", "f"}


def test_responses_parse_follows_the_schema(client, model):
    out = client.responses.parse(model=model, input="Say something.", text_format=Answer)
    assert isinstance(out.output_parsed, Answer)


def test_responses_refuse_what_they_cannot_honour(client, model):
    cases = [
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input.0.content.0"),
        ({"background": True}, "background"),
    ]
    for extra, param in cases:
        body = {"model": model, "input": "hi", **extra}
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.create(**body)
        assert caught.value.body["param"] == param, extra


def test_every_optional_argument_none_gets_200(client, model):
    create = client.responses.create
    transport = {"extra_headers", "extra_query", "extra_body", "timeout", "model", "input"}
    nones = {n: None for n in inspect.signature(create).parameters if n not in transport}
    out = create(model=model, input="hi", **{**nones, "max_output_tokens": 3})
    assert out.status in {"completed", "incomplete"}
    for create, required in (
        (client.completions.create, {"prompt": "hi"}),
        (client.chat.completions.create, {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        names = inspect.signature(create).parameters
        nones = {n: None for n in names if n not in transport | set(required)}
        # The nulls as sent; only the length bounded (a random model rarely ends by itself).
        create(model=model, **required, **nones, extra_body={"max_tokens": 4})


def test_an_agent_on_its_default_responses_model_calls_a_tool_and_answers_in_a_schema(stack, model):
    """openai-agents' Agent on `OpenAIResponsesModel` (its default), tracing off (it would
    upload): a tool call it runs, then a structured final output."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    key = stack.create_tenant_key("acme")
    client = openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key=key, max_retries=0)
    responses_model = agents.OpenAIResponsesModel(model=model, openai_client=client)
    seen = []

    @agents.function_tool
    def get_weather(city: Annotated[str, Field(max_length=8)]) -> str:
        """The weather in a city."""
        seen.append(city)
        return "sunny"

    caller = agents.Agent(
        name="caller",
        model=responses_model,
        tools=[get_weather],
        # One call asked for: the random model would otherwise sometimes make two at once.
        model_settings=agents.ModelSettings(tool_choice="required", parallel_tool_calls=False),
        tool_use_behavior="stop_on_first_tool",
    )
    result = agents.Runner.run_sync(caller, "Weather in Paris?")
    assert len(seen) == 1 and result.final_output == "sunny"
    answerer = agents.Agent(name="answerer", model=responses_model, output_type=Answer)
    result = agents.Runner.run_sync(answerer, "Say something.")
    assert isinstance(result.final_output, Answer)
