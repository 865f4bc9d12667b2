"""A sequence's cached prefix when it is admitted: the cached blocks that hold its leading
tokens, and the lookup counted in the cache's statistics (`prefix_cache` names the blocks;
the `BlockManager` holds them)."""

from __future__ import annotations

from worker.core.block_manager import BlockManager
from worker.core.prefix_cache import extend_block_hashes
from worker.core.sequence import Sequence


def prefix_hits(blocks: BlockManager, seq: Sequence) -> list[int]:
    """Cached blocks holding ``seq``'s leading tokens; the last token is always computed,
    since its logits are needed. None while ``seq`` still needs its prompt logprobs: a cached
    prefix has no hidden states to score its tokens with (``worker.model.prompt_logprobs``)."""
    if not blocks.enable_caching or _scoring_prompt(seq):
        return []
    bs = blocks.block_size
    extend_block_hashes(seq.block_hashes, seq.cache_root, seq.tokens, bs)
    return blocks.match_prefix(seq.block_hashes[: (seq.num_tokens - 1) // bs])


def count_lookup(blocks: BlockManager, seq: Sequence, num_hit_tokens: int) -> None:
    """Count an admission's lookup in the cache's stats (and, the first time, in the
    request's cached prompt tokens)."""
    if not blocks.enable_caching:
        return
    stats = blocks.stats
    stats.queries += seq.num_tokens
    stats.hits += num_hit_tokens
    if seq.metrics.first_scheduled_time is None:  # first admission, not a recompute
        seq.num_cached_tokens = min(num_hit_tokens, seq.num_prompt_tokens)


def _scoring_prompt(seq: Sequence) -> bool:
    pending = seq.prompt_logprobs
    return pending is not None and bool(pending) and pending[-1] is None
