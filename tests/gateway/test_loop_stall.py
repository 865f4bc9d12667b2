"""Nothing proportional to a request's size runs on the gateway's event loop: while a ~1 MB
prompt, a large JSON schema or a large tool list goes through the whole request path, a task
on the gateway's own loop sees it stall for less than 50 ms.

The gateway (the real app under uvicorn, a scripted worker) runs in this process and loop; the
requests come from curl, in other processes, so no client holds this interpreter's GIL. The
lag is measured as a 1 ms sleep's overshoot, the worst over the request, less the worst over
as long an idle stretch just after it (the machine's own scheduling noise). The target is
50 ms (`STALL_TARGET_S`); the assertion is looser, for loaded test machines."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from gateway_support import CORPUS, MODEL_NAME, gateway_settings, gateway_with_worker
from rpc import worker_pb2

STALL_TARGET_S = 0.050  # what the figures printed here show on a quiet machine
# What the test asserts: a request-sized stall (1-4 s before the fix) fails it, a busy 2-core
# machine's GIL hand-offs (up to ~0.3 s seen beside other suites; 0.27 s for 16 large answers
# at once in the whole suite on a quiet 2-core Zen 3) do not.
STALL_LIMIT_S = 0.500
# ~1 MB of text: 262,581 tokens of the test tokenizer.
SENTENCES = " ".join(CORPUS[:5]) + " "
MEGABYTE = SENTENCES * (1_000_000 // len(SENTENCES))


@pytest.fixture
async def live(redis_url, redis_prefix, model_dir, tmp_path):
    settings = gateway_settings(
        redis_url=redis_url,
        prefix=redis_prefix,
        model_dir=model_dir,
        store=tmp_path / "store",
        max_model_len=1 << 19,  # a 1 MB prompt fits: it is templated and tokenized in full
        worker_heartbeat_ttl_s=600,  # the scripted worker registers once
    )
    async with gateway_with_worker(settings) as live:
        yield live


def _schema(properties: int) -> dict:
    return {
        "type": "object",
        "properties": {
            f"field_{i}": {"type": "string", "description": "a field " * 8}
            for i in range(properties)
        },
    }


def _tools(count: int) -> list[dict]:
    return [
        {
            "type": "function",
            "function": {
                "name": f"tool_{i}",
                "description": "does a thing " * 40,
                "parameters": _schema(30),
            },
        }
        for i in range(count)
    ]


LARGE = {
    "1 MB completion prompt": ("/v1/completions", {"prompt": MEGABYTE, "max_tokens": 4}),
    "1 MB chat prompt": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": MEGABYTE}], "max_tokens": 4},
    ),
    "large JSON schema": (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "big", "schema": _schema(1500)},
            },
            "max_tokens": 4,
        },
    ),
    "large tool list": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "tools": _tools(64), "max_tokens": 4},
    ),
}


async def _worst_lag(stop: asyncio.Event) -> float:
    worst = 0.0
    while not stop.is_set():
        started = time.perf_counter()
        await asyncio.sleep(0.001)
        worst = max(worst, time.perf_counter() - started - 0.001)
    return worst


async def _curl(url: str, key: str, body: bytes) -> tuple[int, bytes]:
    process = await asyncio.create_subprocess_exec(
        "curl", "-s", "-o", "-", "-w", "\n%{http_code}", "-H", f"Authorization: Bearer {key}",
        "-H", "Content-Type: application/json", "--data-binary", "@-", url,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, _ = await process.communicate(body)
    answer, _, status = out.rpartition(b"\n")
    return int(status), answer


async def _lag_during(work) -> tuple[float, object]:
    stop = asyncio.Event()
    monitor = asyncio.create_task(_worst_lag(stop))
    try:
        result = await work
    finally:
        stop.set()
    return await monitor, result


@pytest.mark.parametrize("path, fields", LARGE.values(), ids=LARGE.keys())
async def test_a_large_request_stalls_the_loop_under_50_ms(live, path, fields):
    body = json.dumps({"model": MODEL_NAME, **fields}).encode()
    url, key = live.gw.url + path, live.keys["acme"]
    await _curl(url, key, body)  # warm: the grammar's verdict is cached from here on
    fields_fresh = json.loads(json.dumps(fields).replace("fox", "cat").replace("field", "feld"))
    fresh = json.dumps({"model": MODEL_NAME, **fields_fresh}).encode()  # a new grammar, again
    started = time.perf_counter()
    stall, (status, answer) = await _lag_during(_curl(url, key, fresh))
    took = time.perf_counter() - started
    idle, _ = await _lag_during(asyncio.sleep(took))
    print(
        f"\n{len(fresh) / 1e6:.2f} MB to {path}: answered in {took * 1e3:.0f} ms; the loop's "
        f"worst stall {stall * 1e3:.1f} ms (idle: {idle * 1e3:.1f} ms; target: under "
        f"{STALL_TARGET_S * 1e3:.0f} ms more than idle)"
    )
    assert status == 200, answer[:500]
    assert stall - idle < STALL_LIMIT_S


# An answer a tenant may ask for whose JSON is ~13 MB: echo with 20 top logprobs for each of
# 400 prompt tokens, in each of 60 choices (about a million entries).
LARGE_ANSWER = {"echo": True, "logprobs": 20, "n": 60, "max_tokens": 4}
LARGE_ANSWER_STALL_TARGET_S = 0.100
CONCURRENT_LARGE_ANSWERS = 16


def _with_prompt_logprobs(worker) -> None:
    """The scripted worker scores the prompt (20 top logprobs a token) when asked."""
    real = worker._response

    def response(request, index, step, finish):
        message = real(request, index, step, finish)
        if step == 0 and index == 0 and request.params.HasField("prompt_logprobs"):
            top = request.params.prompt_logprobs
            message.prompt_logprobs.extend(
                worker_pb2.TokenLogprob(
                    token_id=t,
                    logprob=-1.5,
                    top=[worker_pb2.TopLogprob(token_id=k, logprob=-2.0 - k) for k in range(top)],
                )
                for t in request.prompt_token_ids
            )
        return message

    worker._response = response


def _stream_choices(answer: bytes) -> dict[int, list[dict]]:
    """A streamed answer's chunks, by choice index."""
    chunks: dict[int, list[dict]] = {}
    for line in answer.decode().splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:]).get("choices", [{"index": "error"}]):
                chunks.setdefault(choice["index"], []).append(choice)
    return chunks


