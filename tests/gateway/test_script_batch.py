"""ScriptBatcher against a real Redis: concurrent script calls share one pipelined round
trip, and each caller still gets exactly its own reply or error."""

from __future__ import annotations

import asyncio
import socket

import pytest
import redis.asyncio as aioredis
import redis.exceptions

from gateway.tenancy.script_batch import ScriptBatcher

# Echoes its key and argument; fails on demand, as a quota script can.
ECHO = """
if ARGV[1] == 'fail' then return redis.error_reply('asked to fail') end
redis.call('INCR', KEYS[1])
return {KEYS[1], ARGV[1]}
"""


class PipelineCount:
    """Counts the pipelines a client opens (the calls still go to Redis)."""

    def __init__(self, client: aioredis.Redis, monkeypatch) -> None:
        self.opened = 0
        real = client.pipeline

        def counting(*args, **kwargs):
            self.opened += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(client, "pipeline", counting)


async def test_concurrent_calls_share_one_round_trip_and_get_their_own_replies(
    redis_client, redis_prefix, monkeypatch
):
    client = redis_client
    script = client.register_script(ECHO)
    batcher = ScriptBatcher(client)
    pipelines = PipelineCount(client, monkeypatch)
    keys = [f"{redis_prefix}k{i}" for i in range(20)]
    replies = await asyncio.gather(
        *(batcher.run(script, keys=[key], args=[f"v{i}"]) for i, key in enumerate(keys))
    )
    assert replies == [[key, f"v{i}"] for i, key in enumerate(keys)]
    assert pipelines.opened == 1
    assert [int(v) for v in await client.mget(keys)] == [1] * 20  # each ran exactly once


async def test_one_failing_script_fails_only_its_caller(redis_client, redis_prefix):
    client = redis_client
    script = client.register_script(ECHO)
    batcher = ScriptBatcher(client)
    outcomes = await asyncio.gather(
        *(
            batcher.run(script, keys=[f"{redis_prefix}k{i}"], args=[arg])
            for i, arg in enumerate(["a", "fail", "c"])
        ),
        return_exceptions=True,
    )
    assert outcomes[0] == [f"{redis_prefix}k0", "a"]
    assert isinstance(outcomes[1], redis.exceptions.ResponseError)
    assert "asked to fail" in str(outcomes[1])
    assert outcomes[2] == [f"{redis_prefix}k2", "c"]


async def test_a_flushed_script_cache_is_reloaded(redis_client, redis_prefix):
    client = redis_client
    script = client.register_script(ECHO)
    batcher = ScriptBatcher(client)
    await batcher.run(script, keys=[f"{redis_prefix}warm"], args=["x"])
    await client.script_flush()  # as after a Redis restart: EVALSHA answers NOSCRIPT
    replies = await asyncio.gather(
        *(batcher.run(script, keys=[f"{redis_prefix}k{i}"], args=[str(i)]) for i in range(5))
    )
    assert replies == [[f"{redis_prefix}k{i}", str(i)] for i in range(5)]
    assert await client.get(f"{redis_prefix}k3") == "1"  # not run twice by the retry


async def test_a_cancelled_caller_leaves_the_others_their_replies(redis_client, redis_prefix):
    client = redis_client
    script = client.register_script(ECHO)
    batcher = ScriptBatcher(client)
    first = asyncio.ensure_future(batcher.run(script, keys=[f"{redis_prefix}a"], args=["a"]))
    second = asyncio.ensure_future(batcher.run(script, keys=[f"{redis_prefix}b"], args=["b"]))
    await asyncio.sleep(0)  # both queued in one batch
    first.cancel()
    assert await second == [f"{redis_prefix}b", "b"]
    with pytest.raises(asyncio.CancelledError):
        await first
    await batcher.close()


async def test_redis_unreachable_fails_every_caller_with_a_redis_error():
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    client = aioredis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.5)
    script = client.register_script(ECHO)
    batcher = ScriptBatcher(client)
    outcomes = await asyncio.gather(
        *(batcher.run(script, keys=["k"], args=[str(i)]) for i in range(3)),
        return_exceptions=True,
    )
    assert all(isinstance(o, redis.exceptions.ConnectionError) for o in outcomes), outcomes
    await client.aclose()
