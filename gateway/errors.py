"""The gateway's errors: one exception type per failure, mapped once, at the edge, to OpenAI's
error body `{"error": {"message", "type", "param", "code"}}` and its HTTP status.

Everything below the routes raises these (or `adapters.AdapterError`); `install_error_handlers`
is the only place that turns them into responses.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

import redis.exceptions
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from adapters import AdapterError, AdapterNotFoundError, AdapterTooLargeError
from gateway import metrics

log = logging.getLogger(__name__)


class GatewayError(Exception):
    """Base: `status`, OpenAI `type` and `code` are class attributes; `param` per instance."""

    status = 500
    type = "server_error"
    code: str | None = None
    headers: dict[str, str] | None = None

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequestError(GatewayError):
    """A well-formed body asking for something we cannot do (too long, unsupported field)."""

    status = 400
    type = "invalid_request_error"


class AuthenticationError(GatewayError):
    """Missing, unknown or revoked API key."""

    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class AdminAuthenticationError(GatewayError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_admin_token"


class ModelNotFoundError(GatewayError):
    """Neither the base model nor one of the caller's adapters (another tenant's is unknown)."""

    status = 404
    type = "invalid_request_error"
    code = "model_not_found"

    def __init__(self, model: str) -> None:
        super().__init__(f"The model `{model}` does not exist.", param="model")


class NotFoundError(GatewayError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class ConflictError(GatewayError):
    status = 409
    type = "invalid_request_error"
    code = "conflict"


class PayloadTooLargeError(GatewayError):
    status = 413
    type = "invalid_request_error"
    code = "payload_too_large"


class RequestTimeoutError(GatewayError):
    """The client stopped sending its body (a pause past `http_body_timeout_s`)."""

    status = 408
    type = "invalid_request_error"
    code = "request_timeout"


class RateLimitError(GatewayError):
    """A quota refused the request (429), with OpenAI's rate-limit and Retry-After headers.
    `kind` is OpenAI's error type: "requests", "tokens" or "insufficient_quota"."""

    status = 429

    def __init__(self, message: str, *, kind: str, headers: dict[str, str]) -> None:
        super().__init__(message)
        self.type = kind
        self.code = "insufficient_quota" if kind == "insufficient_quota" else "rate_limit_exceeded"
        self.headers = headers


class TenantQueueFullError(RateLimitError):
    """Every worker is saturated and the tenant's own queue is full (429, Retry-After)."""

    def __init__(self, message: str, *, retry_after_s: float) -> None:
        super().__init__(message, kind="requests", headers=retry_headers(retry_after_s))


class QueueTimeoutError(GatewayError):
    """The request waited in the fair queue past `queue_timeout_s` (503, Retry-After)."""

    status = 503
    type = "server_error"
    code = "queue_timeout"

    def __init__(self, message: str, *, retry_after_s: float) -> None:
        super().__init__(message)
        self.headers = retry_headers(retry_after_s)


def retry_headers(seconds: float) -> dict[str, str]:
    """Retry-After in whole seconds (at least 1, as clients round it) and in milliseconds."""
    return {
        "retry-after": str(max(1, math.ceil(seconds))),
        "retry-after-ms": str(max(1, round(seconds * 1000))),
    }


class NoWorkerError(GatewayError):
    """No live worker serves the model."""

    status = 503
    type = "server_error"
    code = "no_worker_available"


class StateUnavailableError(GatewayError):
    """Redis is unreachable: we fail closed (no auth, no routing) rather than guess."""

    status = 503
    type = "server_error"
    code = "state_unavailable"


class ClientDisconnectedError(GatewayError):
    """The client went away before the response started (nginx's 499; nobody reads it)."""

    status = 499
    type = "invalid_request_error"
    code = "client_disconnected"


class WorkerFailedError(GatewayError):
    """The worker failed (before the first token on every try, or mid-stream)."""

    status = 502
    type = "server_error"
    code = "worker_failed"


class DeadlineExceededError(GatewayError):
    status = 504
    type = "server_error"
    code = "deadline_exceeded"


def error_body(
    message: str, *, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def gateway_error_body(exc: GatewayError) -> dict[str, Any]:
    return error_body(exc.message, type=exc.type, param=exc.param, code=exc.code)


def adapter_error_status(exc: AdapterError) -> int:
    if isinstance(exc, AdapterNotFoundError):
        return 404
    if isinstance(exc, AdapterTooLargeError):
        return 413
    return 400


def status_of(exc: BaseException) -> int:
    """The HTTP status an exception becomes at the edge (for metrics, before it gets there)."""
    if isinstance(exc, GatewayError):
        return exc.status
    if isinstance(exc, AdapterError):
        return adapter_error_status(exc)
    if isinstance(exc, redis.exceptions.RedisError):
        return StateUnavailableError.status
    if isinstance(exc, asyncio.CancelledError):
        return ClientDisconnectedError.status
    return 500


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
