"""Worker failures as the client sees them: a retry before the first token, an error event
mid-stream, deadlines, and a client that leaves (the worker's call is cancelled)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import grpc
import httpx
import openai
import pytest
import redis.asyncio as aioredis

from gateway_support import (
    MODEL_NAME,
    Mode,
    ScriptedWorker,
    delete_prefix,
    gateway_settings,
    running_gateway,
)


@pytest.fixture
async def env(redis_url, redis_prefix, model_dir, tmp_path):
    """Start a gateway (with `**settings`) and workers; yields a factory."""
    redis = aioredis.Redis.from_url(redis_url, decode_responses=True)
    workers: list[ScriptedWorker] = []
    stack = []

    async def start(*scripted: ScriptedWorker, loads=None, **settings):
        for i, worker in enumerate(scripted):
            await worker.start()
            workers.append(worker)
            await worker.register(redis, redis_prefix, running=(loads or [0] * 9)[i])
        gw_cm = running_gateway(
            gateway_settings(
                redis_url=redis_url,
                prefix=redis_prefix,
                model_dir=model_dir,
                store=tmp_path / "store",
                **settings,
            )
        )
        gw = await gw_cm.__aenter__()
        stack.append(gw_cm)
        async with httpx.AsyncClient(base_url=gw.url, headers=gw.admin_headers) as admin:
            await admin.post("/admin/tenants", json={"name": "acme"})
            key = (await admin.post("/admin/tenants/acme/keys")).json()["key"]
        return gw, key

    yield start
    for cm in stack:
        await cm.__aexit__(None, None, None)
    for worker in workers:
        await worker.stop()
    await delete_prefix(redis_url, redis_prefix)
    await redis.aclose()


def http(gw, key, timeout=10.0) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=gw.url, headers={"Authorization": f"Bearer {key}"}, timeout=timeout
    )


async def sse_lines(response: httpx.Response) -> list[str]:
    return [line async for line in response.aiter_lines() if line]


async def test_failure_before_first_token_is_retried_once_on_another_worker(env):
    broken = ScriptedWorker("a-broken", mode=Mode.FAIL_BEFORE_FIRST)
    healthy = ScriptedWorker("b-healthy")
    gw, key = await env(broken, healthy, loads=[0, 3])  # the broken one looks least loaded
    client = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0)
    async with client:
        out = await client.completions.create(model=MODEL_NAME, prompt="hi")
    assert out.choices[0].text == "Hello, world!"
    assert (len(broken.requests), len(healthy.requests)) == (1, 1)
    assert broken.requests[0].request_id == healthy.requests[0].request_id


def assert_no_internals(error: dict, workers: list[ScriptedWorker]) -> None:
    """A worker's failure as a tenant reads it: a stable code, no address, no gRPC status."""
    assert error["code"] == "worker_failed", error
    for worker in workers:
        assert worker.address not in error["message"]
    assert "going away" not in error["message"] and "crashed" not in error["message"]
    assert not any(c.name in error["message"] for c in grpc.StatusCode), error


async def test_two_failures_before_first_token_are_502(env, caplog):
    workers = [ScriptedWorker(name, mode=Mode.FAIL_BEFORE_FIRST) for name in "abc"]
    gw, key = await env(*workers)
    async with http(gw, key) as client:
        for stream in (False, True):
            body = {"model": MODEL_NAME, "prompt": "hi", "stream": stream}
            response = await client.post("/v1/completions", json=body)
            assert response.status_code == 502
            assert_no_internals(response.json()["error"], workers)
    # The detail is in the gateway's log, with the request id.
    tried = [r.getMessage() for r in caplog.records if "UNAVAILABLE" in r.getMessage()]
    assert tried and all(m.startswith("request ") and "127.0.0.1:" in m for m in tried)


async def test_failure_mid_stream_ends_with_an_error_event(env):
    worker = ScriptedWorker("w", mode=Mode.FAIL_MID_STREAM, fail_after=2)
    gw, key = await env(worker)
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    async with http(gw, key) as client:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            lines = await asyncio.wait_for(sse_lines(response), timeout=5)
        contents = [json.loads(x[6:])["choices"][0]["delta"]["content"] for x in lines[:2]]
        assert contents == ["Hello", ","]
        error = json.loads(lines[2].removeprefix("data: "))["error"]
        assert set(error) >= {"message", "type"}
        assert_no_internals(error, [worker])
        assert lines[3:] == ["data: [DONE]"]
        # Not streaming, the same failure is a 502.
        response = await client.post("/v1/chat/completions", json={**body, "stream": False})
        assert response.status_code == 502
        assert_no_internals(response.json()["error"], [worker])
    client = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0)
    async with client:
        stream = await client.completions.create(model=MODEL_NAME, prompt="hi", stream=True)
        with pytest.raises(openai.APIError):
            async for _ in stream:
                pass


