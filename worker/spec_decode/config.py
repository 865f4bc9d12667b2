"""Speculative decoding's settings, checked when made (nothing is loaded or compiled here:
`worker.spec_decode.setup.build_speculator` does that from a valid config)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from worker.errors import SpeculativeConfigError
from worker.sampling.sampling_params import MAX_SPECULATIVE_TOKENS
from worker.spec_decode.proposal import MAX_ALTERNATIVES, NUM_ALTERNATIVES

DEFAULT_SPECULATIVE_TOKENS = 4


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """``model``: ``"ngram"`` (prompt lookup), a draft checkpoint sharing the target's
    vocabulary, or None (off). ``num_tokens`` is k, the most drafts a sequence gets in a
    step (None: 4 when a model is set); each gets as many as its acceptance makes worth
    their cost (``BackoffPolicy``). Speculation is off for steps with more than
    ``max_batch_size`` decoding sequences, and paused for a sequence whose drafts are not
    worth their cost or whose acceptance per position falls below ``min_acceptance``. The
    costs a draft must cover, relative to a plain decode step: ``position_cost`` per
    position and decoding sequence (None: measured at start by timing the forward pass by
    rows) and ``draft_cost`` per draft token (None: the draft's weights over the target's;
    0 for prompt lookup). A draft model also offers up to ``alternatives`` runner-up tokens
    per draft, each verified in a row of its own. ``draft_quantization`` (CPU): "int4",
    "int8", "none" or "auto" (int4 where the native kernel builds)."""

    model: str | Path | None = None
    num_tokens: int | None = None
    max_batch_size: int = 8
    min_acceptance: float = 0.0
    position_cost: float | None = None
    draft_cost: float | None = None
    alternatives: int = NUM_ALTERNATIVES
    draft_quantization: str = "auto"

    def __post_init__(self) -> None:
        if self.model is None:
            if self.num_tokens:
                raise SpeculativeConfigError(
                    "num_speculative_tokens is set but speculative_model is not: "
                    "give a draft checkpoint path or 'ngram'"
                )
            return
        k = self.k
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise SpeculativeConfigError(
                f"num_speculative_tokens must be an integer from 1 to {MAX_SPECULATIVE_TOKENS}, "
                f"got {k!r}"
            )
        alternatives = self.alternatives
        if (
            isinstance(alternatives, bool)
            or not isinstance(alternatives, int)
            or not 0 <= alternatives <= MAX_ALTERNATIVES
        ):
            raise SpeculativeConfigError(
                f"speculative_alternatives must be an integer from 0 to {MAX_ALTERNATIVES}, "
                f"got {alternatives!r}"
            )
        if self.max_batch_size < 0 or not 0.0 <= self.min_acceptance <= 1.0:
            raise SpeculativeConfigError(
                "speculative_max_batch_size must be >= 0 and speculative_min_acceptance in [0, 1]"
            )
        if (self.position_cost is not None and self.position_cost < 0) or (
            self.draft_cost is not None and self.draft_cost < 0
        ):
            raise SpeculativeConfigError(
                "speculative_position_cost and speculative_draft_cost must be >= 0"
            )

    @property
    def enabled(self) -> bool:
        return self.model is not None

    @property
    def k(self) -> int:
        return DEFAULT_SPECULATIVE_TOKENS if self.num_tokens is None else self.num_tokens
