"""The prompt in a completion's answer: `echo` (the prompt's text before the completion's)
and the prompt tokens' logprobs, both as OpenAI's legacy completions return them and as
vLLM's `prompt_logprobs` extra.

The worker scores prompt tokens 1..P-1 in its prefill pass (`worker.model.prompt_logprobs`);
the first token has no logprob (nothing comes before it), so it is `null` in both shapes.
`text_offset` counts characters of the echoed text: each token's bytes are fed to an
incremental UTF-8 decoder, so a token holding part of a character starts where that
character starts, and the offsets agree with the text the tokens decode to.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.tokenizer import ChatTokenizer
from rpc import worker_pb2


@dataclass
class EchoedPrompt:
    """A completion's prompt, as its answer shows it: ``given``, the prompt as sent when it
    was text (else the token ids are decoded)."""

    ids: list[int]
    given: str | None
    _text: str | None = field(default=None, init=False, repr=False)

    def text(self, tokenizer: ChatTokenizer) -> str:
        if self._text is None:
            self._text = self.given
            if self._text is None:
                self._text = tokenizer.tokenizer.decode(self.ids, skip_special_tokens=False)
        return self._text

    def legacy_logprobs(
        self,
        tokenizer: ChatTokenizer,
        entries: Sequence[worker_pb2.TokenLogprob],
        top: int,
    ) -> dict[str, list[Any]]:
        """OpenAI's `logprobs` object over the prompt's tokens (the completion's follow)."""
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        offsets, chars = [], 0
        for token_id in self.ids:
            offsets.append(chars)
            chars += len(decoder.decode(tokenizer.token_bytes(token_id)))
        entries = _aligned(entries, len(self.ids))
        return {
            "tokens": [tokenizer.token_text(t) for t in self.ids],
            "token_logprobs": [None if e is None else e.logprob for e in entries],
            "top_logprobs": [None if e is None else _top(tokenizer, e, top) for e in entries],
            "text_offset": offsets,
        }

    def vllm_logprobs(
        self,
        tokenizer: ChatTokenizer,
        entries: Sequence[worker_pb2.TokenLogprob],
        top: int,
    ) -> list[dict[str, dict[str, Any]] | None]:
        """vLLM's `prompt_logprobs`: per prompt token, None for the first, else the token's
        own entry and the ``top`` most likely, by token id, each with its rank (1: the most
        likely; the prompt's token outside the top has no rank here: null)."""
        rows: list[dict[str, dict[str, Any]] | None] = []
        for token_id, e in zip(self.ids, _aligned(entries, len(self.ids)), strict=True):
            if e is None:
                rows.append(None)
                continue
            alternatives = list(e.top[:top])
            ranks = {t.token_id: rank for rank, t in enumerate(alternatives, start=1)}
            row = {str(token_id): _vllm_entry(tokenizer, token_id, e.logprob, ranks.get(token_id))}
            for t in alternatives:
                entry = _vllm_entry(tokenizer, t.token_id, t.logprob, ranks[t.token_id])
                row.setdefault(str(t.token_id), entry)
            rows.append(row)
        return rows


def top_by_text(
    tokenizer: ChatTokenizer, alternatives: Sequence[worker_pb2.TopLogprob]
) -> dict[str, float]:
    """The legacy `top_logprobs` entry, keyed by token text: two tokens with one text (byte
    pieces of different characters both read "\ufffd") keep the likelier one."""
    top: dict[str, float] = {}
    for t in alternatives:  # most likely first
        top.setdefault(tokenizer.token_text(t.token_id), t.logprob)
    return top


def _top(tokenizer: ChatTokenizer, e: worker_pb2.TokenLogprob, top: int) -> dict[str, float]:
    return top_by_text(tokenizer, e.top[:top])


def _vllm_entry(tokenizer: ChatTokenizer, token_id: int, logprob: float, rank: int | None):
    return {"logprob": logprob, "rank": rank, "decoded_token": tokenizer.token_text(token_id)}


def _aligned(
    entries: Sequence[worker_pb2.TokenLogprob], num_tokens: int
) -> list[worker_pb2.TokenLogprob | None]:
    """One entry per prompt token: None for the first (and for any the worker did not send)."""
    rows: list[worker_pb2.TokenLogprob | None] = [None, *entries][:num_tokens]
    return rows + [None] * (num_tokens - len(rows))
