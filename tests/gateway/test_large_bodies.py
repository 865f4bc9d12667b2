"""Large answers serialized in pieces give exactly the bytes JSONResponse renders."""

from __future__ import annotations

import math

import pytest
from fastapi.responses import JSONResponse

from gateway.large_bodies import SLICE, chunks_of


def answer(choices: int, tokens: int) -> dict:
    top = [{f'tok{k} é"\\': -0.5 - k for k in range(20)} for _ in range(tokens)]
    logprobs = {
        "tokens": [f"t{i}\n" for i in range(tokens)],
        "token_logprobs": [None] + [-1.0 / (i + 1) for i in range(tokens - 1)],
        "top_logprobs": [None, *top[1:]],
        "text_offset": list(range(tokens)),
    }
    choice = {"index": 0, "text": "ünïcode ☃", "logprobs": logprobs, "finish_reason": "length"}
    return {"id": "cmpl-1", "choices": [{**choice, "index": i} for i in range(choices)],
            "usage": {"prompt_tokens": tokens, "completion_tokens": 4}}  # fmt: skip


@pytest.mark.parametrize(("choices", "tokens"), [(1, 3), (3, SLICE), (2, 2 * SLICE + 7), (0, 1)])
def test_the_pieces_are_jsonresponses_bytes(choices, tokens):
    value = answer(choices, tokens)
    assert b"".join(chunks_of(value)) == JSONResponse(value).body


def test_non_finite_numbers_are_refused_as_jsonresponse_refuses_them():
    with pytest.raises(ValueError):
        JSONResponse({"x": [math.nan]})
    with pytest.raises(ValueError):
        chunks_of({"x": [math.nan] * (SLICE + 1)})
