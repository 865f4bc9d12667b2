"""The relay stage's own functions (`gateway.relay`): a worker's answer back to the client, as
SSE events (`stream_events`, `EventStream`, `sse`) or one JSON body (`collect`), and what they
record in the request's `Tally`.

The worker's messages are real `GenerateResponse` protobufs and its failures real
`grpc.aio.AioRpcError`s. A stream's gRPC call is `ScriptedCall`: the two methods of
`grpc.aio.UnaryStreamCall` that `WorkerStream` uses (`read`, `cancel`), so no server runs.
The one call that does dial (asking a departed client's worker to abort) goes over a real
channel to a port nothing listens on: a worker that cannot answer.
"""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import grpc
import pytest

from gateway import metrics
from gateway.errors import WorkerFailedError
from gateway.job import Job
from gateway.openai_format import ChatFormat, CompletionFormat, Header
from gateway.relay import DONE, EventStream, collect, sse, stream_events
from gateway.tally import RunningCall, Tally
from gateway.worker_client import WorkerChannels, WorkerReply, WorkerStream
from rpc import worker_pb2

ADDRESS = "127.0.0.1:7001"
HEADER = Header(id="cmpl-test", created=1_700_000_000, model="tiny-chat")
CHAT_HEADER = Header(id="chatcmpl-test", created=1_700_000_000, model="tiny-chat")
PROMPT = [1, 2, 3]
IM_END = 2
WEATHER_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def char_id(char: str) -> int:
    """The token of one printable ASCII character (the byte alphabet, from "!" = 3)."""
    return 3 + ord(char) - ord("!")


def make_job(*, n: int = 1, logprobs: int | None = None, keep: int | None = None, timeout_s=30.0):
    params = worker_pb2.SamplingParams(max_tokens=8, n=n)
    if logprobs is not None:
        params.logprobs = logprobs
    return Job(
        request_id="cmpl-test",
        created=1_700_000_000,
        model="tiny-chat",
        tenant="acme",
        prompt_ids=PROMPT,
        params=params,
        adapter=None,
        deadline=asyncio.get_running_loop().time() + timeout_s,
        keep=keep,
    )


def delta(
    text: str,
    *,
    index: int = 0,
    tokens: int,
    finish: str = "",
    logprob: float | None = None,
    cached: int = 0,
    stop_token_id: int | None = None,
) -> worker_pb2.GenerateResponse:
    """One step of sample ``index``; ``tokens`` is that sample's total so far."""
    message = worker_pb2.GenerateResponse(
        index=index,
        token_ids=[char_id(c) for c in text[:1]],
        text=text,
        finish_reason=finish,
        prompt_tokens=len(PROMPT),
        completion_tokens=tokens,
        cached_tokens=cached,
    )
    if logprob is not None:
        message.logprobs.append(worker_pb2.TokenLogprob(token_id=char_id(text), logprob=logprob))
    if stop_token_id is not None:
        message.stop_token_id = stop_token_id
    return message


class ScriptedCall:
    """A `Generate` call's remaining messages: `read` gives them in order, then EOF, or
    raises ``error`` (a real `AioRpcError`), or never returns (``stall``)."""

    def __init__(self, *messages: worker_pb2.GenerateResponse, error=None, stall=False) -> None:
        self.messages = list(messages)
        self.error = error
        self.stall = stall
        self.cancelled = False

    async def read(self):
        await asyncio.sleep(0)  # a real read suspends
        if self.messages:
            return self.messages.pop(0)
        if self.error is not None:
            raise self.error
        if self.stall:
            await asyncio.Event().wait()
        return grpc.aio.EOF

    def cancel(self) -> bool:
        self.cancelled = True
        return True


def worker_stream(first, *rest, error=None, stall=False) -> tuple[WorkerStream, ScriptedCall]:
    call = ScriptedCall(*rest, error=error, stall=stall)
    return WorkerStream(worker_id="w1", address=ADDRESS, call=call, first=first), call


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


def events_of(raw: list[bytes]) -> list[Any]:
    """Each SSE event checked for its framing (one `data:` line, a blank line), then its
    JSON, or "[DONE]"."""
    out = []
    for event in raw:
        assert event.startswith(b"data: ") and event.endswith(b"\n\n"), event
        data = event[len(b"data: ") : -2].decode()
        assert "\n" not in data
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


