"""Per-request sampling settings, validated once when the request arrives."""

from __future__ import annotations

from dataclasses import dataclass, field

from worker.errors import InvalidRequestError

# The most draft tokens one sequence gets in a step (the engine's k and a request's).
MAX_SPECULATIVE_TOKENS = 16


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
    skip_special_tokens: bool = True
    # Speculative decoding for this request: at most this many draft tokens a step (0: none;
    # None: the engine's k). Capped by the engine's k, and moot where it does not speculate:
    # speculation never changes what is generated, only how fast.
    num_speculative_tokens: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        _check(self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}")
        _check(self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, f"top_k must be -1, 0 or positive, got {self.top_k}")
        _check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        _check(
            self.repetition_penalty > 0.0,
            f"repetition_penalty must be > 0, got {self.repetition_penalty}",
        )
        _check(
            -2.0 <= self.presence_penalty <= 2.0,
            f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
        )
        _check(
            -2.0 <= self.frequency_penalty <= 2.0,
            f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
        )
        _check(all(s for s in self.stop), "stop strings must not be empty")
        _check(
            self.logprobs is None or 0 <= self.logprobs <= 20,
            f"logprobs must be between 0 and 20, got {self.logprobs}",
        )
        k = self.num_speculative_tokens
        _check(
            k is None
            or (
                isinstance(k, int) and not isinstance(k, bool) and 0 <= k <= MAX_SPECULATIVE_TOKENS
            ),
            f"num_speculative_tokens must be an integer from 0 to {MAX_SPECULATIVE_TOKENS}, "
            f"got {k!r}",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidRequestError(message)
