"""What scoring a prompt costs beside computing it, in plain prompt tokens.

A request that asks for its prompt's logprobs (``echo`` with ``logprobs``, ``prompt_logprobs``)
has each prompt position projected to the whole vocabulary and log-softmaxed
(``worker.model.prompt_logprobs``): for a small model with a large vocabulary that is a large
part of the token's compute (SmolLM2-135M: the vocabulary projection is 28 M multiply-adds beside
106 M in the layers, and the scored prefill measured 1.2-1.4x the plain one). Fairness and the
step budget count a scored position as ``cost`` plain prompt tokens, so a flood of scored
prompts is charged, and cut to the step budget, by the time it takes.
"""

from __future__ import annotations

import math

from worker.core.sequence import Sequence


def scoring_cost(*, hidden_size: int, vocab_size: int, layer_macs: int, num_layers: int) -> float:
    """A scored prompt position's cost in plain prompt tokens: 1 plus the vocabulary
    projection's multiply-adds over the layers' (``layer_macs``: one layer's projections)."""
    return 1.0 + hidden_size * vocab_size / max(1, layer_macs * num_layers)


def scored_positions(seq: Sequence, start: int, num_tokens: int) -> int:
    """How many of the positions ``start .. start + num_tokens`` score the prompt."""
    if seq.params.prompt_logprobs is None:
        return 0
    return max(0, min(start + num_tokens, seq.num_prompt_tokens) - start)


def work_tokens(seq: Sequence, start: int, num_tokens: int, cost: float) -> int:
    """``num_tokens`` from ``start``, each scored position counted ``cost`` times."""
    scored = scored_positions(seq, start, num_tokens)
    return num_tokens + (math.ceil(scored * (cost - 1.0)) if scored else 0)


def tokens_within(seq: Sequence, start: int, budget: int, cost: float) -> int:
    """The most tokens from ``start`` whose work fits ``budget`` (at least one)."""
    if budget <= 0 or scored_positions(seq, start, budget) == 0:
        return budget
    return max(1, math.floor(budget / cost))
