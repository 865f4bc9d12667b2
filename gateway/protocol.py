"""OpenAI request bodies (plus the sampling extras vLLM accepts), as pydantic models.

Every body and part of one is a `gateway.request_model.RequestModel`: `null` for an optional
field means its default (OpenAI's rule). Unknown fields are ignored, as vLLM does: clients and
benchmark tools send many. Fields we
accept but cannot honour are refused with a 400 by `check_supported`, never silently dropped.
Every sampling field is bounded here (the table is in gateway/README.md; the workers check
the same bounds again); NaN and infinity are refused wherever a number is taken (Python's
json parser accepts `NaN` and `Infinity`). Bounds that are settings (stop strings, message
counts) are checked by `check_shape`. The fields that constrain the output (response_format,
tools, vLLM's structured_outputs) are modelled in `gateway.structured.protocol`.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field

from gateway.errors import InvalidRequestError
from gateway.request_model import MAX_PARSED_ITEMS, RequestModel, at_most
from gateway.structured.protocol import (
    MAX_TOOLS,
    ResponseFormat,
    StructuredOutputsParams,
    Tool,
    ToolCall,
    ToolChoice,
    check_tools,
    effective_tool_choice,
)
from gateway.template_switches import ChatTemplateKwargs

MAX_N = 64
MAX_TOP_LOGPROBS = 20
# The workers' limit (worker.sampling.sampling_params; the gateway does not import the engine).
MAX_SPECULATIVE_TOKENS = 16
# The wire format's integer widths (proto/rpc/worker.proto): larger values are refused here
# with a 422 rather than failing inside the gateway with a 500.
INT32_MAX = 2**31 - 1
INT64 = {"ge": -(2**63), "le": 2**63 - 1}
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]


# repetition_penalty divides positive logits: near 0 it overflows them to infinity.
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 2.0
# OpenAI's logit_bias bounds: entries, and each bias (added to the token's logit).
MAX_LOGIT_BIAS_ENTRIES = 300
MAX_LOGIT_BIAS = 100.0
DECIMAL = re.compile(r"[0-9]{1,10}")


@dataclass(frozen=True, slots=True)
class ShapeLimits:
    """Bounds on a request's shape that are settings (`GatewaySettings.max_stop_strings`…)."""

    max_stop_strings: int
    max_stop_string_chars: int
    max_stop_token_ids: int
    max_chat_messages: int
    max_mix_adapters: int = 4

    @classmethod
    def of(cls, settings: Any) -> ShapeLimits:
        return cls(
            max_stop_strings=settings.max_stop_strings,
            max_stop_string_chars=settings.max_stop_string_chars,
            max_stop_token_ids=settings.max_stop_token_ids,
            max_chat_messages=settings.max_chat_messages,
            max_mix_adapters=settings.max_mix_adapters,
        )


# A mix's list is refused past this length before its items are validated; the setting
# `max_mix_adapters` (at most 8) is the bound that matters.
MAX_PARSED_MIX = 64


class AdapterWeight(RequestModel):
    """One adapter of a request's mix (Switchboard's): the caller's adapter name and the
    weight its LoRA delta is summed with."""

    name: str = Field(min_length=1, max_length=256)
    weight: float = Field(ge=0.0, le=1e6)


class StreamOptions(RequestModel):
    include_usage: bool = False


