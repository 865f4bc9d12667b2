"""gRPC client side of the gateway⇄worker contract: one channel per worker address, and
`Generate` calls that the gateway can cancel (the worker then frees the KV blocks at once).
"""

from __future__ import annotations

import ipaddress
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from gateway.errors import (
    DeadlineExceededError,
    GatewayError,
    InvalidRequestError,
    WorkerFailedError,
)
from rpc import worker_pb2, worker_pb2_grpc

if TYPE_CHECKING:
    from gateway.settings import GatewaySettings

log = logging.getLogger(__name__)

# Codes that say the worker, not the request, is unwell (it is shutting down, unreachable,
# or refuses this gateway): the gateway tries another worker and routes around this one.
# Connection-level failures arrive as UNAVAILABLE.
RETRYABLE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.CANCELLED,  # the worker shut down under us
        grpc.StatusCode.UNIMPLEMENTED,  # not a worker of this contract
        grpc.StatusCode.UNAUTHENTICATED,  # its credentials and ours disagree
        grpc.StatusCode.PERMISSION_DENIED,
    }
)
# Codes after which another worker may succeed though this one is well: tried elsewhere,
# never marked failed. NOT_FOUND: its store lacks the adapter (another's may have it).
RETRY_ELSEWHERE = frozenset({grpc.StatusCode.NOT_FOUND})
# Everything else is final: INVALID_ARGUMENT and OUT_OF_RANGE are the request's values
# (400); INTERNAL and UNKNOWN are a request that failed alone in the engine (the worker
# isolates it and serves on): retried, a poisonous request would hop from worker to worker
# and get each one marked failed. DEADLINE_EXCEEDED is the request's own deadline.


# A non-streaming answer arrives as one message (GenerateAll): n samples of long outputs
# with top logprobs pass gRPC's default 4 MB receive limit, and the HTTP body the gateway
# builds from it is larger still, so the message is not what should bound it.
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", -1)]
# What a tenant reads when its worker fails: no address, no gRPC status (those are logged).
UNAVAILABLE_MESSAGE = "the worker serving this request became unavailable; try again"


class WorkerStreamError(Exception):
    """A Generate call failed; `retryable` says whether another worker may succeed, and
    `worker_failed` whether the worker itself is unwell (route around it for a while)."""

    def __init__(
        self, error: GatewayError, *, retryable: bool, worker_failed: bool | None = None
    ) -> None:
        super().__init__(error.message)
        self.error = error
        self.retryable = retryable
        self.worker_failed = retryable if worker_failed is None else worker_failed


def translate_rpc_error(exc: grpc.RpcError, *, address: str) -> WorkerStreamError:
    code = exc.code() if isinstance(exc, grpc.aio.AioRpcError) else grpc.StatusCode.UNKNOWN
    details = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        error: GatewayError = DeadlineExceededError("the request's deadline passed")
        return WorkerStreamError(error, retryable=False)
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE):
        return WorkerStreamError(InvalidRequestError(details or "invalid request"), retryable=False)
    detail = f"worker {address} failed: {code.name}: {details}"
    if code in RETRYABLE or code in RETRY_ELSEWHERE:
        error = WorkerFailedError(UNAVAILABLE_MESSAGE, detail=detail)
        return WorkerStreamError(error, retryable=True, worker_failed=code in RETRYABLE)
    error = WorkerFailedError("the worker could not complete this request", detail=detail)
    return WorkerStreamError(error, retryable=False, worker_failed=False)