async def test_client_disconnect_mid_stream_cancels_the_worker_call(env):
    worker = ScriptedWorker("w", mode=Mode.STALL)
    gw, key = await env(worker)
    body = {"model": MODEL_NAME, "prompt": "hi", "stream": True}
    async with (
        http(gw, key) as client,
        client.stream("POST", "/v1/completions", json=body) as response,
    ):
        first = await anext(response.aiter_lines())
        assert json.loads(first.removeprefix("data: "))["choices"][0]["text"] == "Hello"
    # Leaving the block closed the connection mid-stream.
    await asyncio.wait_for(worker.cancelled.wait(), timeout=5)


async def test_client_disconnect_while_waiting_cancels_the_worker_call(env):
    worker = ScriptedWorker("w", mode=Mode.STALL)
    gw, key = await env(worker)
    async with http(gw, key, timeout=0.5) as client:
        with pytest.raises(httpx.ReadTimeout):
            await client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hi"})
    await asyncio.wait_for(worker.cancelled.wait(), timeout=5)


async def test_deadline_is_504_or_an_error_event(env):
    worker = ScriptedWorker("w", mode=Mode.STALL)
    gw, key = await env(worker, request_timeout_s=0.5)
    async with http(gw, key) as client:
        response = await client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "x"})
        assert response.status_code == 504
        assert response.json()["error"]["code"] == "deadline_exceeded"
        body = {"model": MODEL_NAME, "prompt": "x", "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as streamed:
            lines = await asyncio.wait_for(sse_lines(streamed), timeout=5)
        assert json.loads(lines[-2].removeprefix("data: "))["error"]["code"] == "deadline_exceeded"
        assert lines[-1] == "data: [DONE]"


async def test_requests_for_an_adapter_go_to_the_worker_holding_it(env, tmp_path):
    from gateway_support import write_adapter

    holder, other = ScriptedWorker("holder"), ScriptedWorker("other")
    gw, key = await env(holder, other)
    async with httpx.AsyncClient(base_url=gw.url, headers=gw.admin_headers) as admin:
        body = {"name": "sql", "path": str(write_adapter(tmp_path / "sql"))}
        adapter_id = (await admin.post("/admin/tenants/acme/adapters", json=body)).json()[
            "adapter_id"
        ]
    redis = aioredis.Redis.from_url(gw.settings.redis_url, decode_responses=True)
    await holder.register(redis, gw.settings.key_prefix, adapters=(adapter_id,), running=2)
    await redis.aclose()
    async with http(gw, key) as client:
        for _ in range(4):
            response = await client.post("/v1/completions", json={"model": "sql", "prompt": "x"})
            assert response.status_code == 200
    assert (len(holder.requests), len(other.requests)) == (4, 0)


async def test_non_streaming_requests_are_one_unary_call_and_old_workers_still_serve(env):
    """Without `stream`, the gateway asks for the whole answer in one unary call
    (`GenerateAll`); a worker that predates it (UNIMPLEMENTED, mid rolling upgrade) is asked
    with the stream instead, and the client cannot tell. A worker failing the unary call
    is retried on another, as a stream failing before its first token is."""
    current = ScriptedWorker("a-current")
    gw, key = await env(current)
    body = {"model": MODEL_NAME, "prompt": "hi", "n": 2, "logprobs": 1}
    async with http(gw, key) as client:
        unary = await client.post("/v1/completions", json=body)
        streamed = await client.post("/v1/completions", json={**body, "stream": True})
        current.answers_unary = False
        old = await client.post("/v1/completions", json=body)
    assert current.rpcs == ["GenerateAll", "Generate", "Generate"]
    assert unary.status_code == old.status_code == streamed.status_code == 200
    assert [c["text"] for c in unary.json()["choices"]] == [current.text()] * 2
    assert [len(c["logprobs"]["tokens"]) for c in unary.json()["choices"]] == [4, 4]
    assert old.json()["choices"] == unary.json()["choices"]
    assert old.json()["usage"] == unary.json()["usage"]


async def test_a_unary_call_failing_mid_way_is_the_requests_error_not_retried(env):
    """INTERNAL mid-way is a request that failed alone in the engine (which isolates it and
    serves on): retried, a poisonous request would hop from worker to worker."""
    crashing = ScriptedWorker("a-crashing", mode=Mode.FAIL_MID_STREAM, fail_after=2)
    healthy = ScriptedWorker("b-healthy")
    gw, key = await env(crashing, healthy, loads=[0, 3])
    async with http(gw, key) as client:
        response = await client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hi"})
    assert response.status_code == 502, response.text
    assert response.json()["error"]["code"] == "worker_failed"
    assert (crashing.rpcs, healthy.rpcs) == (["GenerateAll"], [])


@dataclass
class Refusing(ScriptedWorker):
    """Fails every call with `code` before its first token; `code` None: serves as usual."""

    code: grpc.StatusCode | None = grpc.StatusCode.INTERNAL

    async def _script(self, request, context):
        if self.code is not None:
            await context.abort(self.code, f"{self.name} says {self.code.name}")
        async for message in super()._script(request, context):
            yield message


@pytest.mark.parametrize(
    ("code", "status", "retried", "marked_failed"),
    [
        (grpc.StatusCode.UNAVAILABLE, 200, True, True),  # shutting down, unreachable
        (grpc.StatusCode.CANCELLED, 200, True, True),  # its server stopped under the call
        (grpc.StatusCode.NOT_FOUND, 200, True, False),  # its store lacks the adapter
        (grpc.StatusCode.INVALID_ARGUMENT, 400, False, False),  # the request's values
        (grpc.StatusCode.INTERNAL, 502, False, False),  # the request failed alone
        (grpc.StatusCode.UNKNOWN, 502, False, False),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 502, False, False),  # e.g. a message too large
    ],
)
@pytest.mark.parametrize("stream", [False, True])
async def test_only_availability_failures_are_retried_or_blamed_on_the_worker(
    env, code, status, retried, marked_failed, stream
):
    """The first worker fails one request with `code`, then serves again. Only a failure of
    the worker itself routes the next request elsewhere; only transport, availability or a
    worker that lacks what another may have is worth a second try."""
    first, second = Refusing("a-first", code=code), ScriptedWorker("b-second")
    # The first looks least loaded; the registry is read once for both requests (a read
    # forgets which workers failed).
    gw, key = await env(first, second, loads=[0, 3], worker_cache_s=30.0)
    body = {"model": MODEL_NAME, "prompt": "hi", "stream": stream}
    async with http(gw, key) as client:
        response = await client.post("/v1/completions", json=body)
        assert response.status_code == status, response.text
        if status != 200:
            assert set(response.json()["error"]) >= {"message", "type", "code"}
        assert (len(first.rpcs), len(second.rpcs)) == (1, int(retried))
        first.code = None
        again = await client.post("/v1/completions", json=body)
    assert again.status_code == 200
    served_by = "b-second" if marked_failed else "a-first"
    assert (len(first.rpcs), len(second.rpcs)) == (
        1 + (served_by == "a-first"),
        int(retried) + (served_by == "b-second"),
    )


