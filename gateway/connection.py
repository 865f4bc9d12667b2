"""The client's side of a request: when it arrived, whether it left, and the SSE response
that runs the request's settlement once it ends. Plumbing around the request path, no stage
of it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from fastapi import Request
from fastapi.sse import EventSourceResponse

from gateway.errors import ClientDisconnectedError
from gateway.interrupts import Interrupt

T = TypeVar("T")
# What proxies must not do to an event stream: cache it or buffer it.
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def arrival_of(request: Request) -> float:
    """When the request reached the app (``StampArrival``), else now."""
    return getattr(request.state, "arrived", None) or time.monotonic()


async def until_disconnect(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """Run `work` unless the client disconnects first; then cancel it (which cancels the
    worker call) and raise ClientDisconnectedError.

    `work` runs in the caller's own task, which a watch for the disconnect interrupts: one
    task per request fewer than racing two (`first_of`), ~3% of the gateway's CPU under
    load."""
    watch = asyncio.ensure_future(_disconnected(request))
    gone = Interrupt(watch, lambda watched: watched.exception() is None)
    try:
        with gone:
            return await work
    except asyncio.CancelledError:
        if not gone.fired:
            raise
        raise ClientDisconnectedError("the client closed the connection") from None
    finally:
        watch.cancel()


async def first_of(
    work: Coroutine[Any, Any, T], watch: Coroutine[Any, Any, None]
) -> asyncio.Future[T]:
    """Run `work` until it ends or `watch` returns, whichever is first; the other is
    cancelled. Returns `work`'s task, done or cancelled; `work`'s exception propagates."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(watch)
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if not task.cancelled() and task.exception() is not None:
        raise task.exception()
    return task


async def _disconnected(request: Request) -> None:
    # The body has been read already, so the next ASGI message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


class ClosingEventStream(EventSourceResponse):
    """An SSE response that runs `on_close` once it ends, however it ends (finished, client
    gone, error): the one place a streamed request is settled.

    Streams on two asyncio tasks (the events, and a watch for the client leaving) instead of
    Starlette's anyio task group, whose cancel scopes and async-library detection on every
    call were a visible share of the gateway's added TTFT (docs/performance.md).
    """

    def __init__(
        self,
        events: AsyncGenerator[bytes],
        *,
        on_close: Callable[[], Awaitable[None]],
        headers: dict[str, str],
    ) -> None:
        super().__init__(events, headers=headers)
        self.events = events
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await first_of(self.stream_response(send), self.listen_for_disconnect(receive))
        finally:
            # Closing the generator cancels the worker call (a client that left mid-stream
            # leaves it suspended); only then is the tally final.
            await self.events.aclose()
            await self.on_close()
