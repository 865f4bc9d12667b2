"""`gateway.openai_format`: worker deltas (real `GenerateResponse` protobufs) → OpenAI's
completion and chat bodies and stream chunks, with the real tokenizer naming logprob tokens.

Every expected body is written out whole. Logprobs are powers of two so float32 (the wire
type) holds them exactly.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import pytest

from gateway.openai_format import (
    ChatFormat,
    CompletionFormat,
    Header,
    Sample,
    Usage,
    most_likely,
    output_format,
    stop_reason_of,
)
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from rpc import worker_pb2

HEADER = Header(id="cmpl-abc", created=1_700_000_000, model="tiny-chat")
CHAT_HEADER = Header(id="chatcmpl-abc", created=1_700_000_000, model="tiny-chat")
IM_END = 2  # "<|im_end|>"
CALL_ID = re.compile(r"call_[A-Za-z0-9]{24}")
WEATHER_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def char_id(char: str) -> int:
    """The token of one printable ASCII character (the byte alphabet, from "!" = 3)."""
    return 3 + ord(char) - ord("!")


A, B, C = char_id("A"), char_id("B"), char_id("C")


def top(*pairs: tuple[int, float]) -> list[worker_pb2.TopLogprob]:
    return [worker_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in pairs]


def lp(token_id: int, logprob: float, *alternatives: tuple[int, float]) -> worker_pb2.TokenLogprob:
    return worker_pb2.TokenLogprob(token_id=token_id, logprob=logprob, top=top(*alternatives))


def delta(
    text: str = "",
    *,
    index: int = 0,
    logprobs: Sequence[worker_pb2.TokenLogprob] = (),
    finish: str = "",
    stop_token_id: int | None = None,
    stop_string: str | None = None,
    completion_tokens: int = 1,
) -> worker_pb2.GenerateResponse:
    message = worker_pb2.GenerateResponse(
        index=index,
        text=text,
        logprobs=list(logprobs),
        finish_reason=finish,
        completion_tokens=completion_tokens,
    )
    if stop_token_id is not None:
        message.stop_token_id = stop_token_id
    if stop_string is not None:
        message.stop_string = stop_string
    return message


def sample(index: int, text: str, *, finish: str = "stop", logprobs=(), stop=None) -> Sample:
    return Sample(
        index=index, text=text, logprobs=list(logprobs), finish_reason=finish, stop_reason=stop
    )


def chunk(fmt, message, *, first: bool = True, text_offset: int = 0, include_usage=False):
    return fmt.chunk(message, first=first, text_offset=text_offset, include_usage=include_usage)


USAGE = Usage(prompt_tokens=7, completion_tokens=5, cached_tokens=3)
USAGE_BODY = {
    "prompt_tokens": 7,
    "completion_tokens": 5,
    "total_tokens": 12,
    "prompt_tokens_details": {"cached_tokens": 3},
}


def completion_format(tokenizer, logprobs: int | None = None) -> CompletionFormat:
    return CompletionFormat(HEADER, tokenizer, logprobs)


def chat_format(tokenizer, *, logprobs: bool = False, tool_calls: bool = False) -> ChatFormat:
    return ChatFormat(CHAT_HEADER, tokenizer, logprobs, tool_calls=tool_calls)


def completion_body(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {
        "id": "cmpl-abc",
        "object": "text_completion",
        "created": 1_700_000_000,
        "model": "tiny-chat",
        "choices": choices,
        **extra,
    }


def chat_body(obj: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {
        "id": "chatcmpl-abc",
        "object": obj,
        "created": 1_700_000_000,
        "model": "tiny-chat",
        "choices": choices,
        **extra,
    }


def call_ids(calls: list[dict[str, Any]]) -> list[str]:
    """The calls' ids, each checked to be OpenAI-shaped, then blanked for comparison."""
    ids = []
    for call in calls:
        assert CALL_ID.fullmatch(call["id"]), call["id"]
        ids.append(call.pop("id"))
    return ids


# --- small pieces --------------------------------------------------------------------------------


def test_usage_totals_prompt_and_completion():
    assert USAGE.to_dict() == USAGE_BODY
    assert Usage(prompt_tokens=4, completion_tokens=0).to_dict()["prompt_tokens_details"] == {
        "cached_tokens": 0
    }


@pytest.mark.parametrize(
    ("message", "reason"),
    [
        (delta(finish="length"), None),
        (delta(finish="stop", stop_token_id=IM_END), IM_END),
        (delta(finish="stop", stop_token_id=0), 0),  # token 0 is a stop token, not "none"
        (delta(finish="stop", stop_string="\n"), "\n"),
    ],
)
def test_stop_reason_is_the_token_id_or_string_that_stopped_a_sample(message, reason):
    assert stop_reason_of(message) == reason


