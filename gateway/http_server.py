"""The gateway's uvicorn server: connection, header and keep-alive limits from the settings.

uvicorn bounds the size of a request's headers (h11's max incomplete event) only while they
are incomplete: a head that arrives whole in one read is parsed whatever its size, so
`BoundedHeadConnection` measures every parsed head against the same bound (400 past it), and
the limit holds however the bytes arrive. Nor does uvicorn bound how long headers may take:
a client that sends half a header and then a byte every few seconds
(slowloris) holds its connection forever. `HeaderDeadlineH11` closes a connection whose
request line and headers are not complete within `http_header_timeout_s` of the connection
opening, or of the first byte of a kept-alive connection's next request. A request answered
before its body was read (a 413, a 408) has the rest of its body read and dropped for at most
`linger_s`, then the connection closes: closing at once would reset it under a client that
is still sending, and that client would lose the answer (nginx's lingering close).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http import h11_impl
from uvicorn.protocols.http.h11_impl import H11Protocol

from gateway.settings import GatewaySettings


class BoundedHeadConnection(h11.Connection):
    """h11's server side with its bound on a request's line and headers applied to every
    request, however its bytes arrived (past it: `h11.RemoteProtocolError`, which uvicorn
    answers with a 400 and a close)."""

    def __init__(self, *, max_head_bytes: int) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size=max_head_bytes)
        self.max_head_bytes = max_head_bytes

    def next_event(self) -> Any:
        event = super().next_event()
        if isinstance(event, h11.Request) and head_bytes(event) > self.max_head_bytes:
            raise h11.RemoteProtocolError(
                f"the request's line and headers exceed {self.max_head_bytes} bytes",
                error_status_hint=431,
            )
        return event


def head_bytes(request: h11.Request) -> int:
    """A request head's size as sent: `METHOD target HTTP/1.1` and each `name: value`, each
    line with its CRLF, then the blank line."""
    line = len(request.method) + len(request.target) + len(b"  HTTP/1.1\r\n")
    return line + sum(len(name) + len(value) + 4 for name, value in request.headers) + 2


class HeaderDeadlineH11(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's line and headers, and their
    size bound held however they arrive."""

    header_timeout_s: float = 10.0
    linger_s: float = 30.0

    def __init__(self, config: uvicorn.Config, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        limit = config.h11_max_incomplete_event_size or h11_impl.DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
        self.conn = BoundedHeadConnection(max_head_bytes=limit)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.header_deadline: asyncio.TimerHandle | None = None
        self.linger: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self.header_deadline is None and self.conn.their_state is h11.IDLE:
            self._arm()  # a kept-alive connection's next request starts arriving
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._disarm()  # the headers are in (the body has its own timeout)
        elif self.linger is not None:
            self.linger.cancel()  # the unread body ended: the connection is reusable
            self.linger = None

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing():
            # Answered before its body was read: drop the rest for a while, then close.
            self.linger = self.loop.call_later(self.linger_s, self.transport.close)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self.linger is not None:
            self.linger.cancel()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self.header_deadline = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _disarm(self) -> None:
        if self.header_deadline is not None:
            self.header_deadline.cancel()
            self.header_deadline = None

    def _headers_late(self) -> None:
        self.header_deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def protocol_class(*, header_timeout_s: float, linger_s: float) -> type[HeaderDeadlineH11]:
    """The protocol with these times (uvicorn builds protocols from a class alone)."""
    times = {"header_timeout_s": header_timeout_s, "linger_s": linger_s}
    return type("HeaderDeadlineH11", (HeaderDeadlineH11,), times)


def server_config(app: Any, settings: GatewaySettings, **overrides: Any) -> uvicorn.Config:
    """uvicorn's Config for the gateway's public port (`overrides`: host, port, log_level…)."""
    options: dict[str, Any] = {
        "host": settings.host,
        "port": settings.port,
        "http": protocol_class(
            header_timeout_s=settings.http_header_timeout_s,
            linger_s=settings.http_body_timeout_s,
        ),
        # Longer than clients keep idle connections (httpx and the openai client: 5 s, the
        # same as uvicorn's default), so the server never closes one a client is reusing.
        "timeout_keep_alive": settings.http_keep_alive_s,
        "limit_concurrency": settings.http_max_connections,
        "backlog": settings.http_backlog,
        "h11_max_incomplete_event_size": settings.http_max_header_bytes,
    }
    options.update(overrides)
    return uvicorn.Config(app, **options)


class SideListener(uvicorn.Server):
    """A second port in the gateway's own loop (the admin API): it starts and stops with
    the app's lifespan, and leaves signals to the main server."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    @property
    def port(self) -> int:
        return self.servers[0].sockets[0].getsockname()[1]

    async def start(self) -> asyncio.Task:
        task = asyncio.create_task(self.serve())
        while not self.started:
            if task.done():
                task.result()  # re-raise a failed start (port taken)
                raise RuntimeError("the side listener exited before it started")
            await asyncio.sleep(0.01)
        return task


async def start_side_listener(
    app: Any, settings: GatewaySettings, *, host: str, port: int
) -> tuple[SideListener, asyncio.Task]:
    config = server_config(app, settings, host=host, port=port, lifespan="off", log_config=None)
    listener = SideListener(config)
    return listener, await listener.start()