@dataclass(frozen=True)
class WorkerCredentials:
    """What the gateway shows workers (worker/serving/auth.py): TLS files' contents and a token."""

    ca: bytes | None = None  # None: the system's roots
    cert: bytes | None = None
    key: bytes | None = None
    token: str = ""
    server_name: str = ""  # checked on the worker's certificate; "": the dialled host

    @classmethod
    def from_settings(cls, settings: GatewaySettings) -> WorkerCredentials | None:
        """None when nothing is configured: plaintext to loopback workers only."""
        token = settings.worker_token.get_secret_value()
        files = (settings.worker_tls_ca, settings.worker_tls_cert, settings.worker_tls_key)
        if not token and all(f is None for f in files):
            return None
        ca, cert, key = (f.read_bytes() if f is not None else None for f in files)
        return cls(ca, cert, key, token, settings.worker_tls_server_name)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        tls = grpc.ssl_channel_credentials(self.ca, self.key, self.cert)
        if not self.token:
            return tls
        return grpc.composite_channel_credentials(
            tls, grpc.access_token_call_credentials(self.token)
        )


class WorkerChannels:
    """A `grpc.aio` channel per worker address, opened on first use, closed together.

    With credentials every channel is TLS (plus the token); without, only loopback workers
    are dialled in plaintext, any other over TLS against the system's roots: a request and its
    tenant never cross a network unencrypted and unauthenticated."""

    def __init__(self, credentials: WorkerCredentials | None = None) -> None:
        self._credentials = credentials
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, worker_pb2_grpc.WorkerStub] = {}

    def stub(self, address: str) -> worker_pb2_grpc.WorkerStub:
        stub = self._stubs.get(address)
        if stub is None:
            channel = self._open(address)
            self._channels[address] = channel
            stub = self._stubs[address] = worker_pb2_grpc.WorkerStub(channel)
        return stub

    def _open(self, address: str) -> grpc.aio.Channel:
        credentials = self._credentials
        if credentials is None:
            if _is_loopback(address):
                return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
            log.warning(
                "worker %s is not on loopback and no worker credentials are set "
                "(SWITCHBOARD_WORKER_TLS_*): dialling it over TLS with the system's roots",
                address,
            )
            credentials = WorkerCredentials()
        options = list(CHANNEL_OPTIONS)
        if credentials.server_name:
            options.append(("grpc.ssl_target_name_override", credentials.server_name))
        return grpc.aio.secure_channel(address, credentials.channel_credentials(), options)

    async def close(self) -> None:
        channels = list(self._channels.values())
        self._channels.clear()
        self._stubs.clear()
        for channel in channels:
            await channel.close(grace=None)


@dataclass
class WorkerStream:
    """A started `Generate` call whose first response has already arrived."""

    worker_id: str
    address: str
    call: grpc.aio.UnaryStreamCall
    first: worker_pb2.GenerateResponse

    async def responses(self) -> AsyncIterator[worker_pb2.GenerateResponse]:
        """Every response, the first included; raises WorkerStreamError on failure."""
        yield self.first
        while True:
            try:
                message = await self.call.read()
            except grpc.RpcError as exc:
                raise translate_rpc_error(exc, address=self.address) from exc
            if message is grpc.aio.EOF:
                return
            yield message

    def cancel(self) -> None:
        """Abort the call: the worker sees the cancellation and frees the request's blocks."""
        self.call.cancel()


async def start_generate(
    channels: WorkerChannels,
    *,
    worker_id: str,
    address: str,
    request: worker_pb2.GenerateRequest,
    timeout_s: float,
) -> WorkerStream:
    """Send `request` and wait for the first response (prefill done, first token out)."""
    call = channels.stub(address).Generate(request, timeout=timeout_s)
    try:
        first = await call.read()
    except grpc.RpcError as exc:
        raise translate_rpc_error(exc, address=address) from exc
    except BaseException:
        call.cancel()  # our own caller was cancelled (client gone): tell the worker
        raise
    if first is grpc.aio.EOF:
        error = WorkerFailedError(
            UNAVAILABLE_MESSAGE, detail=f"worker {address} ended the stream without a response"
        )
        raise WorkerStreamError(error, retryable=True)
    return WorkerStream(worker_id=worker_id, address=address, call=call, first=first)


