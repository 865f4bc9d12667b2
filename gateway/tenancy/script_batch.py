"""Lua script calls from many concurrent requests, sent to Redis in one pipelined round trip.

Every admitted request runs two quota scripts (admit, settle). Under load they come in
bursts (a worker step finishes many requests at once; keep-alive clients answer at once),
and each redis-py call costs the gateway CPU apart from Redis's own time (connection
checkout, packing, a socket write and read wake-up; docs/performance.md). Calls made in
the same event-loop turn are written as one pipeline (without MULTI: each script is atomic
by itself, and they are independent) and each caller gets its own reply or error.

redis-py's pipelines check every registered script with SCRIPT EXISTS before each
execute, a second round trip; here EVALSHA goes out directly and a NOSCRIPT reply (Redis
restarted or flushed its script cache) is retried through the script object, which loads
it first.
"""

from __future__ import annotations

import asyncio
from typing import Any

import redis.asyncio as aioredis
import redis.exceptions
from redis.commands.core import AsyncScript

Call = tuple[AsyncScript, list, list, asyncio.Future]


class ScriptBatcher:
    def __init__(self, client: aioredis.Redis) -> None:
        self.redis = client
        self._pending: list[Call] = []
        self._flushes: set[asyncio.Task] = set()

    async def run(self, script: AsyncScript, *, keys: list, args: list) -> Any:
        """The script's reply, as `script(keys=keys, args=args)` would give it."""
        loop = asyncio.get_running_loop()
        reply = loop.create_future()
        self._pending.append((script, keys, args, reply))
        if len(self._pending) == 1:
            loop.call_soon(self._flush_pending)
        return await reply

    def _flush_pending(self) -> None:
        batch, self._pending = self._pending, []
        # A task of its own: a caller that is cancelled does not cancel the others' calls.
        task = asyncio.ensure_future(self._send(batch))
        self._flushes.add(task)
        task.add_done_callback(self._flushes.discard)

    async def _send(self, batch: list[Call]) -> None:
        try:
            if len(batch) == 1:
                script, keys, args, reply = batch[0]
                _resolve(reply, await script(keys=keys, args=args))
                return
            async with self.redis.pipeline(transaction=False) as pipe:
                for script, keys, args, _ in batch:
                    pipe.evalsha(script.sha, len(keys), *keys, *args)
                replies = await pipe.execute(raise_on_error=False)
            for (script, keys, args, reply), outcome in zip(batch, replies, strict=True):
                if isinstance(outcome, redis.exceptions.NoScriptError):
                    outcome = await _run_alone(script, keys, args)
                _resolve(reply, outcome)
        except BaseException as exc:  # connection lost, timeout, or this task cancelled
            for *_, reply in batch:
                if reply.done():
                    continue
                if isinstance(exc, asyncio.CancelledError):
                    reply.cancel()
                else:
                    reply.set_exception(exc)
            if not isinstance(exc, Exception):
                raise

    async def close(self) -> None:
        """Let the calls already sent finish."""
        await asyncio.gather(*self._flushes, return_exceptions=True)


async def _run_alone(script: AsyncScript, keys: list, args: list) -> Any:
    try:
        return await script(keys=keys, args=args)
    except redis.exceptions.RedisError as exc:
        return exc


def _resolve(reply: asyncio.Future, outcome: Any) -> None:
    if reply.done():  # its caller was cancelled meanwhile
        return
    if isinstance(outcome, BaseException):
        reply.set_exception(outcome)
    else:
        reply.set_result(outcome)