async def test_a_non_streaming_answer_over_grpcs_default_4_mb_gets_through(env):
    worker = ScriptedWorker("big", pieces=tuple("x" * 1_000_000 for _ in range(5)))
    gw, key = await env(worker)
    async with http(gw, key, timeout=30) as client:
        body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 5}
        response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text[:300]
    assert len(response.json()["choices"][0]["text"]) == 5_000_000
    assert worker.rpcs == ["GenerateAll"]


async def test_the_overhead_header_counts_the_gateway_and_not_the_worker(env):
    """x-switchboard-overhead-ms on streamed and unary answers: a worker that takes 1 s
    to its first token adds nothing to it, though the client waits that long."""
    gw, key = await env(ScriptedWorker("slow-start", first_token_delay_s=1.0))
    body = {"model": MODEL_NAME, "prompt": "hi"}
    async with http(gw, key) as client:
        unary = await client.post("/v1/completions", json=body)
        async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as sse:
            streamed_headers = sse.headers
            await sse.aread()
    for response_headers, kind in ((unary.headers, "unary"), (streamed_headers, "stream")):
        overhead_ms = float(response_headers["x-switchboard-overhead-ms"])
        # Under the worker's 1 s wait, which alone would reach it had it been counted.
        assert 0.0 < overhead_ms < 1000.0, (kind, overhead_ms)
    assert unary.elapsed.total_seconds() >= 1.0


async def test_a_unary_answer_places_its_first_token_by_the_workers_offset(env):
    """TTFT of a non-streaming request is when the worker had its first token, not when the
    whole answer arrived: a worker that answers 0.5 s after its first token."""
    from gateway import metrics

    def observed() -> tuple[float, float]:
        [family] = metrics.TIME_TO_FIRST_TOKEN.collect()
        values = {s.name: s.value for s in family.samples if not s.name.endswith("_bucket")}
        name = "switchboard_time_to_first_token_seconds"
        return values[f"{name}_count"], values[f"{name}_sum"]

    gw, key = await env(ScriptedWorker("slow-tail", unary_tail_s=0.5))
    count, total = observed()
    async with http(gw, key) as client:
        response = await client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hi"})
        assert response.status_code == 200
        waited = response.elapsed.total_seconds()
        assert waited >= 0.5
    after_count, after_total = observed()
    assert after_count == count + 1
    # The worker's 0.5 s after its first token is outside TTFT (the whole answer's time
    # would not be).
    assert 0.0 <= after_total - total <= waited - 0.5