class SamplingFields(RequestModel):
    """What both endpoints share."""

    model: str
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, **INT64)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    # vLLM extras: constraints on the output (at most one source per request).
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM extras.
    top_k: int | None = Field(default=None, ge=-1, le=INT32_MAX)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(
        default=1.0, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY
    )
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] = Field(default_factory=list)
    skip_special_tokens: bool = True
    # Switchboard's: speculative decoding's draft tokens a step at most for this request
    # (0: none); unset: the worker's k. Only speed depends on it, never the output.
    num_speculative_tokens: int | None = Field(default=None, ge=0, le=MAX_SPECULATIVE_TOKENS)
    # Switchboard's: a weighted mix of the caller's adapters instead of one (then `model` names
    # the base model); the request gets the weighted sum of their LoRA deltas.
    adapters: Annotated[list[AdapterWeight] | None, at_most(MAX_PARSED_MIX)] = None

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def check_shape(self, limits: ShapeLimits) -> None:
        """The bounds that are settings; each past its bound is a 400 naming the field."""
        stops = self.stop_strings
        if len(stops) > limits.max_stop_strings:
            raise InvalidRequestError(
                f"at most {limits.max_stop_strings} stop strings are allowed, got {len(stops)}",
                param="stop",
            )
        if any(len(s) > limits.max_stop_string_chars for s in stops):
            raise InvalidRequestError(
                f"a stop string may have at most {limits.max_stop_string_chars} characters",
                param="stop",
            )
        if len(self.stop_token_ids) > limits.max_stop_token_ids:
            raise InvalidRequestError(
                f"at most {limits.max_stop_token_ids} stop_token_ids are allowed, "
                f"got {len(self.stop_token_ids)}",
                param="stop_token_ids",
            )
        if self.adapters is not None:
            check_mix(self.adapters, limit=limits.max_mix_adapters)

    @property
    def constrained_by(self) -> list[str]:
        """The fields that constrain the output, of those a client set."""
        fields = []
        if self.response_format is not None and self.response_format.type != "text":
            fields.append("response_format")
        if self.structured_outputs is not None:
            fields.append("structured_outputs")
        for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
            if getattr(self, name) is not None:
                fields.append(name)
        return fields

    def check_supported(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError(
                "stream_options is only allowed when stream is true", param="stream_options"
            )
        check_logit_bias(self.logit_bias)
        if self.response_format is not None:
            self.response_format.check()
        if self.structured_outputs is not None:
            given = self.structured_outputs.given()
            if len(given) != 1:
                raise InvalidRequestError(
                    "structured_outputs must set exactly one of json, regex, choice, grammar "
                    f"and json_object; it sets {', '.join(given) or 'none'}",
                    param="structured_outputs",
                )
        constrained_by = self.constrained_by
        if len(constrained_by) > 1:
            raise InvalidRequestError(
                "at most one constraint on the output per request; this one sets "
                f"{' and '.join(constrained_by)}",
                param=constrained_by[1],
            )


def check_logit_bias(bias: dict[str, float] | None) -> None:
    """OpenAI's bounds: at most 300 entries, keys token ids in decimal, biases in [-100, 100]
    (the vocabulary bound is the tokenizer's: `gateway.resolution.logit_bias_ids`)."""
    if not bias:
        return
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidRequestError(
            f"logit_bias may have at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(bias)}",
            param="logit_bias",
        )
    for key, value in bias.items():
        if not DECIMAL.fullmatch(key):
            raise InvalidRequestError(
                f"logit_bias keys must be token ids in decimal, got {key[:32]!r}",
                param="logit_bias",
            )
        if not (math.isfinite(value) and -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS):
            raise InvalidRequestError(
                f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                f"got {value} for token {key}",
                param="logit_bias",
            )


class CompletionRequest(SamplingFields):
    endpoint: ClassVar[str] = "completions"  # the metrics label

    prompt: str | list[int] | list[str] | list[list[int]]
    # 0 with echo or prompt_logprobs: score the prompt, generate nothing.
    max_tokens: int | None = Field(default=None, ge=0, le=INT32_MAX)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # The prompt before the completion; with logprobs, the prompt tokens' logprobs too.
    echo: bool = False
    suffix: str | None = None
    # vLLM extra: each prompt token's logprob (after the first) with this many alternatives.
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # Generate best_of samples, return the n with the highest cumulative logprob.
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)

    @property
    def scored_prompt_logprobs(self) -> int | None:
        """The alternatives the worker reports for each prompt token, or None when the
        prompt's logprobs are not needed: echo with logprobs, prompt_logprobs, or a request
        that only scores its prompt (max_tokens 0)."""
        wanted = [self.prompt_logprobs or 0]
        if self.echo and self.logprobs is not None:
            wanted.append(self.logprobs)
        needed = self.prompt_logprobs is not None or len(wanted) > 1 or self.max_tokens == 0
        return max(wanted) if needed else None

    @property
    def samples_to_generate(self) -> int:
        return max(self.best_of or self.n, self.n)

    def single_prompt(self) -> str | list[int]:
        """The one prompt; several (batched) prompts are refused: send one per request."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise InvalidRequestError(
                    "a list of prompts is not supported; send one prompt per request",
                    param="prompt",
                )
            prompt = prompt[0]
        if not prompt:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        return prompt  # type: ignore[return-value]

    def check_supported(self) -> None:
        super().check_supported()
        if self.max_tokens == 0 and not (self.echo or self.prompt_logprobs is not None):
            raise InvalidRequestError(
                "max_tokens may be 0 only with echo or prompt_logprobs (to score the prompt)",
                param="max_tokens",
            )
        if self.suffix:
            raise InvalidRequestError("suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of < self.n:
            raise InvalidRequestError("best_of must be at least n", param="best_of")
        if self.best_of is not None and self.best_of > self.n and self.stream:
            # As OpenAI: the best samples are known only once all of them have finished.
            raise InvalidRequestError("best_of cannot be used with stream", param="best_of")


class TextPart(RequestModel):
    type: str
    text: str | None = None


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message answers this call

    def check(self, index: int, *, calls: set[str]) -> None:
        """This message's own rules; ``calls`` holds the ids of the earlier assistant
        messages' tool calls, which a tool message must answer one of (as OpenAI checks)."""
        if self.tool_calls and self.role != "assistant":
            raise InvalidRequestError(
                "only assistant messages carry tool_calls", param=f"messages.{index}.tool_calls"
            )
        if self.role == "tool" and not self.tool_call_id:
            raise InvalidRequestError(
                "a tool message needs the tool_call_id it answers",
                param=f"messages.{index}.tool_call_id",
            )
        if self.role == "tool" and self.tool_call_id not in calls:
            raise InvalidRequestError(
                "messages with role 'tool' must be a response to a preceding message with "
                f"'tool_calls'; no earlier tool call has the id {self.tool_call_id[:64]!r}",
                param=f"messages.{index}.tool_call_id",
            )

    def for_template(self, index: int) -> dict[str, Any]:
        """`{"role", "content"}` as chat templates expect; text parts are joined. Tool calls
        come as transformers passes them (`tool_calls` with `arguments` parsed to a dict),
        a tool message with its `tool_call_id`."""
        content = self.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise InvalidRequestError(
                        f"content part type {part.type!r} is not supported (text only)",
                        param=f"messages.{index}.content",
                    )
                texts.append(part.text)
            content = "".join(texts)
        # Templates written before OpenAI's "developer" role know it as "system".
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": content or ""}
        if self.tool_calls:
            message["tool_calls"] = [
                _call_for_template(call, f"messages.{index}.tool_calls.{i}")
                for i, call in enumerate(self.tool_calls)
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None and self.role == "tool":
            message["name"] = self.name
        return message


def _call_for_template(call: ToolCall, param: str) -> dict[str, Any]:
    try:
        arguments = json.loads(call.function.arguments)
    except (ValueError, RecursionError) as exc:
        raise InvalidRequestError(
            f"a tool call's arguments must be JSON text: {str(exc)[:200]}",
            param=f"{param}.function.arguments",
        ) from exc
    function = {"name": call.function.name, "arguments": arguments}
    return {"id": call.id, "type": "function", "function": function}


class ChatCompletionRequest(SamplingFields):
    endpoint: ClassVar[str] = "chat"  # the metrics label

    messages: Annotated[list[ChatMessage], at_most(MAX_PARSED_ITEMS)] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: Annotated[list[Tool] | None, at_most(MAX_TOOLS)] = None
    tool_choice: ToolChoice | None = None  # default: "auto" with tools, "none" without
    parallel_tool_calls: bool = True  # False: at most one call
    # OpenAI's deprecated form of tools: refused (with a pointer to tools), never ignored.
    functions: list[Any] | None = None
    function_call: Any = None
    # vLLM extra: False to continue the last message instead of opening an assistant turn.
    add_generation_prompt: bool = True
    # vLLM extra: the template's switches (Qwen3's enable_thinking), bounded to known ones.
    chat_template_kwargs: ChatTemplateKwargs | None = None
    # vLLM extra: a template of the client's own. Refused: a template is code.
    chat_template: str | None = None

    @property
    def template_switches(self) -> dict[str, bool]:
        kwargs = self.chat_template_kwargs
        return kwargs.for_template() if kwargs is not None else {}

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def calls_tools(self) -> bool:
        """The answer may hold tool calls (tools given, tool_choice not "none")."""
        return effective_tool_choice(self.tools, self.tool_choice) != "none"

    def check_shape(self, limits: ShapeLimits) -> None:
        super().check_shape(limits)
        if len(self.messages) > limits.max_chat_messages:
            raise InvalidRequestError(
                f"at most {limits.max_chat_messages} messages are allowed, "
                f"got {len(self.messages)}",
                param="messages",
            )

    def check_supported(self) -> None:
        super().check_supported()
        if self.chat_template is not None:
            raise InvalidRequestError(
                "chat_template is not supported: the model's own template renders every chat",
                param="chat_template",
            )
        for legacy in ("functions", "function_call"):
            if getattr(self, legacy) is not None:
                raise InvalidRequestError(
                    f"{legacy} is not supported; send tools and tool_choice", param=legacy
                )
        constraint = next(iter(self.constrained_by), None)
        check_tools(self.tools, self.tool_choice, constrained_by=constraint)
        calls: set[str] = set()
        for index, message in enumerate(self.messages):
            message.check(index, calls=calls)
            calls.update(call.id for call in message.tool_calls or ())
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError(
                "top_logprobs requires logprobs to be true", param="top_logprobs"
            )


def check_mix(adapters: list[AdapterWeight], *, limit: int) -> None:
    """1 to ``limit`` adapters, each named once; a 400 naming `adapters` otherwise."""
    if not 1 <= len(adapters) <= limit:
        raise InvalidRequestError(
            f"adapters may name 1 to {limit} adapters, got {len(adapters)}", param="adapters"
        )
    names = [a.name for a in adapters]
    repeated = next((n for n in names if names.count(n) > 1), None)
    if repeated is not None:
        raise InvalidRequestError(
            f"adapters names {repeated!r} more than once; each adapter at most once",
            param="adapters",
        )
