"""What the engine checks of a request before queueing it: against the model (vocabulary,
context) and the KV cache's size, so a request that can never run is refused at once."""

from __future__ import annotations

import math

from worker.core.block_manager import BlockManager
from worker.core.fairness import MAX_TENANT_WEIGHT, MIN_TENANT_WEIGHT
from worker.errors import InvalidRequestError, RequestTooLargeError
from worker.sampling.sampling_params import SamplingParams


def check_tenant_weight(tenant_weight: float) -> None:
    if not (
        math.isfinite(tenant_weight) and MIN_TENANT_WEIGHT <= tenant_weight <= MAX_TENANT_WEIGHT
    ):
        raise InvalidRequestError(
            f"tenant_weight must be in [{MIN_TENANT_WEIGHT}, {MAX_TENANT_WEIGHT}], "
            f"got {tenant_weight!r}"
        )


def check_request(
    prompt_ids: list[int],
    params: SamplingParams,
    *,
    vocab_size: int,
    max_model_len: int,
    blocks: BlockManager,
) -> None:
    if not prompt_ids:
        raise InvalidRequestError("the prompt is empty")
    vocab = vocab_size
    bad = [t for t in prompt_ids if not 0 <= t < vocab]
    if bad:
        raise InvalidRequestError(f"unknown token ids {bad[:5]} (vocabulary size {vocab})")
    bad = [t for t in params.stop_token_ids if not 0 <= t < vocab]
    if bad:
        raise InvalidRequestError(f"unknown stop_token_ids {bad[:5]} (vocabulary size {vocab})")
    bad = [t for t in params.logit_bias or () if not 0 <= t < vocab]
    if bad:
        raise InvalidRequestError(
            f"unknown logit_bias token ids {bad[:5]} (vocabulary size {vocab})"
        )
    if params.top_k > vocab:
        raise InvalidRequestError(f"top_k is {params.top_k}; the vocabulary has {vocab} tokens")
    if len(prompt_ids) >= max_model_len:
        raise InvalidRequestError(
            f"the prompt has {len(prompt_ids)} tokens; this model's context is "
            f"{max_model_len} tokens, leaving no room to generate"
        )
    longest = min(len(prompt_ids) + params.max_tokens, max_model_len)
    needed = blocks.blocks_needed([], longest)
    if needed > blocks.num_blocks:
        raise RequestTooLargeError(
            f"prompt plus max_tokens ({longest} tokens) needs {needed} KV blocks; "
            f"the whole cache has {blocks.num_blocks}"
        )