def cumulative(index: int, *logprobs: float) -> Sample:
    return Sample(index=index, logprobs=[lp(A, value) for value in logprobs], finish_reason="stop")


def test_most_likely_keeps_the_highest_cumulative_logprobs_reindexed():
    samples = [cumulative(0, -1.0, -2.0), cumulative(1, -0.5, -0.5), cumulative(2, -2.0)]
    kept = most_likely(samples, keep=2)
    # sums: -3, -1, -2 → samples 1 then 2, renumbered 0 and 1
    assert [(s.index, sum(e.logprob for e in s.logprobs)) for s in kept] == [(0, -1.0), (1, -2.0)]


def test_most_likely_breaks_ties_by_the_earlier_sample():
    samples = [cumulative(0, -2.0), cumulative(1, -1.0, -0.5), cumulative(2, -1.5)]
    kept = most_likely(samples, keep=1)
    # samples 1 and 2 tie at -1.5: sample 1 (its two logprobs) is kept, as index 0
    assert [(s.index, len(s.logprobs)) for s in kept] == [(0, 2)]


def test_most_likely_of_as_many_as_kept_only_orders_them():
    kept = most_likely([cumulative(0, -4.0), cumulative(1, -0.25)], keep=2)
    assert [(s.index, s.logprobs[0].logprob) for s in kept] == [(0, -0.25), (1, -4.0)]


def test_output_format_follows_the_endpoint(tokenizer):
    user = [{"role": "user", "content": "Hi"}]
    tools = [{"type": "function", "function": {"name": "f"}}]

    def chat(**fields: Any) -> ChatCompletionRequest:
        return ChatCompletionRequest.model_validate(
            {"model": "tiny-chat", "messages": user, **fields}
        )

    completion = CompletionRequest.model_validate(
        {"model": "tiny-chat", "prompt": "Hi", "logprobs": 3}
    )
    assert output_format(completion, HEADER, tokenizer) == CompletionFormat(HEADER, tokenizer, 3)
    assert output_format(chat(logprobs=True), CHAT_HEADER, tokenizer) == ChatFormat(
        CHAT_HEADER, tokenizer, True, tool_calls=False
    )
    assert output_format(chat(tools=tools), CHAT_HEADER, tokenizer) == ChatFormat(
        CHAT_HEADER, tokenizer, False, tool_calls=True
    )
    no_calls = chat(tools=tools, tool_choice="none")
    assert output_format(no_calls, CHAT_HEADER, tokenizer).tool_calls is False


# --- completions ---------------------------------------------------------------------------------


def test_completion_chunk(tokenizer):
    body = chunk(completion_format(tokenizer), delta("AB", index=1))
    assert body == completion_body(
        [{"index": 1, "text": "AB", "logprobs": None, "finish_reason": None, "stop_reason": None}]
    )


def test_completion_chunk_with_include_usage_carries_a_null_usage(tokenizer):
    body = chunk(completion_format(tokenizer), delta("AB"), include_usage=True)
    assert body["usage"] is None
    assert list(body) == ["id", "object", "created", "model", "choices", "usage"]


def test_completion_last_chunk_says_why_it_stopped(tokenizer):
    message = delta("C", finish="stop", stop_string="\n\n")
    assert chunk(completion_format(tokenizer), message)["choices"] == [
        {"index": 0, "text": "C", "logprobs": None, "finish_reason": "stop", "stop_reason": "\n\n"}
    ]


def test_completion_chunk_logprobs_name_tokens_and_offsets_from_the_text_so_far(tokenizer):
    message = delta(
        "AB", logprobs=[lp(A, -0.5, (A, -0.5), (B, -1.5)), lp(B, -0.25, (B, -0.25), (IM_END, -2.0))]
    )
    body = chunk(completion_format(tokenizer, logprobs=2), message, text_offset=5)
    assert body["choices"][0]["logprobs"] == {
        "tokens": ["A", "B"],
        "token_logprobs": [-0.5, -0.25],
        "top_logprobs": [{"A": -0.5, "B": -1.5}, {"B": -0.25, "<|im_end|>": -2.0}],
        "text_offset": [5, 6],
    }


def test_completion_logprobs_zero_gives_empty_alternatives(tokenizer):
    body = chunk(completion_format(tokenizer, logprobs=0), delta("C", logprobs=[lp(C, -0.125)]))
    assert body["choices"][0]["logprobs"] == {
        "tokens": ["C"],
        "token_logprobs": [-0.125],
        "top_logprobs": [{}],
        "text_offset": [0],
    }


