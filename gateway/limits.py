"""What a client may send before the app does any work: body size per route and body pace.

`RequestBodyGuard` is a plain ASGI middleware, outside routing, parsing and authentication: a
declared Content-Length over the route's limit is answered 413 before a byte of the body is
read; a chunked body is counted as it streams and cut off at the limit; a body that pauses
longer than the read timeout is answered 408. The rest of a refused body never reaches the
app; the server drops it for a bounded time, then closes the connection (and header pace is
the server protocol's too: `gateway.http_server`).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from gateway.errors import (
    GatewayError,
    PayloadTooLargeError,
    RequestTimeoutError,
    gateway_error_body,
)

GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses"})
UPLOAD_PATH = "/v1/adapters"
FILES_PATH = "/v1/files"


@dataclass(frozen=True, slots=True)
class BodyLimits:
    """Bytes a body may hold: generation routes, adapter uploads, batch files (a little over
    the file itself, for the multipart framing), and every other route."""

    generation: int
    upload: int
    other: int
    files: int = 0  # 0: as `other`

    def for_route(self, method: str, path: str) -> int:
        if path in GENERATION_PATHS:
            return self.generation
        if path == UPLOAD_PATH and method == "POST":
            return self.upload
        if path == FILES_PATH and method == "POST" and self.files:
            return self.files
        return self.other


class _Refused(Exception):
    """Raised from `receive` into the app; the guard answers with `error` instead."""

    def __init__(self, error: GatewayError) -> None:
        super().__init__(error.message)
        self.error = error


def too_large(limit: int) -> PayloadTooLargeError:
    return PayloadTooLargeError(f"the request body is over {limit} bytes", param=None)


def declared_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    for name, value in headers:
        if name == b"content-length":
            return int(value) if value.isdigit() else None
    return None


class RequestBodyGuard:
    """Size and pace limits on request bodies, enforced before the app sees the body.

    Starlette's `RequestBodyLimitMiddleware` (FastAPI's `max_body_size`) counts size only:
    it has no pace limit (a body trickled a byte a minute holds its connection forever), and
    its 413 is raised into the app as an exception that FastAPI's handler renders as
    `{"detail": ...}`. Doing both here keeps one place and OpenAI's error format.
    """

    def __init__(self, app, *, limits: BodyLimits, read_timeout_s: float) -> None:
        self.app = app
        self.limits = limits
        self.read_timeout_s = read_timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"][len(scope.get("root_path", "")) :] or "/"
        limit = self.limits.for_route(scope["method"], path)
        declared = declared_length(scope["headers"])
        if declared is not None and declared > limit:
            await refuse(send, too_large(limit))
            return

        received = 0
        body_done = False
        refused: GatewayError | None = None
        started = False

        async def guarded_receive():
            nonlocal received, body_done, refused
            if refused is not None:  # the app asks again after its body was refused
                return {"type": "http.disconnect"}
            if body_done:  # later receives wait for the disconnect: no timeout on those
                return await receive()
            try:
                async with asyncio.timeout(self.read_timeout_s):
                    message = await receive()
            except TimeoutError:
                refused = RequestTimeoutError(
                    f"the request body paused for over {self.read_timeout_s:g} s"
                )
                raise _Refused(refused) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    refused = too_large(limit)
                    raise _Refused(refused)
                body_done = not message.get("more_body", False)
            else:
                body_done = True
            return message

        async def guarded_send(message) -> None:
            nonlocal started
            if refused is not None and not started:
                return  # the app's own answer to a body it could not read: ours replaces it
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, guarded_receive, guarded_send)
        except Exception:
            if refused is None:
                raise  # the app's own failure, not the refused body's
        if refused is not None and not started:
            await refuse(send, refused)


async def refuse(send, error: GatewayError) -> None:
    """The error in OpenAI's format, with the app's body unread."""
    body = json.dumps(gateway_error_body(error)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
