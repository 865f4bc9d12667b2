"""Every error response of the app in OpenAI's format: the exception types of
`gateway.errors`, adapters' errors, FastAPI's validation errors, unknown paths and Redis
failures, each mapped once, here."""

from __future__ import annotations

import logging
from typing import Any

import redis.exceptions
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from adapters import AdapterError
from gateway import metrics
from gateway.errors import (
    GatewayError,
    StateUnavailableError,
    adapter_error_status,
    error_body,
    gateway_error_body,
)

log = logging.getLogger(__name__)


def _validation_param(loc: tuple[Any, ...]) -> str | None:
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts) or None


def install_error_handlers(app: FastAPI) -> None:
    """Every error response of the app, in OpenAI's format."""

    @app.exception_handler(GatewayError)
    async def _gateway(request: Request, exc: GatewayError) -> JSONResponse:
        if exc.status >= 500:
            log.warning("%s %s: %s", request.method, request.url.path, exc.message)
        return JSONResponse(gateway_error_body(exc), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(AdapterError)
    async def _adapter(request: Request, exc: AdapterError) -> JSONResponse:
        body = error_body(str(exc), type="invalid_request_error", param=exc.field)
        return JSONResponse(body, status_code=adapter_error_status(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {"msg": "invalid request", "loc": ()}
        if first.get("type") == "json_invalid":
            # Not JSON at all: a malformed body (400), not a schema violation (422).
            body = error_body(
                f"The request body is not valid JSON: {first['msg']}",
                type="invalid_request_error",
            )
            return JSONResponse(body, status_code=400)
        param = _validation_param(tuple(first.get("loc", ())))
        message = "; ".join(
            f"{_validation_param(tuple(e.get('loc', ()))) or 'body'}: {e['msg']}" for e in errors
        )
        body = error_body(message, type="invalid_request_error", param=param, code="invalid_value")
        # OpenAI's API (and vLLM's) answers a value it cannot take with 400; our own admin
        # API keeps FastAPI's 422.
        status = 400 if request.url.path.startswith("/v1/") else 422
        return JSONResponse(body, status_code=status)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Unknown paths (404) and wrong methods (405) too.
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        body = error_body(str(exc.detail), type=kind)
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(redis.exceptions.RedisError)
    async def _redis(request: Request, exc: redis.exceptions.RedisError) -> JSONResponse:
        log.error("redis error on %s %s: %r", request.method, request.url.path, exc)
        metrics.REDIS_ERRORS.inc()
        error = StateUnavailableError("shared state (Redis) is unavailable; retry later")
        return JSONResponse(gateway_error_body(error), status_code=error.status)
