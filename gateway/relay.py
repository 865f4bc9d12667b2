"""Relay: a `Job` to a worker on its `Route` and the worker's answer back, as SSE events or
one JSON body. A call that fails before the first token (or a whole unary call that fails)
is tried once more on the route's next worker, only when another worker may succeed.

A stream's first token is awaited *before* the HTTP response starts, so every failure up to
then (both tries failed, deadline) is a proper status code; after it, a failure ends the SSE
stream with an OpenAI-style error event and `[DONE]`, never a hang. A non-streaming request
is one unary call (`GenerateAll`), retried whole on another worker.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import TypeVar

from fastapi.sse import format_sse_event
from redis.exceptions import RedisError

from gateway import metrics
from gateway.errors import (
    BaseUnavailableError,
    DeadlineExceededError,
    GatewayError,
    WorkerFailedError,
    gateway_error_body,
)
from gateway.job import Job
from gateway.openai_format import OutputFormat, Sample, Usage, most_likely, stop_reason_of
from gateway.routing import Route
from gateway.tally import RunningCall, Tally
from gateway.worker_client import (
    WorkerChannels,
    WorkerReply,
    WorkerStream,
    WorkerStreamError,
    abort,
    generate_all,
    start_generate,
)
from rpc import worker_pb2

log = logging.getLogger(__name__)
T = TypeVar("T")

# A failure before the first token (or of a whole unary call) is retried on one other worker.
MAX_TRIES = 2
# How long a client's departure waits for the worker to report what the request generated;
# a worker's Abort waits for its step in progress at most (well under a second here).
ABORT_TIMEOUT_S = 2.0
# A streamed event past this size (an echoed prompt's logprobs in each choice's first chunk)
# is followed by a turn of the loop: sending does not suspend while the socket takes bytes,
# so n such events would otherwise be built back to back.
LARGE_EVENT_CHARS = 16 << 10


async def open_stream(
    job: Job, route: Route, *, channels: WorkerChannels, tally: Tally
) -> WorkerStream:
    """A Generate call on the route's first worker that answers, with its first response in
    hand; ``tally`` gets the times of the call that answered (see `Tally.overhead_s`)."""
    return await _on_a_worker(job, route, start_generate, channels=channels, tally=tally)


async def fetch_reply(
    job: Job, route: Route, *, channels: WorkerChannels, tally: Tally
) -> WorkerReply:
    """The whole answer, from the route's first worker that gives it (for non-streaming
    requests: nothing has reached the client yet, so any retryable failure may try another
    worker)."""
    return await _on_a_worker(job, route, generate_all, channels=channels, tally=tally)


async def _on_a_worker(
    job: Job,
    route: Route,
    call: Callable[..., Awaitable[T]],
    *,
    channels: WorkerChannels,
    tally: Tally,
) -> T:
    """``call`` on the route's first worker, and once more on the next if it fails in a way
    another worker may not; deadline errors are final."""
    request = job.to_proto()
    error: GatewayError = WorkerFailedError("no worker answered")
    for attempt, worker in enumerate(route.workers[:MAX_TRIES]):
        remaining = job.remaining_s()
        if remaining <= 0:
            raise DeadlineExceededError("the request's deadline passed before a worker answered")
        route.sending(worker)
        tally.called_at = time.monotonic()
        tally.running_on = RunningCall(channels, worker.address, job.request_id, job.tenant)
        if attempt == 0:
            metrics.ADMISSION_TIME.observe(tally.called_at - tally.arrived)
        try:
            async with asyncio.timeout(remaining):
                answer = await call(
                    channels,
                    worker_id=worker.worker_id,
                    address=worker.address,
                    request=request,
                    timeout_s=remaining,
                )
            tally.answered_at = time.monotonic()
            if not isinstance(answer, WorkerStream):
                tally.running_on = None  # a whole answer: nothing runs any more
            return answer
        except asyncio.CancelledError:
            await stop_unfinished(tally)  # the client left: it pays what the worker did
            raise
        except TimeoutError as exc:
            raise DeadlineExceededError("the request's deadline passed") from exc
        except WorkerStreamError as exc:
            if not exc.retryable:
                log.info("request %s: %s", job.request_id, failure_detail(exc.error))
                raise job.named(exc.error) from exc  # the request's own: this worker is fine
            log.warning("request %s: %s", job.request_id, failure_detail(exc.error))
            if exc.worker_failed:
                route.failed(worker)
            error = exc.error
    if not await _pool_alive(route, job):
        raise BaseUnavailableError(job.base or route.directory.default_base) from None
    raise error


async def _pool_alive(route: Route, job: Job) -> bool:
    """The job's pool still has a live worker (or the registry cannot say: then the workers'
    own error stands)."""
    try:
        return await route.directory.alive(job.base or None)
    except RedisError:
        return True


async def stop_unfinished(tally: Tally) -> None:
    """Once a client leaves, its request still pays for every token the worker generated:
    the worker aborts it and reports its count (Abort), and the tally keeps the larger of
    that and what the gateway saw. A worker that cannot answer (an older one, a dead one,
    the short deadline) leaves what the gateway saw: the client cannot cause that, and a
    worker's own failure costs its tenant nothing, as a failed call does. The call itself is
    cancelled by the caller, which frees its KV blocks at once if Abort did not."""
    call, tally.running_on = tally.running_on, None
    if call is None:
        return
    report = await abort(
        call.channels,
        address=call.address,
        request_id=call.request_id,
        tenant=call.tenant,
        timeout_s=ABORT_TIMEOUT_S,
    )
    outcome = "failed" if report is None else "found" if report.found else "not_found"
    metrics.ABORT_REPORTS.labels(outcome=outcome).inc()
    if report is not None and report.found:
        tally.charge_reported(report)


def failure_detail(error: GatewayError) -> str:
    """What the log says of a failure: a worker's own detail (address, gRPC status), which
    the tenant's message leaves out."""
    return error.detail if isinstance(error, WorkerFailedError) else error.message


