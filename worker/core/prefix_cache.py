"""Automatic prefix caching: content hashes of full KV blocks, and the cache's counters.

A full block is named by a hash chain, as in vLLM's automatic prefix caching and SGLang's
RadixAttention (Zheng et al., 2024): ``h_i = H(h_{i-1}, tokens of block i)``, seeded with
``h_root = H(adapter content id, cache-isolation salt)``. Two blocks share a hash only if
everything before them matches too, under the same adapter (LoRA on k/v changes the K/V)
and the same salt (by default the tenant, so tenants never see each other's cache timing).
H is SHA-256: a collision would silently serve another prompt's K/V, so Python's ``hash``
(64 bits, predictable for ints) is not good enough.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

BlockHash = bytes  # 32-byte SHA-256 digest


def root_hash(adapter_id: str | None, salt: str | None) -> BlockHash:
    """The chain's seed: what, besides the tokens, the cached K/V depend on."""
    h = hashlib.sha256(b"switchboard-prefix-v1")
    for part in (adapter_id or "", salt or ""):
        data = part.encode()
        h.update(len(data).to_bytes(8, "little"))  # length-prefixed: no ambiguous joins
        h.update(data)
    return h.digest()


def block_hash(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """The hash of one full block given its parent's (fixed-width fields: unambiguous)."""
    h = hashlib.sha256(parent)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def extend_block_hashes(
    hashes: list[BlockHash], root: BlockHash, tokens: Sequence[int], block_size: int
) -> None:
    """Append to ``hashes`` the hash of every full block of ``tokens`` it lacks yet."""
    for i in range(len(hashes), len(tokens) // block_size):
        parent = hashes[i - 1] if i else root
        hashes.append(block_hash(parent, tokens[i * block_size : (i + 1) * block_size]))


@dataclass(slots=True)
class PrefixCacheStats:
    """Counters since start. Queries and hits count prompt tokens (as vLLM does)."""

    queries: int = 0  # tokens looked up when a sequence was admitted
    hits: int = 0  # of those, tokens whose K/V came from the cache
    evictions: int = 0  # cached blocks reclaimed for new content
    cached_blocks: int = 0  # blocks whose content is reusable now (in use or not)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0
