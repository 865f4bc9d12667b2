"""Who may call a worker: gateways that prove it, by mutual TLS, by a shared token over TLS,
or both. A worker that checks neither listens on loopback only.

A caller a worker accepts is trusted with tenants' names and adapter ids (it skips the
gateway's quotas and shares a tenant's prefix cache), so on any other interface an
unauthenticated worker would hand every tenant's service to whoever reaches its port.

``grpc.health.v1`` is exempt from the token (Kubernetes' gRPC probes send no metadata) and,
since probes cannot present a client certificate either, ``worker.serving.server`` can serve it on a
plaintext port of its own (``--health-port``) that answers nothing else.
"""

from __future__ import annotations

import hmac
import ipaddress
from dataclasses import dataclass
from pathlib import Path

import grpc

from worker.errors import EngineError

TOKEN_ENV = "SWITCHBOARD_WORKER_TOKEN"
MIN_TOKEN_CHARS = 16
HEALTH_METHOD_PREFIX = "/grpc.health.v1.Health/"


class WorkerAuthError(EngineError, ValueError):
    """The worker's credentials are incomplete, or missing where the bind address needs them."""


@dataclass(frozen=True)
class WorkerAuth:
    """The worker's TLS files and shared token; every field optional, checked by ``check``."""

    tls_cert: Path | None = None
    tls_key: Path | None = None
    # Set: callers must present a certificate this CA signed (mutual TLS).
    tls_client_ca: Path | None = None
    # Set: callers must send `authorization: Bearer <token>` (gRPC access-token credentials).
    token: str | None = None

    @property
    def authenticates_callers(self) -> bool:
        return self.tls_client_ca is not None or bool(self.token)

    def check(self, host: str) -> None:
        """Raise ``WorkerAuthError`` unless this configuration is complete and may bind ``host``."""
        if (self.tls_cert is None) != (self.tls_key is None):
            raise WorkerAuthError("--tls-cert and --tls-key go together")
        if self.authenticates_callers and self.tls_cert is None:
            raise WorkerAuthError(
                "a client CA or a token needs the worker's own --tls-cert and --tls-key "
                "(a token sent in plaintext proves nothing)"
            )
        if self.token is not None and len(self.token) < MIN_TOKEN_CHARS:
            raise WorkerAuthError(f"{TOKEN_ENV} is shorter than {MIN_TOKEN_CHARS} characters")
        if not self.authenticates_callers and not is_loopback(host):
            raise WorkerAuthError(
                f"refusing to listen on {host!r} without authenticating callers: anyone who "
                "reaches the port could act as any tenant. Give --tls-cert, --tls-key and "
                f"--tls-client-ca (mutual TLS; `switchboard certs` makes them) and/or "
                f"{TOKEN_ENV}, or listen on 127.0.0.1"
            )

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """TLS credentials for the gRPC port; None: plaintext (loopback only, see ``check``)."""
        if self.tls_cert is None or self.tls_key is None:
            return None
        pair = (self.tls_key.read_bytes(), self.tls_cert.read_bytes())
        client_ca = self.tls_client_ca.read_bytes() if self.tls_client_ca else None
        return grpc.ssl_server_credentials(
            [pair], root_certificates=client_ca, require_client_auth=client_ca is not None
        )

    def interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        return [TokenInterceptor(self.token)] if self.token else []


def is_loopback(host: str) -> bool:
    """Whether ``host`` names only this machine (a wildcard or a hostname does not)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call but health checks unless it carries the shared token."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(HEALTH_METHOD_PREFIX):
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        sent = metadata.get("authorization", "")
        sent = sent.encode() if isinstance(sent, str) else sent
        if hmac.compare_digest(sent, self._expected):
            return handler
        return _refusing(handler)


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that answers UNAUTHENTICATED."""

    async def refuse(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong worker token")

    codec = dict(
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(refuse, **codec)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(refuse, **codec)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(refuse, **codec)
    return grpc.stream_stream_rpc_method_handler(refuse, **codec)
