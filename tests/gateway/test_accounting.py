"""Accounting that cannot be dodged: once admitted, a request pays its prompt and every token
the worker generated, whether its client read them or not.

Real parts only: the gateway under uvicorn, a real worker (gRPC server, AsyncEngine, a tiny
random checkpoint) in this event loop, real Redis. The engine is slowed down per step so a
client can leave at a chosen moment; it also records what it generated per request, the
oracle the charges are checked against.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
import httpx
import pytest
import redis.asyncio as aioredis

from factories import add_byte_level_tokenizer, make_checkpoint
from gateway.tenancy.quotas import tenant_key
from gateway.tenancy.usage import usage_key
from gateway_support import (
    ADMIN_TOKEN,
    MODEL_NAME,
    create_tenant_key,
    delete_prefix,
    gateway_settings,
    running_gateway,
)
from rpc import worker_pb2, worker_pb2_grpc
from worker import LLMEngine
from worker.core.config import engine_config
from worker.serving.server import WorkerServer

PROMPT = "the quick brown fox jumps over the lazy dog"


class CountingEngine(LLMEngine):
    """A real engine that sleeps `step_delay_s` before each step and records, per request,
    the tokens it generated (its last output's count: steps and aborts alike)."""

    step_delay_s = 0.02

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.generated: dict[str, int] = {}
        self.prompts: dict[str, int] = {}

    def _note(self, out) -> None:
        self.generated[out.request_id] = len(out.token_ids)
        self.prompts[out.request_id] = out.num_prompt_tokens

    def step(self):
        time.sleep(self.step_delay_s)
        outputs = super().step()
        for out in outputs:
            self._note(out)
        return outputs

    def abort(self, request_id):
        out = super().abort(request_id)
        if out is not None:
            self._note(out)
        return out


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = make_checkpoint(
        tmp_path_factory.mktemp("acct-model"), vocab_size=512, max_position_embeddings=1024, seed=5
    )
    return add_byte_level_tokenizer(path)


class Env:
    def __init__(self, url, engine, redis, prefix, key, worker_address):
        self.url, self.engine, self.redis, self.prefix, self.key = url, engine, redis, prefix, key
        self.worker_address = worker_address

    def http(self, **kwargs) -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {self.key}"}
        return httpx.AsyncClient(base_url=self.url, headers=headers, timeout=30, **kwargs)

    async def until_generating(self, at_least: int = 0) -> None:
        """Until the engine holds the request (and generated `at_least` tokens for it)."""
        deadline = time.monotonic() + 10
        while not (self.engine.requests and sum(self.engine.generated.values()) >= at_least):
            assert time.monotonic() < deadline, (self.engine.requests, self.engine.generated)
            await asyncio.sleep(0.002)

    async def until_settled(self) -> dict[str, int]:
        """The tenant's usage counters for the base model, once the request is settled."""
        key = usage_key(self.prefix, "acme", time.strftime("%Y-%m-%d", time.gmtime()))
        deadline = time.monotonic() + 10
        while True:
            usage = await self.redis.hgetall(key)
            inflight = await self.redis.zcard(tenant_key(self.prefix, "acme", "inflight"))
            if usage and not inflight and not self.engine.requests:
                return {k.rpartition("|")[2]: int(v) for k, v in usage.items()}
            assert time.monotonic() < deadline, f"never settled: {usage}"
            await asyncio.sleep(0.02)

    async def tokens_in_window(self) -> int:
        return int(await self.redis.get(tenant_key(self.prefix, "acme", "tokens_total")) or 0)


@pytest.fixture
async def env(tiny_model, redis_url, redis_prefix, tmp_path):
    settings = gateway_settings(
        redis_url=redis_url,
        prefix=redis_prefix,
        model_dir=tiny_model,
        store=tmp_path / "store",
        request_timeout_s=30.0,
    )
    redis = aioredis.Redis.from_url(redis_url, decode_responses=True)
    engines: list[CountingEngine] = []

    def build() -> CountingEngine:
        engines.append(CountingEngine(tiny_model, engine_config(dtype="float32", num_kv_blocks=64)))
        return engines[-1]

    worker = WorkerServer(build, model_name=MODEL_NAME, redis=redis, redis_prefix=redis_prefix)
    await worker.start()
    try:
        async with running_gateway(settings) as gw:
            key = await create_tenant_key(gw, "acme")
            async with httpx.AsyncClient(base_url=gw.url) as admin:
                quota = {"tokens_per_minute": 1_000_000, "max_concurrent_requests": 4}
                headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
                reply = await admin.put("/admin/tenants/acme/quotas", json=quota, headers=headers)
                assert reply.status_code == 200, reply.text
            yield Env(gw.url, engines[0], redis, redis_prefix, key, worker.address)
    finally:
        await worker.shutdown(drain_timeout=2.0)
        await delete_prefix(redis_url, redis_prefix)
        await redis.aclose()


def body(**extra) -> dict:
    return {
        "model": MODEL_NAME,
        "prompt": PROMPT,
        "max_tokens": 400,
        "ignore_eos": True,
        "temperature": 0,
        **extra,
    }


async def _expect_charged(env: Env) -> None:
    usage = await env.until_settled()
    generated = sum(env.engine.generated.values())
    prompt = next(iter(env.engine.prompts.values()))
    assert 0 < generated < 400  # it left before the end
    assert usage["completion_tokens"] == generated
    assert usage["prompt_tokens"] == prompt
    assert usage["requests"] == 1
    # The token window keeps exactly what was used: the rest of the reservation came back.
    assert await env.tokens_in_window() == prompt + generated


async def test_a_client_that_leaves_before_the_first_token_pays_what_was_generated(env):
    env.engine.step_delay_s = 0.3  # the prefill step is still running when the client leaves
    async with env.http() as client:
        leaving = asyncio.create_task(client.post("/v1/completions", json=body(stream=True)))
        await env.until_generating()
        leaving.cancel()  # no response has started: the gateway waits for the first token
        with contextlib.suppress(asyncio.CancelledError):
            await leaving
    await _expect_charged(env)


async def test_a_client_that_leaves_mid_stream_pays_every_generated_token(env):
    async with (
        env.http() as client,
        client.stream("POST", "/v1/completions", json=body(stream=True)) as response,
    ):
        assert response.status_code == 200
        seen = 0
        async for line in response.aiter_lines():
            seen += line.startswith("data:")
            if seen == 3:  # three tokens read; the worker runs on until the client leaves
                await env.until_generating(at_least=10)
                break
    await _expect_charged(env)


async def test_a_client_that_leaves_a_non_streaming_call_pays_every_generated_token(env):
    async with env.http() as client:
        leaving = asyncio.create_task(client.post("/v1/completions", json=body()))
        await env.until_generating(at_least=10)
        leaving.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await leaving
    await _expect_charged(env)


async def test_abort_reports_only_to_the_requests_own_tenant(env):
    """The worker's Abort: another tenant's caller finds nothing and stops nothing; the
    owner gets every sample's count, and gets it again just after the call ended."""
    env.engine.step_delay_s = 0.005
    prompt_ids = list(range(3, 40))
    request = worker_pb2.GenerateRequest(
        request_id="acct-1",
        prompt_token_ids=prompt_ids,
        params=worker_pb2.SamplingParams(max_tokens=300, ignore_eos=True, n=2),
        tenant="acme",
    )
    async with grpc.aio.insecure_channel(env.worker_address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        call = stub.Generate(request)
        for _ in range(4):
            await call.read()
        stranger = await stub.Abort(worker_pb2.AbortRequest(request_id="acct-1", tenant="evil"))
        assert not stranger.found
        assert (await call.read()).finish_reason == ""  # still running
        owner = await stub.Abort(worker_pb2.AbortRequest(request_id="acct-1", tenant="acme"))
        rest = []
        while (message := await call.read()) is not grpc.aio.EOF:
            rest.append(message)
        assert {m.finish_reason for m in rest if m.finish_reason} == {"abort"}
        again = await stub.Abort(worker_pb2.AbortRequest(request_id="acct-1", tenant="acme"))
    generated = sum(env.engine.generated.values())
    assert owner.found and again.found
    assert owner.prompt_tokens == again.prompt_tokens == len(prompt_ids)
    assert owner.completion_tokens == again.completion_tokens == generated
    assert 4 <= generated < 600
