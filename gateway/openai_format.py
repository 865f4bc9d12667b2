"""Worker outputs → OpenAI response bodies and stream chunks, for chat and for completions.

`ChatFormat` and `CompletionFormat` share one interface (`chunk`, `response`, `usage_chunk`)
so the streaming and collecting code is written once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.tokenizer import ChatTokenizer
from rpc import worker_pb2


@dataclass(slots=True)
class Sample:
    """One of the n samples, accumulated over the worker's deltas."""

    index: int
    text: str = ""
    logprobs: list[worker_pb2.TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    completion_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


def stop_reason_of(message: worker_pb2.GenerateResponse) -> int | str | None:
    which = message.WhichOneof("stop_reason")
    return getattr(message, which) if which else None


def most_likely(samples: list[Sample], keep: int) -> list[Sample]:
    """best_of: the `keep` samples with the highest cumulative logprob, re-indexed 0..keep-1
    in that order (ties: the earlier sample)."""
    ranked = sorted(samples, key=lambda s: (-sum(lp.logprob for lp in s.logprobs), s.index))
    kept = ranked[:keep]
    for index, sample in enumerate(kept):
        sample.index = index
    return kept


@dataclass(frozen=True)
class Header:
    """What every body of one response repeats."""

    id: str
    created: int
    model: str


class OutputFormat(Protocol):
    def chunk(
        self,
        message: worker_pb2.GenerateResponse,
        *,
        first: bool,
        text_offset: int,
        include_usage: bool,
    ) -> dict[str, Any]: ...

    def usage_chunk(self, usage: Usage) -> dict[str, Any]: ...

    def response(self, samples: Sequence[Sample], usage: Usage) -> dict[str, Any]: ...


@dataclass(frozen=True)
class ChatFormat:
    header: Header
    tokenizer: ChatTokenizer
    logprobs: bool

    def _logprobs(self, entries: Sequence[worker_pb2.TokenLogprob]) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        return {"content": [self._entry(e.token_id, e.logprob, e.top) for e in entries]}

    def _entry(self, token_id: int, logprob: float, top: Sequence[Any] = ()) -> dict[str, Any]:
        text = self.tokenizer.token_text(token_id)
        entry: dict[str, Any] = {"token": text, "logprob": logprob, "bytes": list(text.encode())}
        if top is not None:
            entry["top_logprobs"] = [self._entry(t.token_id, t.logprob, None) for t in top]
        return entry

    def chunk(
        self,
        message: worker_pb2.GenerateResponse,
        *,
        first: bool,
        text_offset: int,
        include_usage: bool,
    ) -> dict[str, Any]:
        # The role rides on the sample's first content chunk (no role-only chunk before prefill).
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        delta["content"] = message.text
        choice = {
            "index": message.index,
            "delta": delta,
            "logprobs": self._logprobs(message.logprobs),
            "finish_reason": message.finish_reason or None,
            "stop_reason": stop_reason_of(message),
        }
        body = self._base("chat.completion.chunk", [choice])
        if include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return {**self._base("chat.completion.chunk", []), "usage": usage.to_dict()}

    def response(self, samples: Sequence[Sample], usage: Usage) -> dict[str, Any]:
        choices = [
            {
                "index": s.index,
                "message": {"role": "assistant", "content": s.text},
                "logprobs": self._logprobs(s.logprobs),
                "finish_reason": s.finish_reason,
                "stop_reason": s.stop_reason,
            }
            for s in samples
        ]
        return {**self._base("chat.completion", choices), "usage": usage.to_dict()}

    def _base(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        h = self.header
        return {
            "id": h.id,
            "object": obj,
            "created": h.created,
            "model": h.model,
            "choices": choices,
        }


@dataclass(frozen=True)
class CompletionFormat:
    header: Header
    tokenizer: ChatTokenizer
    logprobs: int | None

    def _logprobs(
        self, entries: Sequence[worker_pb2.TokenLogprob], text_offset: int
    ) -> dict[str, Any] | None:
        if self.logprobs is None:
            return None
        tokens, token_logprobs, top, offsets = [], [], [], []
        for e in entries:
            text = self.tokenizer.token_text(e.token_id)
            tokens.append(text)
            token_logprobs.append(e.logprob)
            top.append({self.tokenizer.token_text(t.token_id): t.logprob for t in e.top})
            offsets.append(text_offset)
            text_offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top,
            "text_offset": offsets,
        }

    def chunk(
        self,
        message: worker_pb2.GenerateResponse,
        *,
        first: bool,
        text_offset: int,
        include_usage: bool,
    ) -> dict[str, Any]:
        choice = {
            "index": message.index,
            "text": message.text,
            "logprobs": self._logprobs(message.logprobs, text_offset),
            "finish_reason": message.finish_reason or None,
            "stop_reason": stop_reason_of(message),
        }
        body = self._base([choice])
        if include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return {**self._base([]), "usage": usage.to_dict()}

    def response(self, samples: Sequence[Sample], usage: Usage) -> dict[str, Any]:
        choices = [
            {
                "index": s.index,
                "text": s.text,
                "logprobs": self._logprobs(s.logprobs, 0),
                "finish_reason": s.finish_reason,
                "stop_reason": s.stop_reason,
            }
            for s in samples
        ]
        return {**self._base(choices), "usage": usage.to_dict()}

    def _base(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        h = self.header
        return {
            "id": h.id,
            "object": "text_completion",
            "created": h.created,
            "model": h.model,
            "choices": choices,
        }


def output_format(
    body: CompletionRequest | ChatCompletionRequest, header: Header, tokenizer: ChatTokenizer
) -> OutputFormat:
    """The format of the body's endpoint, with the logprobs it asked for."""
    if isinstance(body, ChatCompletionRequest):
        return ChatFormat(header, tokenizer, body.logprobs)
    return CompletionFormat(header, tokenizer, body.logprobs)
