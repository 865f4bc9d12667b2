"""Fair scheduling through the real gateway: tenants' tiers and weights (admin API, CLI,
Redis), the weight reaching the worker in GenerateRequest.tenant_weight, a default
concurrency limit for new tenants, and the fair queue when the worker is saturated (429 with
Retry-After beside a tenant still served, timeouts, clients leaving while queued)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from dataclasses import dataclass, field

import httpx
import pytest
import redis.asyncio as aioredis
from pydantic import ValidationError

from gateway import metrics
from gateway.settings import GatewaySettings
from gateway.tenancy.quotas import tenant_key
from gateway.tenancy.weights import TenantWeights
from gateway_support import (
    ADMIN_TOKEN,
    MODEL_NAME,
    ScriptedWorker,
    create_tenant_key,
    delete_prefix,
    gateway_settings,
    running_gateway,
)

BODY = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 4}


@dataclass
class GatedWorker(ScriptedWorker):
    """A ScriptedWorker whose calls wait for `gate` before their first token: the requests
    in flight on it stay there until the test opens it."""

    gate: asyncio.Event = field(default_factory=asyncio.Event)

    async def _script(self, request, context):
        await self.gate.wait()
        async for message in super()._script(request, context):
            yield message


@dataclass
class Env:
    gw: object
    worker: GatedWorker
    redis: aioredis.Redis
    prefix: str
    keys: dict[str, str]

    def client(self, tenant: str, *, timeout: float = 10.0) -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {self.keys[tenant]}"}
        return httpx.AsyncClient(base_url=self.gw.url, headers=headers, timeout=timeout)

    def admin(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.gw.url, headers=self.gw.admin_headers)

    async def metric(self, name: str, **labels: str) -> float:
        async with self.admin() as admin:
            text = (await admin.get("/metrics")).text
        want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        for line in text.splitlines():
            if line.startswith(f"{name}{{{want}}} "):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    async def wait_for(self, condition, timeout: float = 5.0) -> None:
        async with asyncio.timeout(timeout):
            while not await condition():
                await asyncio.sleep(0.01)


@pytest.fixture
async def env(redis_url, redis_prefix, model_dir, tmp_path):
    """A gateway (with ``**settings``) before one GatedWorker; tenants a and b."""
    redis = aioredis.Redis.from_url(redis_url, decode_responses=True)
    stack = contextlib.AsyncExitStack()
    worker = GatedWorker("w1")

    async def start(**settings) -> Env:
        await worker.start()
        await worker.register(redis, redis_prefix)
        config = gateway_settings(
            redis_url=redis_url, prefix=redis_prefix, model_dir=model_dir,
            store=tmp_path / "store", **settings,
        )  # fmt: skip
        gw = await stack.enter_async_context(running_gateway(config))
        keys = {t: await create_tenant_key(gw, t) for t in ("a", "b")}
        return Env(gw, worker, redis, redis_prefix, keys)

    yield start
    worker.gate.set()
    await stack.aclose()
    await worker.stop()
    await delete_prefix(redis_url, redis_prefix)
    await redis.aclose()


async def test_the_tenants_weight_reaches_the_worker(env):
    """Default tier, a tier, a weight of its own: each is the next request's tenant_weight
    (a change through this gateway applies at once, despite the cache)."""
    live = await env()
    live.worker.gate.set()
    async with live.client("a") as a, live.client("b") as b, live.admin() as admin:
        assert (await a.post("/v1/completions", json=BODY)).status_code == 200
        assert (await b.post("/v1/completions", json=BODY)).status_code == 200
        await admin.put("/admin/tenants/a/scheduling", json={"tier": "premium"})
        assert (await a.post("/v1/completions", json={**BODY, "stream": True})).status_code == 200
        await admin.put("/admin/tenants/b/scheduling", json={"weight": 0.5})
        assert (await b.post("/v1/chat/completions", json=chat())).status_code == 200
    sent = [(r.tenant, r.tenant_weight) for r in live.worker.requests]
    assert sent == [("a", 2.0), ("b", 2.0), ("a", 4.0), ("b", 0.5)]


def chat() -> dict:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def test_scheduling_admin_api_validates_precisely(env):
    live = await env()
    async with live.admin() as admin:
        got = await admin.get("/admin/tenants/a/scheduling")
        assert got.json() == {"tenant": "a", "tier": None, "weight": 2.0, "source": "default"}
        put = await admin.put("/admin/tenants/a/scheduling", json={"tier": "premium"})
        assert put.json() == {"tenant": "a", "tier": "premium", "weight": 4.0, "source": "tier"}
        put = await admin.put("/admin/tenants/a/scheduling", json={"weight": 3})
        assert put.json() == {"tenant": "a", "tier": None, "weight": 3.0, "source": "weight"}
        assert (await admin.get("/admin/tenants/a/scheduling")).json() == put.json()
        for body, param in (
            ({"tier": "gold"}, "tier"),
            ({"tier": "free", "weight": 1}, "tier"),
            ({}, None),
            ({"weight": 0}, "weight"),
            ({"weight": -1}, "weight"),
            ({"weight": 1000.5}, "weight"),
        ):
            error = openai_error(await admin.put("/admin/tenants/a/scheduling", json=body), 400)
            assert error["param"] == param, body
        for raw in ("NaN", "Infinity", "1e999"):  # Python's JSON parser takes them
            reply = await admin.put(
                "/admin/tenants/a/scheduling", content=f'{{"weight": {raw}}}',
                headers={"content-type": "application/json"},
            )  # fmt: skip
            assert openai_error(reply, 400)["param"] == "weight", raw
        openai_error(await admin.put("/admin/tenants/a/scheduling", json={"rank": 1}), 422)
        openai_error(
            await admin.put("/admin/tenants/nobody/scheduling", json={"tier": "free"}), 404
        )
        openai_error(await admin.get("/admin/tenants/nobody/scheduling"), 404)
        reset = await admin.delete("/admin/tenants/a/scheduling")
        assert reset.json()["source"] == "default" and reset.json()["weight"] == 2.0
    async with httpx.AsyncClient(base_url=live.gw.url) as anonymous:
        openai_error(await anonymous.get("/admin/tenants/a/scheduling"), 401)
    # Nothing refused was stored.
    stored = await live.redis.hgetall(f"{live.prefix}tenant:a")
    assert "sched_tier" not in stored and "sched_weight" not in stored


def openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


async def test_scheduling_cli(env, capsys):
    from switchboard.cli import main

    live = await env()

    def cli(*words: str) -> tuple[int, str]:
        status = main([*words, "--url", live.gw.url, "--admin-token", ADMIN_TOKEN])
        captured = capsys.readouterr()
        return status, captured.out + captured.err

    status, out = await asyncio.to_thread(cli, "admin", "scheduling", "set", "a", "--tier", "free")
    assert status == 0 and json.loads(out) == {
        "tenant": "a", "tier": "free", "weight": 1.0, "source": "tier",
    }  # fmt: skip
    status, out = await asyncio.to_thread(cli, "admin", "scheduling", "set", "b", "--weight", "7")
    assert status == 0 and json.loads(out)["weight"] == 7.0
    status, out = await asyncio.to_thread(cli, "admin", "scheduling", "get", "b")
    assert status == 0 and json.loads(out)["source"] == "weight"
    status, out = await asyncio.to_thread(
        cli, "admin", "scheduling", "set", "b", "--tier", "free", "--weight", "2"
    )
    assert status == 1 and "error 400" in out and "exactly one" in out
    status, out = await asyncio.to_thread(cli, "admin", "scheduling", "set", "a", "--tier", "x")
    assert status == 1 and "unknown tier 'x'" in out
    status, out = await asyncio.to_thread(cli, "admin", "scheduling", "reset", "b")
    assert status == 0 and json.loads(out)["source"] == "default"


@pytest.mark.parametrize("limit, expected", [(None, 64), (5, 5), (0, None)])
async def test_new_tenants_get_the_default_concurrency_limit(env, limit, expected):
    settings = {} if limit is None else {"default_max_concurrent_requests": limit}
    live = await env(**settings)
    async with live.admin() as admin:
        quota = (await admin.get("/admin/tenants/a/quotas")).json()
        assert quota["max_concurrent_requests"] == expected
        assert quota["requests_per_minute"] is None  # nothing else is limited by default
        # An admin changes it like any limit.
        await admin.put("/admin/tenants/a/quotas", json={"max_concurrent_requests": 9})
        assert (await admin.get("/admin/tenants/a/quotas")).json()["max_concurrent_requests"] == 9


async def test_a_full_tenant_queue_is_429_with_retry_after_while_another_tenant_is_served(env):
    """One slot: a1 holds it, a2 waits (a's queue holds one), a3 is refused at once with
    Retry-After; b's request still queues, and is sent before a2 (a has been served)."""
    live = await env(worker_max_in_flight=1, tenant_queue_limit=1)
    # The registry is the process's: count what this test adds.
    refused = await live.metric("switchboard_queue_rejections_total", tenant="a", reason="full")
    waits = await live.metric("switchboard_queue_wait_seconds_count", tenant="b")
    async with live.client("a") as a, live.client("b") as b:
        a1 = asyncio.create_task(a.post("/v1/completions", json=BODY))
        await live.wait_for(lambda: _seen(live.worker, 1))
        a2 = asyncio.create_task(a.post("/v1/completions", json=BODY))
        await live.wait_for(lambda: _queued(live, "a", 1))
        a3 = await a.post("/v1/completions", json=BODY)
        assert a3.status_code == 429
        assert openai_error(a3, 429)["code"] == "rate_limit_exceeded"
        assert int(a3.headers["retry-after"]) >= 1 and int(a3.headers["retry-after-ms"]) >= 1
        b1 = asyncio.create_task(b.post("/v1/completions", json=BODY))
        await live.wait_for(lambda: _queued(live, "b", 1))
        live.worker.gate.set()
        replies = await asyncio.gather(a1, a2, b1)
    assert [r.status_code for r in replies] == [200, 200, 200]
    assert [r.tenant for r in live.worker.requests] == ["a", "b", "a"]
    for tenant in ("a", "b"):  # every reservation settled, the refused one's too
        assert await live.redis.zcard(tenant_key(live.prefix, tenant, "inflight")) == 0
    metric = live.metric
    assert (
        await metric("switchboard_queue_rejections_total", tenant="a", reason="full") == refused + 1
    )
    assert await metric("switchboard_queue_wait_seconds_count", tenant="b") == waits + 1
    assert await metric("switchboard_queued_requests", tenant="a") == 0


async def test_three_to_one_weights_give_three_to_one_slots_through_the_gateway(env):
    """Weights 3 and 1 set through the admin API; one slot, held while six requests of each
    tenant queue, a's first: while both wait, a is sent three for b's one."""
    live = await env(worker_max_in_flight=1)
    async with live.admin() as admin:
        await admin.put("/admin/tenants/a/scheduling", json={"weight": 3})
        await admin.put("/admin/tenants/b/scheduling", json={"weight": 1})
    async with live.client("a") as a, live.client("b") as b:
        replies = [asyncio.create_task(a.post("/v1/completions", json=BODY))]
        await live.wait_for(lambda: _seen(live.worker, 1))
        for tenant, client in (("a", a), ("b", b)):
            for i in range(1, 7):
                replies.append(asyncio.create_task(client.post("/v1/completions", json=BODY)))
                await live.wait_for(lambda: _queued(live, tenant, i))  # noqa: B023
        live.worker.gate.set()
        assert [r.status_code for r in await asyncio.gather(*replies)] == [200] * 13
    order = [r.tenant for r in live.worker.requests[1:]]
    served = {"a": 0, "b": 0}
    for tenant in order[:8]:  # a's six are sent within the first eight
        served[tenant] += 1
        assert abs(served["a"] / 3 - served["b"]) <= 1, order
    assert served == {"a": 6, "b": 2}, order
    assert [r.tenant_weight for r in live.worker.requests[1:]] == [
        3.0 if t == "a" else 1.0 for t in order
    ]


async def test_a_client_that_leaves_while_queued_leaves_the_queue_and_its_quota_slot(env):
    live = await env(worker_max_in_flight=1)
    async with live.client("a") as a, live.client("b", timeout=0.5) as b:
        a1 = asyncio.create_task(a.post("/v1/completions", json={**BODY, "stream": True}))
        await live.wait_for(lambda: _seen(live.worker, 1))
        b1 = asyncio.create_task(b.post("/v1/completions", json=BODY))
        await live.wait_for(lambda: _queued(live, "b", 1))
        inflight = tenant_key(live.prefix, "b", "inflight")
        assert await live.redis.zcard(inflight) == 1  # admitted: its quota slot is held
        with pytest.raises(httpx.ReadTimeout):  # the client gives up: its connection closes
            await b1
        await live.wait_for(lambda: _queued(live, "b", 0))
        await live.wait_for(lambda: _zcard_is(live.redis, inflight, 0))
        live.worker.gate.set()
        assert (await a1).status_code == 200
        # The slot it never took is a's again: the next request runs at once.
        assert (await a.post("/v1/completions", json=BODY)).status_code == 200
    assert [r.tenant for r in live.worker.requests] == ["a", "a"]


async def test_a_request_queued_past_the_queue_timeout_is_503_with_retry_after(env):
    live = await env(worker_max_in_flight=1, queue_timeout_s=0.2)
    async with live.client("a") as a, live.client("b") as b:
        a1 = asyncio.create_task(a.post("/v1/completions", json=BODY))
        await live.wait_for(lambda: _seen(live.worker, 1))
        waited = await b.post("/v1/chat/completions", json={**chat(), "stream": True})
        assert openai_error(waited, 503)["code"] == "queue_timeout"
        assert int(waited.headers["retry-after"]) >= 1
        live.worker.gate.set()
        assert (await a1).status_code == 200
    inflight = tenant_key(live.prefix, "b", "inflight")
    assert await live.redis.zcard(inflight) == 0  # its reservation was settled


async def _seen(worker: ScriptedWorker, count: int) -> bool:
    return len(worker.requests) >= count


async def _queued(live: Env, tenant: str, count: int) -> bool:
    return await live.metric("switchboard_queued_requests", tenant=tenant) == count


async def _zcard_is(redis: aioredis.Redis, key: str, count: int) -> bool:
    return await redis.zcard(key) == count


async def test_weights_seen_by_another_replica_within_the_cache_time(redis_client, redis_prefix):
    """Two gateways' caches on one Redis: a change through one is at once there, on the
    other once its entry expires; a Redis failure serves the last weight, never an error."""
    tiers = {"free": 1.0, "standard": 2.0}
    here, there = (
        TenantWeights(
            redis_client, prefix=redis_prefix, tiers=tiers, default_tier="free", cache_s=0.3
        )
        for _ in range(2)
    )
    assert await here.weight("t") == await there.weight("t") == 1.0
    await here.set_tier("t", "standard")
    assert await here.weight("t") == 2.0
    assert await there.weight("t") == 1.0  # cached
    await asyncio.sleep(0.35)
    assert await there.weight("t") == 2.0
    down = aioredis.Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.2)
    broken = TenantWeights(down, prefix=redis_prefix, tiers=tiers, default_tier="free",
                               cache_s=0.3)  # fmt: skip

    def errors() -> float:
        return metrics.REGISTRY.get_sample_value("switchboard_scheduling_lookup_errors_total")

    before = errors()
    assert await broken.weight("t") == 1.0
    assert await broken.weight("t") == 1.0  # the fallback is cached: Redis is asked once
    assert errors() == before + 1
    await down.aclose()


def test_tier_settings_are_checked(tmp_path, monkeypatch):
    base = {"admin_token": ADMIN_TOKEN, "model": tmp_path}
    monkeypatch.setenv("SWITCHBOARD_SCHEDULING_TIERS", '{"bronze": 1, "gold": 10}')
    monkeypatch.setenv("SWITCHBOARD_DEFAULT_SCHEDULING_TIER", "bronze")
    settings = GatewaySettings(**base)
    assert settings.scheduling_tiers == {"bronze": 1.0, "gold": 10.0}
    for tiers, default in (
        ({"free": 1.0}, "standard"),
        ({"free": 0.0}, "free"),
        ({"free": math.inf}, "free"),
        ({"Free!": 1.0}, "Free!"),
    ):
        with pytest.raises(ValidationError):
            GatewaySettings(**base, scheduling_tiers=tiers, default_scheduling_tier=default)
