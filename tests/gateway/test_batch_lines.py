"""A batch's input lines (gateway/batch/lines.py): what breaks a file, what is a line's own
error (the interactive API's), and the record script that writes a line once with its
billing, on the real Redis."""

from __future__ import annotations

import json

import pytest

from gateway.batch.lines import (
    InputLine,
    Kind,
    LineError,
    LineRecorder,
    read_input,
    recorded_line,
    request_of,
)
from gateway.errors import InvalidRequestError
from gateway.protocol import ChatCompletionRequest
from gateway.tenancy.usage import UsageDelta, read_usage

CHAT = "/v1/chat/completions"


def row(custom_id="a", url=CHAT, body=None, method="POST") -> str:
    body = (
        body if body is not None else {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    )
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


def test_a_good_file_reads_into_its_lines():
    lines = read_input(f"{row('a')}\n{row('b')}\n".encode(), endpoint=CHAT, max_lines=10)
    assert [(x.index, x.custom_id) for x in lines] == [(0, "a"), (1, "b")]


@pytest.mark.parametrize(
    "text,expected",
    [
        (b"", [(1, "empty_file")]),
        (b"\xff\xfe", [(1, "invalid_json_line")]),
        (f"{row()}\nnot json\n".encode(), [(2, "invalid_json_line")]),
        (f"{row('a')}\n{row('a')}\n".encode(), [(2, "duplicate_custom_id")]),
        (f"{row(url='/v1/completions')}\n".encode(), [(1, "mismatched_url")]),
        (f"{row(method='GET')}\n".encode(), [(1, "invalid_method")]),
        (f"{row(body=[1])}\n".encode(), [(1, "invalid_request")]),
        (f"{row(custom_id='')}\n".encode(), [(1, "invalid_request")]),
        (("\n".join(row(str(i)) for i in range(4))).encode(), [(4, "too_many_lines")]),
    ],
)
def test_a_broken_file_names_its_lines(text, expected):
    found = read_input(text, endpoint=CHAT, max_lines=3)
    assert all(isinstance(e, LineError) for e in found)
    assert [(e.line, e.code) for e in found] == expected


def test_a_bodys_schema_error_is_the_interactive_apis_400():
    line = InputLine(0, "a", {"model": "m", "messages": "not a list"})
    with pytest.raises(InvalidRequestError) as refused:
        request_of(line, CHAT)
    assert refused.value.status == 400 and refused.value.code == "invalid_value"
    assert refused.value.param == "messages"
    with pytest.raises(InvalidRequestError, match="stream"):
        request_of(InputLine(0, "a", {"model": "m", "messages": [], "stream": True}), CHAT)
    messages = [{"role": "user", "content": "x"}]
    body = request_of(InputLine(0, "a", {"model": "m", "messages": messages}), CHAT)
    assert isinstance(body, ChatCompletionRequest)


async def test_a_line_is_recorded_and_billed_once(redis_client, redis_prefix):
    recorder = LineRecorder(redis_client, prefix=redis_prefix)
    batch_key, lines_key = redis_prefix + "{acme}:batch:b", redis_prefix + "{acme}:batch:b:lines"
    await redis_client.hset(batch_key, mapping={"status": "in_progress"})
    usage = UsageDelta(model="sql", prompt_tokens=5, completion_tokens=7, cached_tokens=2)
    args = dict(tenant="acme", lines_key=lines_key, batch_key=batch_key, index=3)
    first = await recorder.record(**args, kind=Kind.OUTPUT, line={"custom_id": "x"}, usage=usage)
    again = await recorder.record(**args, kind=Kind.ERROR, line={"custom_id": "y"}, usage=usage)
    assert (first, again) == (1, 0)
    assert recorded_line(await redis_client.hget(lines_key, "3")) == ("o", {"custom_id": "x"})
    batch = await redis_client.hgetall(batch_key)
    assert (batch["completed"], batch.get("failed"), batch["input_tokens"]) == ("1", None, "5")
    assert (batch["output_tokens"], batch["cached_tokens"]) == ("7", "2")
    from gateway.tenancy.quotas import utc_day

    (usage_row,) = await read_usage(
        redis_client, prefix=redis_prefix, tenants=["acme"], days=[utc_day()]
    )
    assert (usage_row["model"], usage_row["requests"], usage_row["total_tokens"]) == ("sql", 1, 12)


async def test_a_final_batch_takes_no_more_lines(redis_client, redis_prefix):
    recorder = LineRecorder(redis_client, prefix=redis_prefix)
    batch_key = redis_prefix + "{acme}:batch:b"
    await redis_client.hset(batch_key, mapping={"status": "completed"})
    outcome = await recorder.record(
        tenant="acme", lines_key=batch_key + ":lines", batch_key=batch_key, index=0,
        kind=Kind.OUTPUT, line={}, usage=UsageDelta(model="m", prompt_tokens=1),
    )  # fmt: skip
    assert outcome == -1 and not await redis_client.exists(batch_key + ":lines")
