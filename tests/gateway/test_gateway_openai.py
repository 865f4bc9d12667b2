"""The OpenAI API through the official `openai` client: a real uvicorn gateway, real Redis, and
`ScriptedWorker`s (real gRPC servers streaming known tokens) standing in for workers."""

from __future__ import annotations

import inspect
import json

import httpx
import openai
import pytest

from gateway_support import (
    MODEL_NAME,
    ScriptedWorker,
    delete_prefix,
    gateway_settings,
    running_gateway,
    write_adapter,
)

SYSTEM = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"


class Stack:
    """A running gateway, one tenant with a key, and a registered ScriptedWorker."""

    def __init__(self, gw, admin, redis, prefix, worker, key):
        self.gw, self.admin, self.redis, self.prefix = gw, admin, redis, prefix
        self.worker, self.key = worker, key

    def client(self, **kwargs) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"{self.gw.url}/v1", api_key=self.key, max_retries=0, **kwargs
        )

    def http(self) -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {self.key}"}
        return httpx.AsyncClient(base_url=self.gw.url, headers=headers, timeout=10)


@pytest.fixture
async def stack(redis_url, redis_prefix, model_dir, tmp_path):
    import redis.asyncio as aioredis

    settings = gateway_settings(
        redis_url=redis_url, prefix=redis_prefix, model_dir=model_dir, store=tmp_path / "store"
    )
    worker = await ScriptedWorker("w1").start()
    redis = aioredis.Redis.from_url(redis_url, decode_responses=True)
    try:
        await worker.register(redis, redis_prefix)
        async with (
            running_gateway(settings) as gw,
            httpx.AsyncClient(base_url=gw.url, headers=gw.admin_headers) as admin,
        ):
            await admin.post("/admin/tenants", json={"name": "acme"})
            key = (await admin.post("/admin/tenants/acme/keys")).json()["key"]
            yield Stack(gw, admin, redis, redis_prefix, worker, key)
    finally:
        await worker.stop()
        await delete_prefix(redis_url, redis_prefix)
        await redis.aclose()


async def test_completion(stack, reference_tokenizer):
    async with stack.client() as client:
        out = await client.completions.create(model=MODEL_NAME, prompt="Hello, world!")
    assert out.choices[0].text == "Hello, world!"
    assert out.choices[0].finish_reason == "stop"
    expected_ids = reference_tokenizer.encode("Hello, world!").ids
    sent = stack.worker.requests[-1]
    assert list(sent.prompt_token_ids) == expected_ids
    assert sent.params.max_tokens == 16  # the completions default
    assert sent.adapter_id == "" and sent.tenant == "acme"
    assert out.usage.prompt_tokens == len(expected_ids)
    assert out.usage.completion_tokens == 4
    assert out.usage.total_tokens == len(expected_ids) + 4


async def test_completion_from_token_ids_with_max_tokens(stack):
    async with stack.client() as client:
        out = await client.completions.create(model=MODEL_NAME, prompt=[5, 6, 7], max_tokens=2)
    assert out.choices[0].text == "Hello,"
    assert out.choices[0].finish_reason == "length"
    assert list(stack.worker.requests[-1].prompt_token_ids) == [5, 6, 7]
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (3, 2)


async def test_chat(stack, reference_tokenizer):
    async with stack.client() as client:
        out = await client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "What is the capital?"}]
        )
    message = out.choices[0].message
    assert (message.role, message.content) == ("assistant", "Hello, world!")
    # The ChatML rendering written out by hand, tokenized without added special tokens.
    prompt = f"{SYSTEM}<|im_start|>user\nWhat is the capital?<|im_end|>\n<|im_start|>assistant\n"
    expected_ids = reference_tokenizer.encode(prompt, add_special_tokens=False).ids
    sent = stack.worker.requests[-1]
    assert list(sent.prompt_token_ids) == expected_ids
    assert sent.params.max_tokens == 256 - len(expected_ids)  # the rest of the context
    assert out.usage.prompt_tokens == len(expected_ids)
    assert out.usage.completion_tokens == 4