def test_completion_response(tokenizer):
    samples = [
        sample(0, "AB", stop=IM_END, logprobs=[lp(A, -0.5, (A, -0.5)), lp(B, -1.0, (C, -0.25))]),
        sample(1, "<|im_end|>C", finish="length", logprobs=[lp(IM_END, -2.0), lp(C, -4.0)]),
    ]
    body = completion_format(tokenizer, logprobs=1).response(samples, USAGE)
    assert body == completion_body(
        [
            {
                "index": 0,
                "text": "AB",
                "logprobs": {
                    "tokens": ["A", "B"],
                    "token_logprobs": [-0.5, -1.0],
                    "top_logprobs": [{"A": -0.5}, {"C": -0.25}],
                    "text_offset": [0, 1],
                },
                "finish_reason": "stop",
                "stop_reason": IM_END,
            },
            {
                "index": 1,
                "text": "<|im_end|>C",
                "logprobs": {
                    "tokens": ["<|im_end|>", "C"],
                    "token_logprobs": [-2.0, -4.0],
                    "top_logprobs": [{}, {}],
                    "text_offset": [0, 10],  # a token's offset advances by its text's length
                },
                "finish_reason": "length",
                "stop_reason": None,
            },
        ],
        usage=USAGE_BODY,
    )


def test_completion_usage_chunk(tokenizer):
    assert completion_format(tokenizer).usage_chunk(USAGE) == completion_body([], usage=USAGE_BODY)


# --- chat ----------------------------------------------------------------------------------------


def test_chat_first_chunk_carries_the_role(tokenizer):
    body = chunk(chat_format(tokenizer), delta("AB"))
    assert body == chat_body(
        "chat.completion.chunk",
        [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": "AB"},
                "logprobs": None,
                "finish_reason": None,
                "stop_reason": None,
            }
        ],
    )


def test_chat_later_chunks_carry_content_only(tokenizer):
    message = delta("C", index=2, finish="stop", stop_token_id=IM_END)
    body = chunk(chat_format(tokenizer), message, first=False, include_usage=True)
    assert body == chat_body(
        "chat.completion.chunk",
        [
            {
                "index": 2,
                "delta": {"content": "C"},
                "logprobs": None,
                "finish_reason": "stop",
                "stop_reason": IM_END,
            }
        ],
        usage=None,
    )


def test_chat_logprobs_name_tokens_with_their_bytes_and_alternatives(tokenizer):
    message = delta("A<|im_end|>", logprobs=[lp(A, -0.5, (A, -0.5), (B, -1.5)), lp(IM_END, -2.0)])
    body = chunk(chat_format(tokenizer, logprobs=True), message)
    im_end = list(b"<|im_end|>")
    assert body["choices"][0]["logprobs"] == {
        "content": [
            {
                "token": "A",
                "logprob": -0.5,
                "bytes": [65],
                "top_logprobs": [
                    {"token": "A", "logprob": -0.5, "bytes": [65]},
                    {"token": "B", "logprob": -1.5, "bytes": [66]},
                ],
            },
            {"token": "<|im_end|>", "logprob": -2.0, "bytes": im_end, "top_logprobs": []},
        ]
    }


def test_chat_logprob_bytes_are_the_tokens_own_bytes(tokenizer):
    # "é" is two byte-level tokens, "Ã" (0xC3) and "©" (0xA9)
    first, second = (tokenizer.tokenizer.token_to_id(piece) for piece in ("Ã", "©"))
    message = delta("é", logprobs=[lp(first, -0.5), lp(second, -0.25)])
    body = chunk(chat_format(tokenizer, logprobs=True), message)
    content = body["choices"][0]["logprobs"]["content"]
    assert [entry["bytes"] for entry in content] == [[0xC3], [0xA9]]
    assert bytes(content[0]["bytes"] + content[1]["bytes"]).decode() == "é"


def test_chat_logprobs_not_asked_for_are_null_even_when_the_worker_sent_them(tokenizer):
    body = chunk(chat_format(tokenizer), delta("A", logprobs=[lp(A, -0.5)]))
    assert body["choices"][0]["logprobs"] is None


def test_chat_response(tokenizer):
    samples = [
        sample(0, "AB", stop=IM_END, logprobs=[lp(A, -0.5), lp(B, -0.25, (B, -0.25))]),
        sample(1, "", finish="length"),
    ]
    body = chat_format(tokenizer, logprobs=True).response(samples, USAGE)
    entry_a = {"token": "A", "logprob": -0.5, "bytes": [65], "top_logprobs": []}
    entry_b = {
        "token": "B",
        "logprob": -0.25,
        "bytes": [66],
        "top_logprobs": [{"token": "B", "logprob": -0.25, "bytes": [66]}],
    }
    assert body == chat_body(
        "chat.completion",
        [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "AB"},
                "finish_reason": "stop",
                "logprobs": {"content": [entry_a, entry_b]},
                "stop_reason": IM_END,
            },
            {
                "index": 1,
                "message": {"role": "assistant", "content": ""},
                "finish_reason": "length",
                "logprobs": {"content": []},
                "stop_reason": None,
            },
        ],
        usage=USAGE_BODY,
    )


