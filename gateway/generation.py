"""Run a `Job` on a worker: route, retry once before the first token, then stream or collect.

The first token is awaited *before* the HTTP response starts, so every failure up to then
(no worker, both tries failed, deadline) is a proper status code; after it, a failure ends
the SSE stream with an OpenAI-style error event and `[DONE]`, never a hang.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator

from fastapi.sse import format_sse_event

from gateway.errors import (
    DeadlineExceededError,
    GatewayError,
    WorkerFailedError,
    gateway_error_body,
)
from gateway.jobs import Job
from gateway.openai_format import OutputFormat, Sample, Usage, stop_reason_of
from gateway.routing import WorkerDirectory, prefix_affinity_key
from gateway.worker_client import WorkerChannels, WorkerStream, WorkerStreamError, start_generate
from rpc import worker_pb2

log = logging.getLogger(__name__)

# A failure before the first token is retried on one other worker.
MAX_TRIES = 2


def _remaining(deadline: float) -> float:
    return deadline - asyncio.get_running_loop().time()


async def open_stream(
    job: Job, *, directory: WorkerDirectory, channels: WorkerChannels
) -> WorkerStream:
    """A Generate call on the best worker that answers, with its first response in hand."""
    affinity = prefix_affinity_key(
        tenant=job.tenant, adapter_id=job.adapter_id, prompt_ids=job.prompt_ids
    )
    candidates = await directory.candidates(adapter_id=job.adapter_id, affinity_key=affinity)
    request = job.to_proto()
    error: GatewayError = WorkerFailedError("no worker answered")
    for worker in candidates[:MAX_TRIES]:
        remaining = _remaining(job.deadline)
        if remaining <= 0:
            raise DeadlineExceededError("the request's deadline passed before a worker answered")
        directory.sent(worker.worker_id)
        try:
            async with asyncio.timeout(remaining):
                return await start_generate(
                    channels,
                    worker_id=worker.worker_id,
                    address=worker.address,
                    request=request,
                    timeout_s=remaining,
                )
        except TimeoutError as exc:
            raise DeadlineExceededError("the request's deadline passed") from exc
        except WorkerStreamError as exc:
            if not exc.retryable:
                raise exc.error from exc
            log.warning("request %s: %s", job.request_id, exc.error.message)
            directory.failed(worker.worker_id)
            error = exc.error
    raise error


def _check_not_aborted(message: worker_pb2.GenerateResponse, *, address: str) -> None:
    if message.finish_reason == "abort":
        raise WorkerStreamError(
            WorkerFailedError(f"worker {address} aborted the request"), retryable=False
        )


async def _responses(
    stream: WorkerStream, *, deadline: float
) -> AsyncIterator[worker_pb2.GenerateResponse]:
    """The worker's responses, as GatewayErrors on failure; the call is cancelled on exit."""
    try:
        async with asyncio.timeout(max(_remaining(deadline), 0.0)):
            async for message in stream.responses():
                _check_not_aborted(message, address=stream.address)
                yield message
    except TimeoutError as exc:
        raise DeadlineExceededError("the request's deadline passed") from exc
    except WorkerStreamError as exc:
        raise exc.error from exc
    finally:
        # A no-op after a clean end; on client disconnect (cancellation or generator close)
        # it tells the worker to abort, which frees the request's KV blocks.
        stream.cancel()


async def collect(stream: WorkerStream, *, job: Job, fmt: OutputFormat) -> dict:
    """The whole non-streaming response body."""
    samples = {i: Sample(index=i) for i in range(max(job.params.n, 1))}
    cached = 0
    async for message in _responses(stream, deadline=job.deadline):
        sample = samples.setdefault(message.index, Sample(index=message.index))
        sample.text += message.text
        sample.logprobs.extend(message.logprobs)
        sample.completion_tokens = max(sample.completion_tokens, message.completion_tokens)
        cached = max(cached, message.cached_tokens)
        if message.finish_reason:
            sample.finish_reason = message.finish_reason
            sample.stop_reason = stop_reason_of(message)
    ordered = [samples[i] for i in sorted(samples)]
    if any(s.finish_reason is None for s in ordered):
        raise WorkerFailedError(f"worker {stream.address} ended the stream before every sample")
    usage = Usage(
        prompt_tokens=len(job.prompt_ids),
        completion_tokens=sum(s.completion_tokens for s in ordered),
        cached_tokens=cached,
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


async def stream_events(
    stream: WorkerStream, *, job: Job, fmt: OutputFormat, include_usage: bool
) -> AsyncIterator[bytes]:
    """SSE bytes: a chunk per worker delta, the usage chunk if asked, then `[DONE]`.

    On failure mid-stream: an error event in OpenAI's format, then `[DONE]`.
    """
    started: set[int] = set()
    completion: dict[int, int] = {}
    offsets: dict[int, int] = {}
    cached = 0
    try:
        async for message in _responses(stream, deadline=job.deadline):
            completion[message.index] = message.completion_tokens
            cached = max(cached, message.cached_tokens)
            if not (message.text or message.finish_reason or message.logprobs):
                continue  # tokens the detokenizer holds back (partial UTF-8, stop prefix)
            first = message.index not in started
            started.add(message.index)
            body = fmt.chunk(
                message,
                first=first,
                text_offset=offsets.get(message.index, 0),
                include_usage=include_usage,
            )
            offsets[message.index] = offsets.get(message.index, 0) + len(message.text)
            yield sse(json.dumps(body, separators=(",", ":")))
        if include_usage:
            usage = Usage(
                prompt_tokens=len(job.prompt_ids),
                completion_tokens=sum(completion.values()),
                cached_tokens=cached,
            )
            yield sse(json.dumps(fmt.usage_chunk(usage), separators=(",", ":")))
    except GatewayError as exc:
        log.warning("request %s failed mid-stream: %s", job.request_id, exc.message)
        yield sse(json.dumps(gateway_error_body(exc)))
    yield DONE