async def test_chat_stream_first_chunk_carries_content_and_usage_comes_last(stack):
    async with stack.client() as client:
        stream = await client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
    first = chunks[0]
    assert first.choices[0].delta.role == "assistant"
    assert first.choices[0].delta.content == "Hello"
    assert "".join(c.choices[0].delta.content for c in chunks if c.choices) == "Hello, world!"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 4
    assert chunks[-1].usage.prompt_tokens == len(stack.worker.requests[-1].prompt_token_ids)


async def test_completion_stream_ends_with_done(stack):
    body = {"model": MODEL_NAME, "prompt": "hi", "stream": True, "max_tokens": 3}
    async with stack.http() as http, http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line async for line in r.aiter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "Hello, world"
    assert chunks[0]["choices"][0]["text"] == "Hello"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["object"] == "text_completion" for c in chunks)


@pytest.mark.parametrize("stream", [False, True])
async def test_n_samples(stack, stream):
    async with stack.client() as client:
        kwargs = {"stream_options": {"include_usage": True}} if stream else {}
        out = await client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "hi"}],
            n=2,
            stream=stream,
            **kwargs,
        )
        if stream:
            chunks = [chunk async for chunk in out]
            texts = {0: "", 1: ""}
            for chunk in chunks:
                for choice in chunk.choices:
                    texts[choice.index] += choice.delta.content or ""
            usage = chunks[-1].usage
        else:
            texts = {c.index: c.message.content for c in out.choices}
            usage = out.usage
    assert texts == {0: "Hello, world!", 1: "Hello, world!"}
    assert stack.worker.requests[-1].params.n == 2
    assert usage.completion_tokens == 8


async def test_best_of_generates_more_and_returns_the_most_likely(stack):
    async with stack.client() as client:
        out = await client.completions.create(
            model=MODEL_NAME, prompt="hi", best_of=3, n=1, logprobs=1
        )
        plain = await client.completions.create(model=MODEL_NAME, prompt="hi", best_of=3)
    sent = stack.worker.requests[-2]
    assert (sent.params.n, sent.params.logprobs) == (3, 1)
    [choice] = out.choices
    assert choice.index == 0 and choice.text == "Hello, world!"
    # The scripted worker makes sample 2 of 3 the most likely: -0.25 per token.
    assert choice.logprobs.token_logprobs == [-0.25] * 4
    assert out.usage.completion_tokens == 12  # all three samples were generated
    assert stack.worker.requests[-1].params.logprobs == 0  # needed to rank, not returned
    assert plain.choices[0].logprobs is None
    async with stack.http() as http:
        streamed = await http.post(
            "/v1/completions",
            json={"model": MODEL_NAME, "prompt": "hi", "best_of": 2, "stream": True},
        )
        fewer = await http.post(
            "/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "best_of": 1, "n": 2}
        )
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "best_of"
    assert fewer.status_code == 400 and "at least n" in fewer.json()["error"]["message"]


async def test_sampling_fields_reach_the_worker(stack):
    async with stack.client() as client:
        await client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "hi"}],
            max_completion_tokens=7,
            temperature=0.3,
            top_p=0.9,
            seed=42,
            stop=["\n", "END"],
            presence_penalty=0.5,
            frequency_penalty=-0.5,
            extra_body={
                "top_k": 20,
                "min_p": 0.05,
                "repetition_penalty": 1.1,
                "ignore_eos": True,
                "stop_token_ids": [2],
                "num_speculative_tokens": 3,
            },
        )
    p = stack.worker.requests[-1].params
    assert p.num_speculative_tokens == 3
    assert p.max_tokens == 7 and p.seed == 42 and list(p.stop) == ["\n", "END"]
    assert (p.top_k, p.ignore_eos, list(p.stop_token_ids)) == (20, True, [2])
    assert p.temperature == pytest.approx(0.3) and p.top_p == pytest.approx(0.9)
    assert p.min_p == pytest.approx(0.05) and p.repetition_penalty == pytest.approx(1.1)
    assert p.presence_penalty == pytest.approx(0.5)
    assert p.frequency_penalty == pytest.approx(-0.5)
    assert not p.HasField("logprobs")
    async with stack.client() as client:
        await client.completions.create(model=MODEL_NAME, prompt="hi")
        with pytest.raises(openai.BadRequestError) as refused:
            await client.completions.create(
                model=MODEL_NAME, prompt="hi", extra_body={"num_speculative_tokens": 17}
            )
    assert not stack.worker.requests[-1].params.HasField("num_speculative_tokens")  # unset
    assert refused.value.body["param"] == "num_speculative_tokens"


