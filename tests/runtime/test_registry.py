"""The worker registry against a real Redis: the exact key format, TTL expiry, sweeping."""

from __future__ import annotations

import asyncio
import json
import sys

import pytest
from redis.asyncio import Redis

from runtime import registry
from runtime.registry import WorkerInfo


@pytest.fixture
async def redis(redis_url):
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()


def make_info(worker_id: str = "w1", **fields) -> WorkerInfo:
    defaults = dict(
        address="127.0.0.1:50051",
        model="tiny",
        base_id="c" * 64,
        model_path="/models/tiny",
        adapters=["a" * 64],
        slot_adapters=["a" * 64, None],
        loading_adapters=["d" * 64],
        host_adapters=["b" * 64, "a" * 64],
        host_cache_bytes=4096,
        host_cache_limit=1 << 30,
        running=2,
        waiting=1,
        free_kv_blocks=30,
        total_kv_blocks=64,
        heartbeat_at=1_700_000_000.5,
    )
    return WorkerInfo(worker_id=worker_id, **(defaults | fields))


async def test_register_writes_the_documented_format(redis, redis_prefix):
    info = make_info()
    await registry.register(redis, redis_prefix, info, ttl=10)

    raw = await redis.get(f"{redis_prefix}worker:w1")
    assert json.loads(raw) == {
        "worker_id": "w1",
        "address": "127.0.0.1:50051",
        "model": "tiny",
        "base_id": "c" * 64,
        "model_path": "/models/tiny",
        "adapters": ["a" * 64],
        "slot_adapters": ["a" * 64, None],
        "loading_adapters": ["d" * 64],
        "host_adapters": ["b" * 64, "a" * 64],
        "host_cache_bytes": 4096,
        "host_cache_limit": 1 << 30,
        "running": 2,
        "waiting": 1,
        "free_kv_blocks": 30,
        "total_kv_blocks": 64,
        "heartbeat_at": 1_700_000_000.5,
    }
    assert 0 < await redis.ttl(f"{redis_prefix}worker:w1") <= 10
    assert await redis.smembers(f"{redis_prefix}workers") == {b"w1"}
    assert await registry.live_workers(redis, redis_prefix) == [info]


async def test_heartbeat_refreshes_the_record_and_its_ttl(redis, redis_prefix):
    await registry.register(redis, redis_prefix, make_info(running=0), ttl=5)
    await registry.heartbeat(redis, redis_prefix, make_info(running=7), ttl=10)

    assert [w.running for w in await registry.live_workers(redis, redis_prefix)] == [7]
    assert await redis.ttl(f"{redis_prefix}worker:w1") > 5


async def test_live_workers_drops_and_sweeps_expired_workers(redis, redis_prefix):
    await registry.register(redis, redis_prefix, make_info("short"), ttl=1)
    await registry.register(redis, redis_prefix, make_info("long"), ttl=10)
    assert [w.worker_id for w in await registry.live_workers(redis, redis_prefix)] == [
        "long",
        "short",
    ]

    await asyncio.sleep(1.3)

    assert [w.worker_id for w in await registry.live_workers(redis, redis_prefix)] == ["long"]
    assert await redis.smembers(f"{redis_prefix}workers") == {b"long"}


async def test_deregister_removes_at_once(redis, redis_prefix):
    await registry.register(redis, redis_prefix, make_info("w1"))
    await registry.register(redis, redis_prefix, make_info("w2"))

    await registry.deregister(redis, redis_prefix, "w1")

    assert [w.worker_id for w in await registry.live_workers(redis, redis_prefix)] == ["w2"]
    assert await redis.exists(f"{redis_prefix}worker:w1") == 0
    assert await redis.smembers(f"{redis_prefix}workers") == {b"w2"}


async def test_no_workers(redis, redis_prefix):
    assert await registry.live_workers(redis, redis_prefix) == []


async def test_malformed_entries_are_skipped_and_unknown_fields_ignored(redis, redis_prefix):
    await redis.sadd(f"{redis_prefix}workers", "bad", "newer")
    await redis.set(f"{redis_prefix}worker:bad", "{not json", ex=10)
    newer = json.loads(make_info("newer").to_json()) | {"field_from_the_future": 1}
    await redis.set(f"{redis_prefix}worker:newer", json.dumps(newer), ex=10)

    assert await registry.live_workers(redis, redis_prefix) == [make_info("newer")]


def test_prefix_default_and_no_heavy_imports():
    assert registry.DEFAULT_PREFIX == "sb:"
    assert registry.worker_key("sb:", "w") == "sb:worker:w"
    assert registry.workers_key("sb:") == "sb:workers"
    # The gateway imports this module: it must not drag in the engine.
    import subprocess

    code = (
        "import sys, runtime.registry; "
        "bad = [m for m in ('torch', 'worker', 'transformers') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


async def test_an_older_workers_record_loads_without_slots_and_host_cache(redis, redis_prefix):
    older = json.loads(make_info("old").to_json())
    for name in ("slot_adapters", "host_adapters", "host_cache_bytes", "host_cache_limit"):
        del older[name]
    await redis.sadd(f"{redis_prefix}workers", "old")
    await redis.set(f"{redis_prefix}worker:old", json.dumps(older), ex=10)
    (info,) = await registry.live_workers(redis, redis_prefix)
    assert info.slot_adapters == info.host_adapters == [] and info.host_cache_limit == 0