def _check_not_aborted(message: worker_pb2.GenerateResponse, *, address: str) -> None:
    if message.finish_reason == "abort":
        error = WorkerFailedError(
            "the worker aborted this request", detail=f"worker {address} aborted the request"
        )
        raise WorkerStreamError(error, retryable=False)


async def _responses(
    stream: WorkerStream, *, job: Job, tally: Tally
) -> AsyncIterator[worker_pb2.GenerateResponse]:
    """The worker's responses, as GatewayErrors on failure; the call is cancelled on exit."""
    ended = False  # by itself: finished, failed or out of time
    try:
        async with asyncio.timeout(max(job.remaining_s(), 0.0)):
            async for message in stream.responses():
                tally.record(message)
                _check_not_aborted(message, address=stream.address)
                yield message
        ended = True
    except TimeoutError as exc:
        ended = True
        raise DeadlineExceededError("the request's deadline passed") from exc
    except WorkerStreamError as exc:
        ended = True
        raise job.named(exc.error) from exc
    finally:
        await _end_call(stream, tally, ended=ended)


async def _end_call(stream: WorkerStream, tally: Tally, *, ended: bool) -> None:
    """After a stream: charge what an unfinished call generated (the client left, or the
    body was closed early), then cancel the call: a no-op after a clean end, otherwise the
    worker aborts it and frees its KV blocks."""
    if ended:
        tally.running_on = None
    else:
        await stop_unfinished(tally)
    stream.cancel()


def collect(reply: WorkerReply, *, job: Job, fmt: OutputFormat, tally: Tally) -> dict:
    """The whole non-streaming response body."""
    tally.record_reply(reply)
    samples = {i: Sample(index=i) for i in range(max(job.params.n, 1))}
    prompt_logprobs: list[worker_pb2.TokenLogprob] = []
    for message in reply.responses:
        try:
            _check_not_aborted(message, address=reply.address)
        except WorkerStreamError as exc:
            log.warning("request %s: %s", job.request_id, failure_detail(exc.error))
            raise exc.error from exc
        sample = samples.setdefault(message.index, Sample(index=message.index))
        sample.text += message.text
        sample.logprobs.extend(message.logprobs)
        if message.prompt_logprobs and not prompt_logprobs:
            prompt_logprobs = list(message.prompt_logprobs)
        sample.completion_tokens = max(sample.completion_tokens, message.completion_tokens)
        if message.finish_reason:
            sample.finish_reason = message.finish_reason
            sample.stop_reason = stop_reason_of(message)
    ordered = [samples[i] for i in sorted(samples)]
    # Every sample generated must have ended, best_of's discarded ones too: a call cut short
    # is a failure whatever the ranking would keep.
    if any(s.finish_reason is None for s in ordered):
        detail = f"worker {reply.address} ended the call before every sample"
        log.warning("request %s: %s", job.request_id, detail)
        raise WorkerFailedError("the worker ended this request early", detail=detail)
    tally.finished = True
    for sample in ordered:
        sample.prompt_logprobs = prompt_logprobs
    if job.keep is not None:
        ordered = most_likely(ordered, job.keep)
    usage = Usage(
        prompt_tokens=len(job.prompt_ids),
        completion_tokens=tally.completion_tokens,  # every sample, with best_of too (billed)
        cached_tokens=tally.cached_tokens,
    )
    return fmt.response(ordered, usage)