@dataclass
class WorkerReply:
    """A finished request: every delta, and when its first token came (gateway clock)."""

    worker_id: str
    address: str
    responses: list[worker_pb2.GenerateResponse]
    first_token_at: float  # time.monotonic()


async def generate_all(
    channels: WorkerChannels,
    *,
    worker_id: str,
    address: str,
    request: worker_pb2.GenerateRequest,
    timeout_s: float,
) -> WorkerReply:
    """Send `request` and wait for the whole answer, in one unary call (~half the CPU of a
    stream here). A worker too old to know `GenerateAll` (a rolling upgrade) is asked
    with `Generate` instead. Cancelling the caller cancels the call."""
    try:
        reply = await channels.stub(address).GenerateAll(request, timeout=timeout_s)
    except grpc.RpcError as exc:
        if isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.UNIMPLEMENTED:
            return await _generate_streamed(
                channels, worker_id=worker_id, address=address, request=request,
                timeout_s=timeout_s,
            )  # fmt: skip
        raise translate_rpc_error(exc, address=address) from exc
    if not reply.responses:
        error = WorkerFailedError(
            UNAVAILABLE_MESSAGE, detail=f"worker {address} answered without a response"
        )
        raise WorkerStreamError(error, retryable=True)
    first_token_at = time.monotonic() - reply.first_token_to_end_s
    return WorkerReply(worker_id, address, list(reply.responses), first_token_at)


async def _generate_streamed(channels: WorkerChannels, **call) -> WorkerReply:
    stream = await start_generate(channels, **call)
    first_token_at = time.monotonic()
    try:
        responses = [message async for message in stream.responses()]
    finally:
        stream.cancel()  # a no-op after a clean end
    return WorkerReply(stream.worker_id, stream.address, responses, first_token_at)


async def load_adapter(
    channels: WorkerChannels, *, address: str, adapter_id: str, timeout_s: float
) -> None:
    """Ask one worker to load an adapter from its store by content id (raises grpc errors)."""
    request = worker_pb2.LoadAdapterRequest(adapter_id=adapter_id)
    await channels.stub(address).LoadAdapter(request, timeout=timeout_s)


async def stats(
    channels: WorkerChannels, *, address: str, timeout_s: float
) -> worker_pb2.StatsResponse:
    """One worker's load and per-tenant service (raises grpc errors)."""
    return await channels.stub(address).Stats(worker_pb2.StatsRequest(), timeout=timeout_s)


async def unload_adapter(
    channels: WorkerChannels, *, address: str, adapter_id: str, timeout_s: float
) -> bool:
    """Ask one worker to drop an adapter; False (logged) if it failed. Not loaded is fine."""
    request = worker_pb2.UnloadAdapterRequest(adapter_id=adapter_id)
    try:
        await channels.stub(address).UnloadAdapter(request, timeout=timeout_s)
    except grpc.RpcError as exc:
        code = exc.code() if isinstance(exc, grpc.aio.AioRpcError) else None
        if code == grpc.StatusCode.NOT_FOUND:
            return True
        log.warning("unloading adapter %s from %s failed: %s", adapter_id, address, exc)
        return False
    return True


async def abort(
    channels: WorkerChannels, *, address: str, request_id: str, tenant: str, timeout_s: float
) -> worker_pb2.AbortResponse | None:
    """Ask one worker to stop a request and report what it generated; None (logged) if it
    did not answer (an older worker without Abort, a dead one, the deadline)."""
    request = worker_pb2.AbortRequest(request_id=request_id, tenant=tenant)
    try:
        return await channels.stub(address).Abort(request, timeout=timeout_s)
    except grpc.RpcError as exc:
        log.warning("abort of %s on %s failed: %s", request_id, address, exc)
        return None


def _is_loopback(address: str) -> bool:
    """Whether "host:port" dials this machine ("localhost", 127.0.0.0/8, [::1])."""
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