async def drain(events: EventStream) -> list[bytes]:
    return [event async for event in events]


def completion_chunk(index: int, text: str, finish=None, *, logprobs=None, **extra) -> dict:
    choice = {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish,
        "stop_reason": None,
    }
    return {
        "id": "cmpl-test",
        "object": "text_completion",
        "created": 1_700_000_000,
        "model": "tiny-chat",
        "choices": [choice],
        **extra,
    }


def usage_body(prompt: int, completion: int, cached: int = 0) -> dict:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


@pytest.fixture
async def dead_worker():
    """A RunningCall on a worker that cannot answer Abort (nothing listens on its port)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    channels = WorkerChannels()
    yield RunningCall(channels, f"127.0.0.1:{port}", "cmpl-test", "acme")
    await channels.close()


def abort_reports(outcome: str) -> float:
    labels = {"outcome": outcome}
    return metrics.REGISTRY.get_sample_value("switchboard_abort_reports_total", labels) or 0.0


# --- sse -----------------------------------------------------------------------------------------


def test_an_event_is_one_data_line_and_a_blank_line():
    assert sse('{"a":1}') == b'data: {"a":1}\n\n'
    assert DONE == b"data: [DONE]\n\n"


def test_a_multi_line_payload_is_one_data_line_per_line():
    assert sse("a\nb") == b"data: a\ndata: b\n\n"


# --- stream_events -------------------------------------------------------------------------------


async def test_a_stream_is_a_chunk_per_delta_then_done(tokenizer):
    job, tally = make_job(), Tally()
    tally.running_on = RunningCall(WorkerChannels(), ADDRESS, job.request_id, job.tenant)
    stream, call = worker_stream(
        delta("Hel", tokens=1), delta("lo", tokens=2), delta("!", tokens=3, finish="stop")
    )
    fmt = CompletionFormat(HEADER, tokenizer, None)
    raw = await drain(stream_events(stream, job=job, fmt=fmt, include_usage=False, tally=tally))
    assert raw[0] == (
        b'data: {"id":"cmpl-test","object":"text_completion","created":1700000000,'
        b'"model":"tiny-chat","choices":[{"index":0,"text":"Hel","logprobs":null,'
        b'"finish_reason":null,"stop_reason":null}]}\n\n'
    )  # compact JSON, as OpenAI sends it
    assert events_of(raw) == [
        completion_chunk(0, "Hel"),
        completion_chunk(0, "lo"),
        completion_chunk(0, "!", "stop"),
        "[DONE]",
    ]
    assert (tally.finished, tally.status, tally.completion_tokens) == (True, 200, 3)
    assert tally.running_on is None  # ended by itself: nothing to abort
    assert call.cancelled  # a no-op after a clean end, as gRPC's is


async def test_include_usage_adds_a_usage_chunk_before_done(tokenizer):
    job, tally = make_job(n=2), Tally()
    stream, _ = worker_stream(
        delta("A", index=0, tokens=1, cached=2),
        delta("B", index=1, tokens=1, cached=2),
        delta("C", index=0, tokens=2, finish="length"),
        delta("D", index=1, tokens=2, finish="length"),
    )
    fmt = CompletionFormat(HEADER, tokenizer, None)
    raw = await drain(stream_events(stream, job=job, fmt=fmt, include_usage=True, tally=tally))
    assert events_of(raw) == [
        completion_chunk(0, "A", usage=None),
        completion_chunk(1, "B", usage=None),
        completion_chunk(0, "C", "length", usage=None),
        completion_chunk(1, "D", "length", usage=None),
        {
            "id": "cmpl-test",
            "object": "text_completion",
            "created": 1_700_000_000,
            "model": "tiny-chat",
            "choices": [],
            "usage": usage_body(3, 4, cached=2),
        },
        "[DONE]",
    ]


async def test_deltas_with_nothing_to_show_are_skipped_and_offsets_follow_the_text(tokenizer):
    """A delta whose tokens the detokenizer holds back (no text, no logprobs, no finish)
    sends no chunk; each sample's text_offset counts the text it has sent."""
    job, tally = make_job(n=2, logprobs=0), Tally()
    stream, _ = worker_stream(
        delta("A", index=0, tokens=1, logprob=-0.5),
        delta("", index=0, tokens=2),
        delta("B", index=1, tokens=1, logprob=-0.25),
        delta("C", index=0, tokens=3, logprob=-1.0, finish="stop"),
        delta("D", index=1, tokens=2, logprob=-2.0, finish="stop"),
    )
    fmt = CompletionFormat(HEADER, tokenizer, 0)
    raw = await drain(stream_events(stream, job=job, fmt=fmt, include_usage=False, tally=tally))

    def logprobs(token: str, logprob: float, offset: int) -> dict:
        return {
            "tokens": [token],
            "token_logprobs": [logprob],
            "top_logprobs": [{}],
            "text_offset": [offset],
        }

    assert events_of(raw) == [
        completion_chunk(0, "A", logprobs=logprobs("A", -0.5, 0)),
        completion_chunk(1, "B", logprobs=logprobs("B", -0.25, 0)),
        completion_chunk(0, "C", "stop", logprobs=logprobs("C", -1.0, 1)),
        completion_chunk(1, "D", "stop", logprobs=logprobs("D", -2.0, 1)),
        "[DONE]",
    ]
    assert tally.completion == {0: 3, 1: 2}


