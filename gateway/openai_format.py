"""Worker outputs → OpenAI response bodies and stream chunks, for chat and for completions.

`ChatFormat` and `CompletionFormat` share one interface (`chunk`, `response`, `usage_chunk`)
so the streaming and collecting code is written once. A chat whose answer may call tools
splits each sample's text into content and `tool_calls` (`gateway.structured.tool_parsing`); its
finish_reason is "tool_calls" when a sample that stopped by itself made a call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from gateway.prompt_echo import EchoedPrompt, top_by_text
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.structured.tool_parsing import ParsedCall, ToolCallStream, ToolOutput, parse_tool_calls
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
    # The prompt's logprobs (tokens 1..P-1), when asked for: one list, shared by the samples.
    prompt_logprobs: Sequence[worker_pb2.TokenLogprob] = ()


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
    ) -> dict[str, Any] | list[dict[str, Any]] | None:
        """The stream chunk (or events) of one worker delta; None when it has nothing to show
        yet."""
        ...

    def usage_chunk(self, usage: Usage) -> dict[str, Any] | list[dict[str, Any]]: ...

    def response(self, samples: Sequence[Sample], usage: Usage) -> dict[str, Any]: ...


@dataclass(frozen=True)
class ChatFormat:
    header: Header
    tokenizer: ChatTokenizer
    logprobs: bool
    tool_calls: bool = False  # the answer may call tools: parse them out of the text
    # Each streamed sample's tool-call parser, by sample index.
    _calls: dict[int, ToolCallStream] = field(default_factory=dict, init=False, repr=False)

    def _logprobs(self, entries: Sequence[worker_pb2.TokenLogprob]) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        return {"content": [self._entry(e.token_id, e.logprob, e.top) for e in entries]}

    def _entry(self, token_id: int, logprob: float, top: Sequence[Any] = ()) -> dict[str, Any]:
        text = self.tokenizer.token_text(token_id)
        token_bytes = list(self.tokenizer.token_bytes(token_id))  # its own, not U+FFFD's
        entry: dict[str, Any] = {"token": text, "logprob": logprob, "bytes": token_bytes}
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
    ) -> dict[str, Any] | None:
        # The role rides on the sample's first content chunk (no role-only chunk before prefill).
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        finish_reason = message.finish_reason or None
        if self.tool_calls:
            piece, finish_reason = self._tool_piece(message)
            if not (piece.content or piece.calls or finish_reason or message.logprobs):
                return None  # held back: it may start a call
            delta["content"] = piece.content or None
            if piece.calls:
                stream = self._calls[message.index]
                first_index = stream.calls_made - len(piece.calls)
                delta["tool_calls"] = [
                    _call_delta(call, first_index + i) for i, call in enumerate(piece.calls)
                ]
        else:
            delta["content"] = message.text
        choice = {
            "index": message.index,
            "delta": delta,
            "logprobs": self._logprobs(message.logprobs),
            "finish_reason": finish_reason,
            "stop_reason": stop_reason_of(message),
        }
        body = self._base("chat.completion.chunk", [choice])
        if include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return {**self._base("chat.completion.chunk", []), "usage": usage.to_dict()}

    def _tool_piece(self, message: worker_pb2.GenerateResponse) -> tuple[ToolOutput, str | None]:
        """What a delta adds to its sample's content and calls, and its finish_reason."""
        stream = self._calls.setdefault(message.index, ToolCallStream())
        piece = stream.feed(message.text)
        if not message.finish_reason:
            return piece, None
        piece = piece + stream.finish()
        return piece, _finish_reason(message.finish_reason, called=stream.calls_made > 0)

    def response(self, samples: Sequence[Sample], usage: Usage) -> dict[str, Any]:
        choices = [
            {
                "index": s.index,
                **self._message(s),
                "logprobs": self._logprobs(s.logprobs),
                "stop_reason": s.stop_reason,
            }
            for s in samples
        ]
        return {**self._base("chat.completion", choices), "usage": usage.to_dict()}

    def _message(self, sample: Sample) -> dict[str, Any]:
        """A sample's `message` and `finish_reason`."""
        if not self.tool_calls:
            message = {"role": "assistant", "content": sample.text}
            return {"message": message, "finish_reason": sample.finish_reason}
        parsed = parse_tool_calls(sample.text)
        message = {"role": "assistant", "content": parsed.content or None}
        if parsed.calls:
            message["tool_calls"] = [call.to_dict() for call in parsed.calls]
        finish_reason = _finish_reason(sample.finish_reason, called=bool(parsed.calls))
        return {"message": message, "finish_reason": finish_reason}

    def _base(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        h = self.header
        return {
            "id": h.id,
            "object": obj,
            "created": h.created,
            "model": h.model,
            "choices": choices,
        }


def _finish_reason(reason: str | None, *, called: bool) -> str | None:
    """A sample that ended by itself having made calls ends with "tool_calls" (not one cut
    short: that stays "length")."""
    return "tool_calls" if called and reason == "stop" else reason


def _call_delta(call: ParsedCall, index: int) -> dict[str, Any]:
    """One whole call as a stream delta's `tool_calls` entry."""
    return {"index": index, **call.to_dict()}


@dataclass(frozen=True)
class CompletionFormat:
    header: Header
    tokenizer: ChatTokenizer
    logprobs: int | None
    # The prompt, when the answer shows it: its text before each sample's (``echo``, with
    # its tokens' logprobs first), or vLLM's `prompt_logprobs` on each choice.
    prompt: EchoedPrompt | None = None
    echo: bool = False
    prompt_logprobs: int | None = None
    # Streamed: the prompt's logprobs, from the worker's first message that carries them.
    _prompt: list[Sequence[worker_pb2.TokenLogprob]] = field(
        default_factory=list, init=False, repr=False, compare=False
    )
    # The echoed prompt's logprobs, built once for all of a request's choices (n up to 128
    # of them would otherwise each rebuild the same ~prompt x alternatives entries).
    _echoed: dict[int, tuple[Sequence[worker_pb2.TokenLogprob], dict[str, list[Any]]]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def _logprobs(
        self,
        entries: Sequence[worker_pb2.TokenLogprob],
        text_offset: int,
        prompt: Sequence[worker_pb2.TokenLogprob] | None = None,
    ) -> dict[str, Any] | None:
        """The legacy `logprobs` object; ``prompt``: the echoed prompt's entries first."""
        if self.logprobs is None:
            return None
        tokens, token_logprobs, top, offsets = [], [], [], []
        if self.echo and self.prompt is not None:
            if prompt is not None:
                echoed = self._echoed_logprobs(prompt)
                tokens, token_logprobs = list(echoed["tokens"]), list(echoed["token_logprobs"])
                top, offsets = list(echoed["top_logprobs"]), list(echoed["text_offset"])
            text_offset += len(self.prompt.text(self.tokenizer))
        for e in entries:
            text = self.tokenizer.token_text(e.token_id)
            tokens.append(text)
            token_logprobs.append(e.logprob)
            top.append(top_by_text(self.tokenizer, e.top))
            offsets.append(text_offset)
            text_offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top,
            "text_offset": offsets,
        }

    def _echoed_logprobs(self, prompt: Sequence[worker_pb2.TokenLogprob]) -> dict[str, list[Any]]:
        """The prompt's legacy logprobs, shared by the choices (each copies the lists before
        adding its own tokens; the entries themselves are never changed)."""
        assert self.prompt is not None and self.logprobs is not None
        cached = self._echoed.get(id(prompt))
        if cached is None or cached[0] is not prompt:
            built = self.prompt.legacy_logprobs(self.tokenizer, prompt, self.logprobs)
            cached = self._echoed[id(prompt)] = (prompt, built)
        return cached[1]

    def _choice(
        self,
        index: int,
        text: str,
        entries: Sequence[worker_pb2.TokenLogprob],
        *,
        text_offset: int,
        prompt: Sequence[worker_pb2.TokenLogprob] | None,
    ) -> dict[str, Any]:
        """A choice's text and logprobs; ``prompt`` (the prompt's logprobs) where the
        choice shows its prompt: a whole response, or a sample's first chunk."""
        shown = self.prompt if prompt is not None else None
        if self.echo and shown is not None:
            text = shown.text(self.tokenizer) + text
        choice: dict[str, Any] = {
            "index": index,
            "text": text,
            "logprobs": self._logprobs(entries, text_offset, prompt),
        }
        if self.prompt_logprobs is not None:
            choice["prompt_logprobs"] = (
                None
                if shown is None
                else shown.vllm_logprobs(self.tokenizer, prompt or (), self.prompt_logprobs)
            )
        return choice

    def chunk(
        self,
        message: worker_pb2.GenerateResponse,
        *,
        first: bool,
        text_offset: int,
        include_usage: bool,
    ) -> dict[str, Any]:
        if message.prompt_logprobs and not self._prompt:
            self._prompt.append(message.prompt_logprobs)
        prompt = (self._prompt[0] if self._prompt else ()) if first else None
        choice = {
            **self._choice(
                message.index,
                message.text,
                message.logprobs,
                text_offset=text_offset,
                prompt=prompt if self.prompt is not None else None,
            ),
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
                **self._choice(
                    s.index,
                    s.text,
                    s.logprobs,
                    text_offset=0,
                    prompt=s.prompt_logprobs if self.prompt is not None else None,
                ),
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
    body: CompletionRequest | ChatCompletionRequest,
    header: Header,
    tokenizer: ChatTokenizer,
    prompt_ids: list[int] | None = None,
) -> OutputFormat:
    """The format of the body's endpoint, with the logprobs it asked for; a completion that
    echoes its prompt or asks its prompt's logprobs shows ``prompt_ids``."""
    if isinstance(body, ChatCompletionRequest):
        return ChatFormat(header, tokenizer, body.logprobs, tool_calls=body.calls_tools)
    prompt = None
    if body.echo or body.prompt_logprobs is not None:
        given = body.single_prompt()
        prompt = EchoedPrompt(list(prompt_ids or ()), given if isinstance(given, str) else None)
    return CompletionFormat(
        header,
        tokenizer,
        body.logprobs,
        prompt=prompt,
        echo=body.echo,
        prompt_logprobs=body.prompt_logprobs,
    )
