"""`ConsoleBridge`: the pages' API calls, answered by the gateway's own API.

A page calls `/console/api/X` (tenant) or `/console/admin/api/X` (admin) with its session
cookie and its CSRF token; the bridge checks the token and the origin, then hands the request
to the same app as `/v1/X` or `/admin/X` with the cookie's credential as its bearer token.
So the console adds no endpoint and no rule of its own: the API's routes, body limits,
authentication and error bodies answer every call (the bridge sits outside the body guard,
which then sees the API's path). Every console response gets `SECURITY_HEADERS`.
"""

from __future__ import annotations

import json

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.console.session import (
    CSRF_HEADER,
    SECURITY_HEADERS,
    Side,
    credential,
    csrf_matches,
    same_origin,
)
from gateway.errors import error_body

_SECURITY = [(k.encode(), v.encode()) for k, v in SECURITY_HEADERS.items()]


class ConsoleBridge:
    def __init__(self, app: ASGIApp, *, sides: tuple[Side, ...]) -> None:
        self.app = app
        self.sides = sides

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/console"):
            await self.app(scope, receive, send)
            return
        send = _with_security_headers(send)
        for side in self.sides:
            if scope["path"].startswith(side.api_prefix):
                await self._bridge(side, scope, receive, send)
                return
        await self.app(scope, receive, send)

    async def _bridge(self, side: Side, scope: Scope, receive: Receive, send: Send) -> None:
        headers = Headers(scope=scope)
        rest = scope["path"][len(side.api_prefix) :]
        if any(part in {"", ".", ".."} for part in rest.split("/")):
            await _refuse(send, 404, "not_found", "Not Found")
            return
        token = credential(headers, side)
        if token is None:
            code = "invalid_api_key" if side.role == "tenant" else "invalid_admin_token"
            await _refuse(send, 401, code, "not signed in to the console")
            return
        if not same_origin(headers) or not csrf_matches(token, headers.get(CSRF_HEADER)):
            await _refuse(send, 403, "csrf_failed", "a console call needs its page's CSRF token")
            return
        kept = [(k, v) for k, v in scope["headers"] if k not in {b"cookie", b"authorization"}]
        kept.append((b"authorization", b"Bearer " + token.encode()))
        path = side.api_target + rest
        raw = scope.get("raw_path") or b""
        prefix = side.api_prefix.encode()
        raw_rest = raw[len(prefix) :] if raw.startswith(prefix) else rest.encode()
        inner = dict(scope, path=path, raw_path=side.api_target.encode() + raw_rest, headers=kept)
        await self.app(inner, receive, send)


def _with_security_headers(send: Send) -> Send:
    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            names = {k.lower() for k, _ in message.get("headers", [])}
            extra = [(k, v) for k, v in _SECURITY if k not in names]
            message = dict(message, headers=[*message.get("headers", []), *extra])
        await send(message)

    return sending


async def _refuse(send: Send, status: int, code: str, message: str) -> None:
    body = json.dumps(error_body(message, type="invalid_request_error", code=code)).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", b"%d" % len(body)),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
