"""Per-request sampling settings, validated once when the request arrives.

The worker re-checks every value because the gateway is not its only client. The bounds
are these constants (the gateway's table, gateway/protocol.py, must lie within them):
OpenAI's ranges where OpenAI has the field, vLLM's otherwise, and a cap where neither has
one. Every float must be finite. The checks that need the model (top_k and stop_token_ids
against the vocabulary, the prompt against the context) are the engine's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from worker.errors import InvalidRequestError
from worker.sampling.structured_output import StructuredOutput

# The most draft tokens one sequence gets in a step (the engine's k and a request's).
MAX_SPECULATIVE_TOKENS = 16
# Wider than OpenAI's 2 (vLLM has no cap): past 100 a distribution is flat anyway.
MAX_TEMPERATURE = 100.0
# (0, 2]: HF and vLLM only ask > 0; the sampler is safe for any positive value, but past
# 2 (or near 0) the penalty only ever picks garbage.
MAX_REPETITION_PENALTY = 2.0
# presence_penalty and frequency_penalty lie in [-MAX_PENALTY, MAX_PENALTY] (OpenAI).
MAX_PENALTY = 2.0
MAX_LOGPROBS = 20  # OpenAI's top_logprobs
MAX_N = 128  # OpenAI's n
MAX_TOKENS = 2**31 - 1  # the engine stops at its context length anyway
MAX_STOP_STRINGS = 32  # OpenAI takes 4; each is checked against every new piece of text
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
SEED_RANGE = (-(2**63), 2**63 - 1)  # int64, as on the wire
MAX_LOGIT_BIAS_TOKENS = 1024  # OpenAI takes 300
MAX_LOGIT_BIAS = 100.0  # OpenAI's range: -100 bans a token, 100 all but forces it


@dataclass(slots=True)
class SamplingParams:
    """What to generate and how; names and defaults follow vLLM (and so OpenAI's API)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    # 0 or -1 disables top-k, as in vLLM.
    top_k: int = 0
    min_p: float = 0.0
    # A per-request generator makes the sample independent of batch composition.
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # Number of top alternatives to return with each sampled token (None: no logprobs).
    logprobs: int | None = None
    # The same for each prompt token after the first (`worker.model.prompt_logprobs`; None:
    # none). With it, max_tokens may be 0: the prompt is scored and nothing is generated.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # Speculative decoding for this request: at most this many draft tokens a step (0: none;
    # None: the engine's k). Capped by the engine's k, and moot where it does not speculate:
    # speculation never changes what is generated, only how fast.
    num_speculative_tokens: int | None = None
    # Added to the logits of these token ids before sampling (OpenAI's logit_bias).
    logit_bias: dict[int, float] | None = None
    # The output must match this grammar (constrained decoding); None: free text.
    structured_output: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        self._check_numbers()
        self._check_stops()
        self._check_logit_bias()
        _check(
            self.structured_output is None or isinstance(self.structured_output, StructuredOutput),
            "structured_output must be a StructuredOutput",
        )

    def _check_numbers(self) -> None:
        least = 0 if self.prompt_logprobs is not None else 1  # 0: score the prompt only
        _check_int(
            "max_tokens", self.max_tokens, least, MAX_TOKENS,
            f"max_tokens must be at least {least} and at most {MAX_TOKENS}, got "
            f"{self.max_tokens!r}",
        )  # fmt: skip
        _check_float("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        _check_float("top_p", self.top_p, 0.0, 1.0, open_low=True)
        _check_int("top_k", self.top_k, 0, None, "top_k must be -1, 0 or positive")
        _check_float("min_p", self.min_p, 0.0, 1.0)
        _check_float(
            "repetition_penalty", self.repetition_penalty, 0.0, MAX_REPETITION_PENALTY,
            open_low=True,
        )  # fmt: skip
        _check_float("presence_penalty", self.presence_penalty, -MAX_PENALTY, MAX_PENALTY)
        _check_float("frequency_penalty", self.frequency_penalty, -MAX_PENALTY, MAX_PENALTY)
        if self.seed is not None:
            _check_int("seed", self.seed, *SEED_RANGE)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        if self.num_speculative_tokens is not None:
            _check_int(
                "num_speculative_tokens", self.num_speculative_tokens, 0, MAX_SPECULATIVE_TOKENS
            )

    def _check_stops(self) -> None:
        _check(
            len(self.stop) <= MAX_STOP_STRINGS,
            f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}",
        )
        _check(
            all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_CHARS for s in self.stop),
            f"stop strings must be 1 to {MAX_STOP_STRING_CHARS} characters",
        )
        _check(
            len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
            f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(self.stop_token_ids)}",
        )
        _check(all(_is_int(t) for t in self.stop_token_ids), "stop_token_ids must be integers")

    def _check_logit_bias(self) -> None:
        if not self.logit_bias:
            self.logit_bias = None
            return
        bias = self.logit_bias
        _check(
            isinstance(bias, dict) and len(bias) <= MAX_LOGIT_BIAS_TOKENS,
            f"logit_bias may have at most {MAX_LOGIT_BIAS_TOKENS} entries",
        )
        _check(all(_is_int(t) and t >= 0 for t in bias), "logit_bias keys must be token ids")
        for value in bias.values():
            _check_float("logit_bias", value, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """Whether the logits change before sampling: penalties or a logit bias."""
        return (
            self.logit_bias is not None
            or self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidRequestError(message)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(
    name: str, value: object, low: int, high: int | None, message: str | None = None
) -> None:
    ok = _is_int(value) and low <= value and (high is None or value <= high)  # type: ignore[operator]
    upper = f" to {high}" if high is not None else " or more"
    _check(ok, message or f"{name} must be an integer from {low}{upper}, got {value!r}")


def _check_float(
    name: str, value: object, low: float, high: float, *, open_low: bool = False
) -> None:
    """A finite number in [low, high] ((low, high] with ``open_low``); NaN and inf fail."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    ok = number and math.isfinite(value) and (low < value if open_low else low <= value)  # type: ignore[arg-type, operator]
    ok = ok and value <= high  # type: ignore[operator]
    bracket = "(" if open_low else "["
    _check(ok, f"{name} must be a number in {bracket}{low}, {high}], got {value!r}")