async def test_each_chat_sample_opens_with_the_role(tokenizer):
    job, tally = make_job(n=2), Tally()
    stream, _ = worker_stream(
        delta("A", index=0, tokens=1),
        delta("B", index=1, tokens=1),
        delta("C", index=1, tokens=2, finish="stop", stop_token_id=IM_END),
        delta("D", index=0, tokens=2, finish="length"),
    )
    fmt = ChatFormat(CHAT_HEADER, tokenizer, False)
    raw = await drain(stream_events(stream, job=job, fmt=fmt, include_usage=False, tally=tally))
    choices = [body["choices"][0] for body in events_of(raw)[:-1]]
    shown = [(c["index"], c["delta"], c["finish_reason"]) for c in choices]
    assert shown == [
        (0, {"role": "assistant", "content": "A"}, None),
        (1, {"role": "assistant", "content": "B"}, None),
        (1, {"content": "C"}, "stop"),
        (0, {"content": "D"}, "length"),
    ]
    assert events_of(raw)[2]["choices"][0]["stop_reason"] == IM_END


async def test_the_role_rides_on_the_first_chunk_shown_after_held_back_text(tokenizer):
    """A chat that may call tools holds back "<tool_": the role waits for the call's chunk."""
    job, tally = make_job(), Tally()
    stream, _ = worker_stream(
        delta("<tool_", tokens=1),
        delta(WEATHER_CALL.removeprefix("<tool_"), tokens=2, finish="stop"),
    )
    fmt = ChatFormat(CHAT_HEADER, tokenizer, False, tool_calls=True)
    raw = await drain(stream_events(stream, job=job, fmt=fmt, include_usage=False, tally=tally))
    [body, done] = events_of(raw)
    [choice] = body["choices"]
    [call] = choice["delta"]["tool_calls"]
    assert choice["delta"]["role"] == "assistant"
    assert (call["index"], call["function"]) == (
        0,
        {"name": "get_weather", "arguments": '{"city":"Paris"}'},
    )
    assert (choice["finish_reason"], done) == ("tool_calls", "[DONE]")


# --- failures after the first token --------------------------------------------------------------


async def test_a_worker_failure_mid_stream_is_an_error_event_then_done(tokenizer):
    job, tally = make_job(), Tally()
    stream, call = worker_stream(
        delta("A", tokens=1),
        delta("B", tokens=2),
        error=rpc_error(grpc.StatusCode.INTERNAL, "engine crashed"),
    )
    fmt = CompletionFormat(HEADER, tokenizer, None)
    raw = await drain(stream_events(stream, job=job, fmt=fmt, include_usage=True, tally=tally))
    assert raw[2:] == [
        b'data: {"error": {"message": "the worker could not complete this request", '
        b'"type": "server_error", "param": null, "code": "worker_failed"}}\n\n',
        b"data: [DONE]\n\n",
    ]  # no usage chunk after a failure
    assert events_of(raw[:2]) == [
        completion_chunk(0, "A", usage=None),
        completion_chunk(0, "B", usage=None),
    ]
    assert (tally.error_status, tally.status, tally.finished) == (502, 502, True)
    assert tally.completion_tokens == 2  # what it generated is still paid
    assert call.cancelled