def test_chat_usage_chunk(tokenizer):
    assert chat_format(tokenizer).usage_chunk(USAGE) == chat_body(
        "chat.completion.chunk", [], usage=USAGE_BODY
    )


# --- chat with tool calls ------------------------------------------------------------------------


def test_a_whole_answer_with_a_call_splits_into_content_and_tool_calls(tokenizer):
    fmt = chat_format(tokenizer, tool_calls=True)
    body = fmt.response([sample(0, "Let me check. " + WEATHER_CALL)], USAGE)
    [choice] = body["choices"]
    call_ids(choice["message"]["tool_calls"])
    assert choice == {
        "index": 0,
        "message": {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                }
            ],
        },
        "finish_reason": "tool_calls",  # it stopped by itself having called
        "logprobs": None,
        "stop_reason": None,
    }


def test_an_answer_of_calls_only_has_null_content(tokenizer):
    fmt = chat_format(tokenizer, tool_calls=True)
    [choice] = fmt.response([sample(0, WEATHER_CALL + "\n" + WEATHER_CALL)], USAGE)["choices"]
    first, second = call_ids(choice["message"]["tool_calls"])
    assert first != second
    assert choice["message"]["content"] is None
    assert len(choice["message"]["tool_calls"]) == 2


def test_an_answer_cut_short_stays_length_though_it_called(tokenizer):
    fmt = chat_format(tokenizer, tool_calls=True)
    [choice] = fmt.response([sample(0, WEATHER_CALL + " and", finish="length")], USAGE)["choices"]
    call_ids(choice["message"]["tool_calls"])
    assert (choice["message"]["content"], choice["finish_reason"]) == ("and", "length")


def test_an_answer_without_calls_has_no_tool_calls_key(tokenizer):
    fmt = chat_format(tokenizer, tool_calls=True)
    [choice] = fmt.response([sample(0, "  It is sunny.  ")], USAGE)["choices"]
    assert choice["message"] == {"role": "assistant", "content": "It is sunny."}
    assert choice["finish_reason"] == "stop"


def test_a_streamed_call_is_held_back_then_sent_whole(tokenizer):
    """Text that may open `<tool_call>` is held; the block is one delta once it closes."""
    fmt = chat_format(tokenizer, tool_calls=True)
    shown = [
        chunk(fmt, delta("Let me check. "), first=True),
        chunk(fmt, delta("<tool_"), first=False),
        chunk(fmt, delta(WEATHER_CALL.removeprefix("<tool_"), finish="stop"), first=False),
    ]
    assert shown[1] is None  # "<tool_" may start a call
    assert shown[0]["choices"] == [
        {
            "index": 0,
            "delta": {"role": "assistant", "content": "Let me check."},  # trailing space held
            "logprobs": None,
            "finish_reason": None,
            "stop_reason": None,
        }
    ]
    [last] = shown[2]["choices"]
    call_ids(last["delta"]["tool_calls"])
    assert last == {
        "index": 0,
        "delta": {
            "content": None,  # the held space was trailing: dropped
            "tool_calls": [
                {
                    "index": 0,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                }
            ],
        },
        "logprobs": None,
        "finish_reason": "tool_calls",
        "stop_reason": None,
    }


def test_streamed_calls_are_numbered_per_sample(tokenizer):
    fmt = chat_format(tokenizer, tool_calls=True)
    first = chunk(fmt, delta(WEATHER_CALL, index=0))
    other = chunk(fmt, delta(WEATHER_CALL, index=1))
    second = chunk(fmt, delta("\n" + WEATHER_CALL, index=0, finish="stop"), first=False)
    indices = [
        [call["index"] for call in body["choices"][0]["delta"]["tool_calls"]]
        for body in (first, other, second)
    ]
    assert indices == [[0], [0], [1]]
    assert [body["choices"][0]["finish_reason"] for body in (first, other, second)] == [
        None,
        None,
        "tool_calls",
    ]


def test_a_held_back_delta_with_logprobs_still_sends_them(tokenizer):
    fmt = chat_format(tokenizer, logprobs=True, tool_calls=True)
    body = chunk(fmt, delta("<", logprobs=[lp(char_id("<"), -0.5)]))
    assert body["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert body["choices"][0]["logprobs"] == {
        "content": [{"token": "<", "logprob": -0.5, "bytes": [60], "top_logprobs": []}]
    }


@pytest.mark.parametrize("text", ["héllo wörld", "日本語 🙂", "plain ascii", "<|im_end|>"])
def test_token_bytes_join_into_the_text(tokenizer, reference_tokenizer, text):
    ids = reference_tokenizer.encode(text, add_special_tokens=False).ids
    assert b"".join(tokenizer.token_bytes(i) for i in ids).decode() == text
