"""The gateway's errors: one exception type per failure, each with its HTTP status and
OpenAI's error body `{"error": {"message", "type", "param", "code"}}`.

Everything below the routes raises these (or `adapters.AdapterError`); no web framework here.
`gateway.error_handlers.install_error_handlers` is the only place that turns them into
responses.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import redis.exceptions

from adapters import AdapterError, AdapterNotFoundError, AdapterTooLargeError


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


class PermissionDeniedError(GatewayError):
    """A valid caller asking for what its tenant is not allowed (e.g. self-service keys)."""

    status = 403
    type = "invalid_request_error"
    code = "permission_denied"


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


class BaseUnavailableError(NoWorkerError):
    """A base with no live pool (or whose files this gateway cannot read): its requests get
    a 503 naming it, while every other base keeps serving."""

    # The status and code of any request no worker can take; the message names the base.

    def __init__(self, base: str, reason: str = "no live worker serves it") -> None:
        super().__init__(f"The base model `{base}` is unavailable: {reason}; retry later.")
        self.base = base


class HelperUnavailableError(GatewayError):
    """A gateway helper process (the grammar checker) failed by itself, not by the request."""

    status = 503
    type = "server_error"
    code = "helper_unavailable"


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
    """The worker failed (before the first token on every try, or mid-stream). The message a
    tenant sees names no worker and no gRPC status: ``detail`` (the worker's address, the
    status and its text) is for the gateway's log, beside the request id."""

    status = 502
    type = "server_error"
    code = "worker_failed"

    def __init__(self, message: str, *, detail: str = "") -> None:
        super().__init__(message)
        self.detail = detail or message


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
