"""Reliability under faults and load, bounded in time, loopback only.

- Redis goes away and comes back: requests get a clear 503 quickly while it is down (nothing
  hangs), readiness reports it, and the same gateway serves again once Redis is back.
- A slow client that stops reading a stream: the gateway's memory stays bounded.
- Load: 200 concurrent streaming clients through the real stack (gateway process, worker
  process with a tiny model, Redis) for a bounded time: no errors, and afterwards no KV
  block or quota slot is left taken, and the gateway's RSS stays flat after warm-up.
"""

from __future__ import annotations

import asyncio
import os
import time

import httpx
import psutil
import pytest
import redis.asyncio as aioredis

from factories import add_byte_level_tokenizer, make_checkpoint
from gateway import metrics
from gateway.tenancy.quotas import tenant_key
from gateway_support import (
    MODEL_NAME,
    gateway_settings,
    gateway_with_worker,
)
from rpc import worker_pb2, worker_pb2_grpc
from runtime.embedded_redis import EmbeddedRedis, free_port
from runtime.stack import Stack

CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}]}


async def test_redis_outage_is_a_quick_503_and_the_gateway_recovers(model_dir, tmp_path):
    redis = EmbeddedRedis().start()
    try:
        settings = gateway_settings(
            redis_url=redis.url, prefix="sbrel:", model_dir=model_dir, store=tmp_path / "s"
        )
        async with gateway_with_worker(settings) as live:
            headers = {"Authorization": f"Bearer {live.keys['acme']}"}
            async with httpx.AsyncClient(base_url=live.gw.url, headers=headers) as client:
                assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200

                redis.shut_down_saving()
                errors = counted(metrics.REDIS_ERRORS)
                started = time.monotonic()
                down = await client.post("/v1/chat/completions", json=CHAT)
                assert time.monotonic() - started < 3.0  # at once, not after redis_timeout_s (5 s)
                assert down.status_code == 503
                assert down.json()["error"]["code"] == "state_unavailable"
                assert counted(metrics.REDIS_ERRORS) == errors + 1
                assert (await client.get("/ready")).status_code == 503
                assert (await client.get("/health")).status_code == 200  # alive, not ready

                redis.start()  # same port, same data: a restart
                back = await client.post("/v1/chat/completions", json=CHAT)
                assert back.status_code == 200, back.text
                assert (await client.get("/ready")).status_code == 200
    finally:
        redis.stop()


def counted(metric, **labels) -> float:
    """A counter's total (of the labelled child, if labels are given), read as Prometheus
    would collect it."""
    return sum(
        s.value
        for family in metric.collect()
        for s in family.samples
        if s.name.endswith("_total") and all(s.labels.get(k) == v for k, v in labels.items())
    )


async def test_redis_down_with_quota_fail_mode_open_serves_unmetered(model_dir, tmp_path):
    """``quota_fail_mode=open``: while Redis is down a tenant whose key the gateway has just
    seen keeps being served (its quota unmetered, counted); ``closed`` (the default, above)
    refuses with 503. Keys and workers seen within their cache time need no Redis."""
    redis = EmbeddedRedis().start()
    try:
        settings = gateway_settings(
            redis_url=redis.url, prefix="sbopen:", model_dir=model_dir, store=tmp_path / "s",
            quota_fail_mode="open", api_key_cache_s=60.0, worker_cache_s=60.0,
        )  # fmt: skip
        async with gateway_with_worker(settings) as live:
            headers = {"Authorization": f"Bearer {live.keys['acme']}"}
            async with httpx.AsyncClient(base_url=live.gw.url, headers=headers) as client:
                assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
                admitted = counted(metrics.QUOTA_REDIS_ERRORS, outcome="admitted")

                redis.shut_down_saving()
                started = time.monotonic()
                served = await client.post("/v1/chat/completions", json=CHAT)
                assert time.monotonic() - started < 3.0
                assert served.status_code == 200, served.text
                assert served.json()["choices"][0]["message"]["content"]
                assert counted(metrics.QUOTA_REDIS_ERRORS, outcome="admitted") == admitted + 1
                redis.start()  # back: metered again (and the fixture's cleanup needs it)
                assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
                assert counted(metrics.QUOTA_REDIS_ERRORS, outcome="admitted") == admitted + 1
    finally:
        redis.stop()


