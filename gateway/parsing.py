"""Parse: a validated OpenAI body → a `ParsedRequest`, the one shape the later stages read for
completions and chat alike; what the gateway cannot honour, or a shape past a setting's
bound, is a 400 here, before any lookup or tokenizing.

max_tokens defaults (documented in README): completions 16 (OpenAI's default for the
legacy endpoint), chat the whole remaining context (chat answers end at EOS).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from gateway.protocol import ChatCompletionRequest, CompletionRequest, ShapeLimits
from gateway.responses_api import ResponsesRequest
from gateway.text_check import check_text

COMPLETIONS_DEFAULT_MAX_TOKENS = 16

OpenAIRequest = CompletionRequest | ChatCompletionRequest | ResponsesRequest


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """A completion or chat request with the endpoints' differences settled."""

    body: OpenAIRequest
    id_prefix: str  # of the response's id: "cmpl" or "chatcmpl"
    prompt_param: str  # the field an error about the prompt names: "prompt" or "messages"
    max_tokens: int | None  # as the client asked; None: `default_max_tokens`
    default_max_tokens: int | None  # None: the rest of the context
    logprobs: int | None  # top logprobs the worker reports per token; None: no logprobs
    best_of: int | None = None  # samples to generate when more than n are kept
    # Alternatives the worker reports for each prompt token; None: no prompt logprobs.
    prompt_logprobs: int | None = None

    @property
    def samples(self) -> int:
        """Samples the worker generates: best_of, else n."""
        return self.best_of or self.body.n


def parse(body: OpenAIRequest, *, limits: ShapeLimits, raw: bytes | None = None) -> ParsedRequest:
    """``body`` checked (400 naming the field) and settled for the later stages; a Responses
    request as the chat completion it means (`gateway.responses_api`). Its strings are checked
    first (`gateway.text_check`; ``raw``, the body's bytes, spares the walk when they cannot
    hold invalid text)."""
    check_text(body, raw)
    if isinstance(body, ResponsesRequest):
        return dataclasses.replace(_settled(body.chat, limits), id_prefix="resp")
    return _settled(body, limits)


def _settled(body: CompletionRequest | ChatCompletionRequest, limits: ShapeLimits) -> ParsedRequest:
    body.check_supported()
    body.check_shape(limits)
    if isinstance(body, ChatCompletionRequest):
        return ParsedRequest(
            body,
            id_prefix="chatcmpl",
            prompt_param="messages",
            max_tokens=body.requested_max_tokens,
            default_max_tokens=None,
            logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        )
    best_of = body.samples_to_generate if body.samples_to_generate > body.n else None
    return ParsedRequest(
        body,
        id_prefix="cmpl",
        prompt_param="prompt",
        max_tokens=body.max_tokens,
        default_max_tokens=COMPLETIONS_DEFAULT_MAX_TOKENS,
        # best_of ranks samples by cumulative logprob: the worker must send them.
        logprobs=body.logprobs if body.logprobs is not None or not best_of else 0,
        best_of=best_of,
        prompt_logprobs=body.scored_prompt_logprobs,
    )