async def test_logprobs(stack):
    async with stack.client() as client:
        chat = await client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "hi"}],
            logprobs=True,
            top_logprobs=2,
        )
        completion = await client.completions.create(model=MODEL_NAME, prompt="hi", logprobs=1)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and content[0].logprob == pytest.approx(-0.25)
    assert [t.logprob for t in content[0].top_logprobs] == pytest.approx([-0.25, -1.25])
    assert stack.worker.requests[-2].params.logprobs == 2
    lp = completion.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([-0.25] * 4)
    assert len(lp.top_logprobs) == 4 and all(len(t) == 1 for t in lp.top_logprobs)


async def test_adapter_request_carries_the_adapter(stack, tmp_path):
    path = write_adapter(tmp_path / "sql")
    record = (
        await stack.admin.post(
            "/admin/tenants/acme/adapters", json={"name": "sql", "path": str(path)}
        )
    ).json()
    async with stack.client() as client:
        out = await client.completions.create(model="sql", prompt="SELECT")
    assert out.model == "sql"
    sent = stack.worker.requests[-1]
    # By content id only (the wire has no path field): the worker reads its own store.
    assert sent.adapter_id == record["adapter_id"]
    assert "adapter_path" not in sent.DESCRIPTOR.fields_by_name


async def test_request_errors_in_openai_format(stack):
    cases = [
        ({"model": MODEL_NAME, "prompt": ["a", "b"]}, 400, None),
        ({"model": MODEL_NAME, "prompt": "hi", "max_tokens": 10_000}, 400, None),
        ({"model": MODEL_NAME, "prompt": "hi", "max_tokens": "many"}, 400, "invalid_value"),
        ({"model": MODEL_NAME}, 400, "invalid_value"),
        ({"model": "no-such-model", "prompt": "hi"}, 404, "model_not_found"),
    ]
    async with stack.http() as http:
        for body, status, code in cases:
            response = await http.post("/v1/completions", json=body)
            assert response.status_code == status, (body, response.text)
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert error["type"] == "invalid_request_error"
            if code:
                assert error["code"] == code
        malformed = await http.post(
            "/v1/chat/completions",
            content=b"{not json",
            headers={"content-type": "application/json"},
        )
        assert malformed.status_code == 400 and "error" in malformed.json()
        empty = await http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": []})
        assert empty.status_code == 400 and empty.json()["error"]["param"] == "messages"
    async with stack.client() as client:
        with pytest.raises(openai.NotFoundError) as caught:
            await client.chat.completions.create(
                model="no-such-model", messages=[{"role": "user", "content": "hi"}]
            )
        assert caught.value.code == "model_not_found"


async def test_no_live_worker_is_503(stack):
    from runtime.registry import deregister

    await deregister(stack.redis, stack.prefix, "w1")
    async with stack.http() as http:
        for stream in (False, True):
            body = {"model": MODEL_NAME, "prompt": "hi", "stream": stream}
            response = await http.post("/v1/completions", json=body)
            assert response.status_code == 503
            assert response.json()["error"]["code"] == "no_worker_available"