async def test_a_worker_abort_mid_stream_is_an_error_event_and_its_tokens_are_counted(tokenizer):
    job, tally = make_job(), Tally()
    stream, _ = worker_stream(delta("A", tokens=1), delta("B", tokens=2, finish="abort"))
    fmt = CompletionFormat(HEADER, tokenizer, None)
    raw = await drain(stream_events(stream, job=job, fmt=fmt, include_usage=False, tally=tally))
    assert events_of(raw) == [
        completion_chunk(0, "A"),
        {
            "error": {
                "message": "the worker aborted this request",  # no address
                "type": "server_error",
                "param": None,
                "code": "worker_failed",
            }
        },
        "[DONE]",
    ]  # the aborted delta's text "B" is not shown
    assert (tally.status, tally.completion_tokens) == (502, 2)


async def test_a_deadline_passing_mid_stream_is_an_error_event(tokenizer):
    job, tally = make_job(timeout_s=0.05), Tally()
    stream, call = worker_stream(delta("A", tokens=1), stall=True)
    fmt = CompletionFormat(HEADER, tokenizer, None)
    async with asyncio.timeout(5):
        raw = await drain(stream_events(stream, job=job, fmt=fmt, include_usage=False, tally=tally))
    assert events_of(raw) == [
        completion_chunk(0, "A"),
        {
            "error": {
                "message": "the request's deadline passed",
                "type": "server_error",
                "param": None,
                "code": "deadline_exceeded",
            }
        },
        "[DONE]",
    ]
    assert (tally.status, call.cancelled) == (504, True)


# --- the client leaving --------------------------------------------------------------------------


async def test_a_client_leaving_mid_stream_ends_the_call_and_asks_the_worker(
    tokenizer, dead_worker
):
    """The call is cancelled and its worker asked for what it generated; one that cannot
    answer leaves what the gateway saw. No [DONE]: nobody reads it."""
    job, tally = make_job(), Tally()
    tally.running_on = dead_worker
    stream, call = worker_stream(delta("A", tokens=1), delta("B", tokens=2), stall=True)
    fmt = CompletionFormat(HEADER, tokenizer, None)
    events = stream_events(stream, job=job, fmt=fmt, include_usage=False, tally=tally)
    failed = abort_reports("failed")
    iterator = aiter(events)
    first = await anext(iterator)
    await events.aclose()
    assert events_of([first]) == [completion_chunk(0, "A")]
    assert call.cancelled
    assert abort_reports("failed") - failed == 1
    assert (tally.running_on, tally.finished, tally.status) == (None, False, 499)
    assert tally.completion_tokens == 1


async def test_a_client_leaving_before_the_first_chunk_still_ends_the_call(tokenizer, dead_worker):
    """The body's generator never started (so never cleans up): `aclose` ends the call."""
    job, tally = make_job(), Tally()
    tally.running_on = dead_worker
    stream, call = worker_stream(delta("A", tokens=1))
    events = stream_events(
        stream, job=job, fmt=CompletionFormat(HEADER, tokenizer, None), include_usage=False,
        tally=tally,
    )  # fmt: skip
    failed = abort_reports("failed")
    await events.aclose()
    assert call.cancelled
    assert abort_reports("failed") - failed == 1
    assert (tally.running_on, tally.started, tally.status) == (None, False, 499)


# --- collect -------------------------------------------------------------------------------------


def reply(*responses: worker_pb2.GenerateResponse) -> WorkerReply:
    return WorkerReply("w1", ADDRESS, list(responses), first_token_at=0.0)


async def test_collect_joins_each_samples_deltas(tokenizer):
    job, tally = make_job(n=2), Tally()
    body = collect(
        reply(
            delta("He", index=0, tokens=1, cached=2),
            delta("Yo", index=1, tokens=1, cached=2),
            delta("llo", index=0, tokens=2),
            delta("!", index=1, tokens=2, finish="stop", stop_token_id=IM_END),
            delta("!", index=0, tokens=3, finish="length"),
        ),
        job=job,
        fmt=CompletionFormat(HEADER, tokenizer, None),
        tally=tally,
    )
    assert body == {
        "id": "cmpl-test",
        "object": "text_completion",
        "created": 1_700_000_000,
        "model": "tiny-chat",
        "choices": [
            {
                "index": 0,
                "text": "Hello!",
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
            },
            {
                "index": 1,
                "text": "Yo!",
                "logprobs": None,
                "finish_reason": "stop",
                "stop_reason": IM_END,
            },
        ],
        "usage": usage_body(3, 5, cached=2),
    }
    assert (tally.finished, tally.started, tally.completion) == (True, True, {0: 3, 1: 2})