@pytest.mark.parametrize(("stream", "concurrent"), [(False, 16), (True, 12)], ids=["whole", "sse"])
async def test_large_answers_leave_the_loop_free(live, stream, concurrent):
    """16 whole answers of ~6 MB at once (12 streamed): the loop's worst stall stays under
    100 ms (the target; the assertion is looser, as above)."""
    _with_prompt_logprobs(live.worker)
    prompt = " ".join(CORPUS)[:1500]
    fields = {"model": MODEL_NAME, "prompt": prompt, "stream": stream, **LARGE_ANSWER}
    body = json.dumps(fields).encode()
    url, key = live.gw.url + "/v1/completions", live.keys["acme"]
    status, answer = await _curl(url, key, body)
    assert status == 200, answer[:500]
    if stream:
        choices = _stream_choices(answer)
        first = choices[0][0]["logprobs"]
        echoed = first["top_logprobs"][:-1]  # the prompt's, in each choice's first chunk
        assert len(choices) == 60
        assert all(c[0]["logprobs"]["top_logprobs"][:-1] == echoed for c in choices.values())
    else:
        choices = json.loads(answer)["choices"]
        first = choices[0]["logprobs"]
        assert len(choices) == 60
    assert 350 <= len(first["tokens"]) - 4 * (not stream) <= 450
    assert len(first["top_logprobs"][1]) == 20
    started = time.perf_counter()
    calls = [_curl(url, key, body) for _ in range(concurrent)]
    stall, answers = await _lag_during(asyncio.gather(*calls))
    took = time.perf_counter() - started
    idle, _ = await _lag_during(asyncio.sleep(took))
    print(
        f"\n{concurrent} {'streamed ' if stream else ''}answers of {len(answer) / 1e6:.1f} MB at "
        f"once: answered in {took * 1e3:.0f} ms; the loop's worst stall {stall * 1e3:.1f} ms "
        f"(idle: {idle * 1e3:.1f} ms; target: under {LARGE_ANSWER_STALL_TARGET_S * 1e3:.0f} ms)"
    )
    read = _stream_choices if stream else (lambda a: json.loads(a)["choices"])
    assert all(s == 200 and read(a) == choices for s, a in answers)
    assert stall - idle < STALL_LIMIT_S
