"""What the sampler reads and writes for each row of the logits: the sequence about to get a
token (`SamplingRow`), and the token it drew (`SampledToken`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.sampling.sampling_params import SamplingParams


@dataclass(slots=True)
class SamplingRow:
    """One row of the logits: a sequence about to receive a token."""

    params: SamplingParams
    output_token_ids: list[int]  # generated so far (penalties)
    prompt_token_ids: list[int]  # repetition penalty covers prompt + output, as in vLLM / HF
    generator: torch.Generator | None  # from `make_generator(params.seed)`; None: global RNG


@dataclass(slots=True)
class SampledToken:
    token_id: int
    logprob: float | None  # of the chosen token; None unless params.logprobs is not None
    top_logprobs: list[tuple[int, float]] | None  # params.logprobs best (id, logprob), desc
    # Set when the row could not be sampled (NaN logits, or none above -inf): token_id is
    # then meaningless and the request must end with this message.
    failure: str | None = None


def make_generator(seed: int | None) -> torch.Generator | None:
    """The per-request generator: create once per request (per sequence when n > 1) and keep
    it for the request's life. Always a CPU generator: it draws one number per step."""
    if seed is None:
        return None
    generator = torch.Generator()
    generator.manual_seed(seed)
    return generator