async def test_collect_a_chat(tokenizer):
    job, tally = make_job(), Tally()
    body = collect(
        reply(delta("Hi", tokens=1), delta("!", tokens=2, finish="stop", stop_token_id=IM_END)),
        job=job,
        fmt=ChatFormat(CHAT_HEADER, tokenizer, False),
        tally=tally,
    )
    assert body == {
        "id": "chatcmpl-test",
        "object": "chat.completion",
        "created": 1_700_000_000,
        "model": "tiny-chat",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hi!"},
                "finish_reason": "stop",
                "logprobs": None,
                "stop_reason": IM_END,
            }
        ],
        "usage": usage_body(3, 2),
    }


async def test_collect_best_of_keeps_the_most_likely_and_bills_every_sample(tokenizer):
    """best_of 3, n 1: sample 2 has the highest cumulative logprob (-0.5 against -1.5 and
    -3.0); it is returned as index 0, and all 3 samples' 6 tokens are billed."""
    job, tally = make_job(n=3, logprobs=0, keep=1), Tally()
    body = collect(
        reply(
            delta("A", index=0, tokens=1, logprob=-1.0),
            delta("B", index=1, tokens=1, logprob=-2.0),
            delta("C", index=2, tokens=1, logprob=-0.25),
            delta("D", index=0, tokens=2, logprob=-0.5, finish="stop"),
            delta("E", index=1, tokens=2, logprob=-1.0, finish="stop"),
            delta("F", index=2, tokens=2, logprob=-0.25, finish="stop"),
        ),
        job=job,
        fmt=CompletionFormat(HEADER, tokenizer, None),  # the client did not ask for logprobs
        tally=tally,
    )
    assert body["choices"] == [
        {"index": 0, "text": "CF", "logprobs": None, "finish_reason": "stop", "stop_reason": None}
    ]
    assert body["usage"] == usage_body(3, 6)


async def test_collect_refuses_a_reply_the_worker_aborted(tokenizer):
    job, tally = make_job(), Tally()
    with pytest.raises(WorkerFailedError) as caught:
        collect(
            reply(delta("A", tokens=1), delta("", tokens=1, finish="abort")),
            job=job,
            fmt=CompletionFormat(HEADER, tokenizer, None),
            tally=tally,
        )
    assert (caught.value.status, caught.value.message) == (502, "the worker aborted this request")
    assert caught.value.detail == f"worker {ADDRESS} aborted the request"  # for the log
    assert not tally.finished
    assert tally.completion_tokens == 1  # recorded before the check: still paid


async def test_collect_best_of_refuses_a_reply_missing_a_samples_end(tokenizer):
    job, tally = make_job(n=2, logprobs=0, keep=1), Tally()
    responses = (
        delta("A", index=0, tokens=1, logprob=-0.25),
        delta("B", index=1, tokens=1, logprob=-4.0),  # sample 1 never finishes
        delta("C", index=0, tokens=2, logprob=-0.25, finish="stop"),
    )
    with pytest.raises(WorkerFailedError) as caught:
        collect(
            reply(*responses), job=job, fmt=CompletionFormat(HEADER, tokenizer, None), tally=tally
        )
    assert caught.value.message == "the worker ended this request early"
    assert caught.value.detail == f"worker {ADDRESS} ended the call before every sample"


@pytest.mark.parametrize(
    "responses",
    [
        # sample 1 never finished
        (delta("A", index=0, tokens=1, finish="stop"), delta("B", index=1, tokens=1)),
        # sample 1 never appeared
        (delta("A", index=0, tokens=1, finish="stop"),),
    ],
)
async def test_collect_refuses_a_reply_missing_a_sample(tokenizer, responses):
    job, tally = make_job(n=2), Tally()
    with pytest.raises(WorkerFailedError) as caught:
        collect(
            reply(*responses), job=job, fmt=CompletionFormat(HEADER, tokenizer, None), tally=tally
        )
    assert caught.value.message == "the worker ended this request early"
    assert caught.value.detail == f"worker {ADDRESS} ended the call before every sample"