async def test_a_client_that_stops_reading_does_not_grow_the_gateway(
    redis_url, redis_prefix, model_dir, tmp_path
):
    """The stream blocks on the socket (flow control) instead of buffering without bound."""
    settings = gateway_settings(
        redis_url=redis_url, prefix=redis_prefix, model_dir=model_dir, store=tmp_path / "s"
    )
    async with gateway_with_worker(settings) as live:
        live.worker.pieces = tuple("x" * 4096 for _ in range(200))  # ~800 KB per stream
        port = int(live.gw.url.rsplit(":", 1)[1])
        process = psutil.Process(os.getpid())
        body = (
            b'{"model": "%s", "prompt": "x", "max_tokens": 200, "stream": true}'
            % MODEL_NAME.encode()
        )
        request = (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer %s\r\nContent-Length: %d\r\n\r\n%s"
            % (live.keys["acme"].encode(), len(body), body)
        )
        before = process.memory_info().rss
        stalled = []
        for _ in range(20):  # 20 clients that send, read the first bytes, then never read
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(request)
            await reader.read(100)
            stalled.append(writer)
        await asyncio.sleep(2.0)
        grown = process.memory_info().rss - before
        for writer in stalled:
            writer.close()
        # Unbounded buffering would hold 20 x 800 KB = 16 MB of text (more as Python objects).
        assert grown < 12 << 20, grown


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = make_checkpoint(
        tmp_path_factory.mktemp("load-model"), vocab_size=512, max_position_embeddings=512, seed=8
    )
    return add_byte_level_tokenizer(path)


# 20 s keeps 200 clients streaming through a few thousand requests (the RSS check compares
# the two halves); SWITCHBOARD_LOAD_TEST_SECONDS runs it longer by hand.
LOAD_SECONDS = float(os.environ.get("SWITCHBOARD_LOAD_TEST_SECONDS", "15"))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_200_streaming_clients_leave_no_leaks(tiny_model, redis_url, tmp_path):
    prefix = f"sbload:{os.getpid()}:"
    with Stack(
        model=tiny_model,
        redis_url=redis_url,
        gateway_port=free_port(),
        dtype="float32",
        key_prefix=prefix,
        home=tmp_path / "home",
        worker_args=["--max-num-seqs", "256"],
    ) as stack:
        key = stack.create_tenant_key("load")
        stack.admin("PUT", "/tenants/load/quotas", json={"max_concurrent_requests": 1000})
        gateway = psutil.Process(stack.gateway.pid)
        report = asyncio.run(_load(stack, key, gateway, clients=200, seconds=LOAD_SECONDS))
        assert report["errors"] == [], report["errors"][:5]
        assert report["streams"] >= 200
        stats = asyncio.run(_worker_stats(stack))
        assert stats.running == stats.waiting == 0
        assert stats.free_kv_blocks == stats.total_kv_blocks
        assert asyncio.run(_inflight(redis_url, prefix, "load")) == 0
        # Flat after warm-up: the last half grew the RSS by less than 15%.
        assert report["rss_end"] < report["rss_mid"] * 1.15, report


async def _load(stack: Stack, key: str, gateway: psutil.Process, *, clients: int, seconds: float):
    headers = {"Authorization": f"Bearer {key}"}
    body = {
        "model": stack.model.name, "prompt": "hello", "max_tokens": 24, "stream": True,
        "ignore_eos": True,
    }  # fmt: skip
    errors: list[str] = []
    streams = 0
    deadline = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=clients + 8)
    async with httpx.AsyncClient(
        base_url=stack.base_url, headers=headers, timeout=120, limits=limits
    ) as client:

        async def one_client() -> None:
            nonlocal streams
            while time.monotonic() < deadline:
                try:
                    async with client.stream("POST", "/v1/completions", json=body) as reply:
                        text = (await reply.aread()).decode()
                    if reply.status_code != 200 or '"error"' in text or "[DONE]" not in text:
                        errors.append(f"{reply.status_code}: {text[:200]}")
                    streams += 1
                except httpx.HTTPError as exc:
                    errors.append(repr(exc))

        async def sample_rss() -> dict:
            await asyncio.sleep(seconds / 2)
            mid = gateway.memory_info().rss
            await asyncio.sleep(max(0.0, deadline - time.monotonic()))
            return {"rss_mid": mid, "rss_end": gateway.memory_info().rss}

        *_, rss = await asyncio.gather(*(one_client() for _ in range(clients)), sample_rss())
    return {"errors": errors, "streams": streams, **rss}


async def _worker_stats(stack: Stack) -> worker_pb2.StatsResponse:
    (worker_id,) = stack.worker_ports
    async with stack.worker_channel(worker_id, aio=True) as channel:  # mutual TLS
        return await worker_pb2_grpc.WorkerStub(channel).Stats(worker_pb2.StatsRequest())


async def _inflight(redis_url: str, prefix: str, tenant: str) -> int:
    client = aioredis.Redis.from_url(redis_url)
    try:
        return await client.zcard(tenant_key(prefix, tenant, "inflight"))
    finally:
        await client.aclose()