def sse(data: str) -> bytes:
    """One `data:` event, encoded by FastAPI's own SSE encoder (what a
    `ServerSentEvent(raw_data=data)` yielded from a generator route becomes). We build the
    bytes ourselves because the route returns the `EventSourceResponse` only after the
    first token, so that earlier failures keep their HTTP status."""
    return format_sse_event(data_str=data)


# OpenAI's terminator, unquoted.
DONE = sse("[DONE]")


class EventStream:
    """A response body over a worker stream whose `aclose` ends the worker call however far
    the body got: a client may leave before its first chunk was even asked for, when the
    body's generator never started (and so never cleaned up)."""

    def __init__(self, events: AsyncGenerator[bytes], *, stream: WorkerStream, tally: Tally):
        self._events = events
        self._stream = stream
        self._tally = tally

    def __aiter__(self) -> AsyncGenerator[bytes]:
        return self._events

    async def aclose(self) -> None:
        await self._events.aclose()
        await _end_call(self._stream, self._tally, ended=False)  # nothing left, if it ran


def stream_events(
    stream: WorkerStream, *, job: Job, fmt: OutputFormat, include_usage: bool, tally: Tally
) -> EventStream:
    """SSE bytes: a chunk per worker delta, the usage chunk if asked, then `[DONE]`.

    On failure mid-stream: an error event in OpenAI's format, then `[DONE]`.
    """
    events = _events(stream, job=job, fmt=fmt, include_usage=include_usage, tally=tally)
    return EventStream(events, stream=stream, tally=tally)


async def _events(
    stream: WorkerStream, *, job: Job, fmt: OutputFormat, include_usage: bool, tally: Tally
) -> AsyncGenerator[bytes]:
    started: set[int] = set()
    offsets: dict[int, int] = {}
    responses = _responses(stream, job=job, tally=tally)
    try:
        async for message in responses:
            if not (
                message.text or message.finish_reason or message.logprobs or message.prompt_logprobs
            ):
                continue  # tokens the detokenizer holds back (partial UTF-8, stop prefix)
            body = fmt.chunk(
                message,
                first=message.index not in started,
                text_offset=offsets.get(message.index, 0),
                include_usage=include_usage,
            )
            offsets[message.index] = offsets.get(message.index, 0) + len(message.text)
            if body is None:
                continue  # text held back (it may start a tool call)
            started.add(message.index)
            for event in body if isinstance(body, list) else [body]:
                data = json.dumps(event, separators=(",", ":"))
                yield sse(data)
                if len(data) > LARGE_EVENT_CHARS:
                    await asyncio.sleep(0)  # the loop's other work before building the next
            # Resumed once the server took the bytes: the relay share of this delta.
            metrics.RELAY_TIME.observe(time.monotonic() - tally.last_message_at)
        if include_usage:
            usage = Usage(
                prompt_tokens=len(job.prompt_ids),
                completion_tokens=tally.completion_tokens,
                cached_tokens=tally.cached_tokens,
            )
            closing = fmt.usage_chunk(usage)
            for event in closing if isinstance(closing, list) else [closing]:
                yield sse(json.dumps(event, separators=(",", ":")))
    except GatewayError as exc:
        log.warning("request %s failed mid-stream: %s", job.request_id, failure_detail(exc))
        tally.error_status = exc.status
        yield sse(json.dumps(gateway_error_body(exc)))
    finally:
        # Closed here, not whenever it is collected: the charge of an unfinished call (see
        # `_end_call`) must be in the tally before the request is settled.
        await responses.aclose()
    yield DONE
    tally.finished = True