def every_optional_argument_none(create, *required: str) -> dict:
    """Every argument of an SDK method but the required ones and the transport's, as None."""
    transport = {"extra_headers", "extra_query", "extra_body", "timeout"}
    names = inspect.signature(create).parameters
    return {name: None for name in names if name not in {*required, *transport}}


async def test_every_optional_argument_none_is_the_default(stack):
    """The SDK sends each None as JSON null: OpenAI reads null as the default."""
    async with stack.client() as client:
        completions = client.completions.create
        out = await completions(
            model=MODEL_NAME,
            prompt="Hello",
            **every_optional_argument_none(completions, "model", "prompt"),
        )
        assert out.choices[0].text == "Hello, world!"
        chat = client.chat.completions.create
        out = await chat(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "hi"}],
            **every_optional_argument_none(chat, "model", "messages"),
        )
        assert out.choices[0].message.content == "Hello, world!"
    assert stack.worker.requests[-2].params.max_tokens == 16  # the completions default


async def test_a_mix_of_adapters_goes_to_the_worker_by_content_id_and_weight(stack, tmp_path):
    ids = {}
    for i, name in enumerate(["sql", "poet"]):
        path = write_adapter(tmp_path / name, seed=i)
        body = {"name": name, "path": str(path)}
        ids[name] = (await stack.admin.post("/admin/tenants/acme/adapters", json=body)).json()[
            "adapter_id"
        ]
    mix = [{"name": "sql", "weight": 0.7}, {"name": "poet", "weight": 0.3}]
    async with stack.client() as client:
        out = await client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "hi"}],
            extra_body={"adapters": mix},
        )
    assert out.model == MODEL_NAME
    sent = stack.worker.requests[-1]
    assert sent.adapter_id == ""
    assert [(p.adapter_id, p.weight) for p in sent.adapter_mix] == [
        (ids["sql"], 0.7),
        (ids["poet"], 0.3),
    ]
    await stack.admin.post("/admin/tenants", json={"name": "globex"})
    await stack.admin.post(
        "/admin/tenants/globex/adapters",
        json={"name": "theirs", "path": str(write_adapter(tmp_path / "theirs", seed=9))},
    )
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    five = [{"name": "sql", "weight": 0.2}] * 5
    cases = [  # (body, status, code, param)
        ({"model": MODEL_NAME, "adapters": five}, 400, None, "adapters"),
        ({"model": MODEL_NAME, "adapters": []}, 400, None, "adapters"),
        ({"model": MODEL_NAME, "adapters": mix[:1] * 2}, 400, None, "adapters"),
        ({"model": MODEL_NAME, "adapters": [{"name": "sql", "weight": -1}]}, 400, None, None),
        ({"model": "sql", "adapters": mix}, 400, None, "model"),
        (
            {"model": MODEL_NAME, "adapters": [*mix[:1], {"name": "theirs", "weight": 1}]},
            404,
            "model_not_found",
            None,
        ),
        (
            {"model": MODEL_NAME, "adapters": [{"name": "nope", "weight": 1}]},
            404,
            "model_not_found",
            None,
        ),
    ]
    async with stack.http() as http:
        for body, status, code, param in cases:
            response = await http.post("/v1/chat/completions", json={**chat, **body})
            assert response.status_code == status, (body, response.text)
            error = response.json()["error"]
            assert error["type"] == "invalid_request_error"
            if code:
                assert error["code"] == code
            if param:
                assert error["param"] == param
        theirs = await http.post("/v1/chat/completions", json={**chat, "model": "theirs"})
        foreign = cases[5][0]
        mixed = await http.post("/v1/chat/completions", json={**chat, **foreign})
        assert mixed.json()["error"]["message"] == theirs.json()["error"]["message"]
        responses = await http.post(
            "/v1/responses", json={"model": MODEL_NAME, "input": "hi", "adapters": mix}
        )
        assert responses.status_code == 200, responses.text
    assert len(stack.worker.requests[-1].adapter_mix) == 2
