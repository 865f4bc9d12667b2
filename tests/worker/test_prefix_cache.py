"""Prefix caching and copy-on-write in the block manager: scripted scenarios, no model."""

import os
import subprocess
import sys

import pytest

from worker.core.block_manager import BlockCopy, BlockManager
from worker.core.prefix_cache import block_hash, extend_block_hashes, root_hash

BS = 4


def make_pool(num_blocks: int = 8, *, caching: bool = True) -> BlockManager:
    return BlockManager(num_blocks=num_blocks, block_size=BS, enable_caching=caching)


def hashes(tokens: list[int], *, adapter: str | None = None, salt: str | None = None):
    out: list[bytes] = []
    extend_block_hashes(out, root_hash(adapter, salt), tokens, BS)
    return out


def run(pool: BlockManager, tokens: list[int], **key) -> list[int]:
    """Admit a sequence the way the scheduler does: take the cached prefix (never the last
    token, whose logits are needed), allocate the rest, then cache its full blocks."""
    chain = hashes(tokens, **key)
    hits = pool.match_prefix(chain[: (len(tokens) - 1) // BS])
    table: list[int] = []
    pool.allocate(table, len(hits) * BS, cached=hits)
    pool.allocate(table, len(tokens))
    pool.cache_blocks(table, chain, start=len(hits))
    return table


PROMPT = list(range(10, 20))  # 10 tokens: two full blocks and a partial one


def test_the_hash_chain_names_a_block_by_everything_before_it():
    a = hashes(list(range(12)))
    assert len(a) == 3 and len(set(a)) == 3
    assert hashes([*range(12), 99]) == a  # a partial block gets no hash
    changed_first = hashes([7, *range(1, 12)])
    assert all(x != y for x, y in zip(a, changed_first, strict=True))  # the change propagates
    changed_last = hashes([*range(11), 7])
    assert changed_last[:2] == a[:2] and changed_last[2] != a[2]
    assert len(a[0]) == 32  # SHA-256, not Python's 64-bit hash
    # Fixed-width token encoding: (1, 256) and (256, 1) differ, and so do 1 and 2**32 + 1.
    assert block_hash(b"", [1, 256]) != block_hash(b"", [256, 1])
    assert block_hash(b"", [1]) != block_hash(b"", [2**32 + 1])


@pytest.mark.parametrize(
    "other",
    [
        {"adapter": "sha256:aaaa"},  # another adapter (or the same name with new weights)
        {"salt": "tenant-b"},  # another tenant
        {"adapter": "", "salt": "a"},  # the adapter/salt boundary is unambiguous
    ],
)
def test_the_root_separates_adapters_and_tenants(other):
    assert hashes(PROMPT, salt="tenant-a")[0] != hashes(PROMPT, **other)[0]


def test_the_chain_is_the_same_in_another_process():
    """Blocks are named alike by every process (gateway replicas route on them): nothing in
    the chain may depend on Python's per-process hash seed."""
    script = (
        "from worker.core.prefix_cache import extend_block_hashes, root_hash\n"
        "out = []\n"
        f"extend_block_hashes(out, root_hash('sha256:ab', 'tenant-a'), {PROMPT!r}, {BS})\n"
        "print(','.join(h.hex() for h in out))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    other = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()
    mine = ",".join(h.hex() for h in hashes(PROMPT, adapter="sha256:ab", salt="tenant-a"))
    assert other == mine


def test_a_second_request_reuses_the_full_blocks_of_the_first():
    pool = make_pool()
    first = run(pool, PROMPT)
    assert first == [0, 1, 2]
    assert pool.stats.cached_blocks == 2  # the partial block 2 is not cached
    second = run(pool, [*PROMPT, 50, 51])
    assert second == [0, 1, 3]  # shared prefix, a private last block
    assert [pool.blocks[i].ref_count for i in range(4)] == [2, 2, 1, 1]


def test_freed_blocks_stay_cached_and_a_hit_revives_them():
    pool = make_pool()
    table = run(pool, PROMPT)
    pool.free(table)
    assert pool.num_free_blocks == 8 and pool.stats.cached_blocks == 2
    again = run(pool, PROMPT)
    # Blocks 0 and 1 come back from the cache; the clean block 3 is used before the freed,
    # uncached block 2 (clean blocks are handed out lowest id first, freed ones last).
    assert again == [0, 1, 3]
    assert pool.num_free_blocks == 5


def test_only_the_same_adapter_and_tenant_hit():
    pool = make_pool(num_blocks=16)
    run(pool, PROMPT, adapter="sha256:a", salt="t1")
    assert run(pool, PROMPT, adapter="sha256:b", salt="t1")[:2] == [3, 4]
    assert run(pool, PROMPT, adapter="sha256:a", salt="t2")[:2] == [6, 7]
    assert run(pool, PROMPT, salt="t1")[:2] == [9, 10]  # base model
    assert run(pool, PROMPT, adapter="sha256:a", salt="t1")[:2] == [0, 1]


def test_the_last_token_is_never_taken_from_the_cache():
    pool = make_pool()
    run(pool, list(range(8)))  # exactly two full blocks, both cached
    table = run(pool, list(range(8)))
    # Only block 0 is reused: block 1 holds the last token, which must be computed.
    assert table == [0, 2]


def test_eviction_takes_clean_blocks_first_then_the_least_recently_freed():
    pool = make_pool(num_blocks=6)
    a = run(pool, list(range(100, 108)))  # blocks 0, 1 (both cached)
    b = run(pool, list(range(200, 208)))  # blocks 2, 3
    pool.free(b)  # freed first: b's tail (3) then head (2)
    pool.free(a)  # then 1, 0
    assert pool.stats.cached_blocks == 4
    table: list[int] = []
    pool.allocate(table, 4 * BS)
    # Clean 4 and 5 first, then evictions in LRU order: b's tail before its head.
    assert table == [4, 5, 3, 2]
    assert pool.stats.evictions == 2 and pool.stats.cached_blocks == 2
    pool.free(table)
    assert run(pool, [*range(100, 108), 1])[:2] == [0, 1]  # a survived
    assert pool.match_prefix(hashes(list(range(200, 208)))) == []  # b is gone


def test_a_hit_refreshes_recency():
    pool = make_pool(num_blocks=4)
    a = run(pool, [*range(100, 104), 0])  # [0 cached, 1]
    b = run(pool, [*range(200, 204), 0])  # [2 cached, 3]
    pool.free(a)
    pool.free(b)
    # a is older, but using it again makes b's block the least recently used.
    pool.free(run(pool, [*range(100, 104), 1]))
    table: list[int] = []
    pool.allocate(table, 4 * BS)
    assert table == [3, 1, 2, 0]


def test_identical_prompts_computed_at_once_keep_one_cached_copy():
    pool = make_pool()
    chain = hashes(PROMPT)
    a: list[int] = []
    b: list[int] = []
    pool.allocate(a, len(PROMPT))
    pool.allocate(b, len(PROMPT))
    pool.cache_blocks(a, chain)
    pool.cache_blocks(b, chain)  # b's copies stay private
    assert pool.stats.cached_blocks == 2
    pool.free(b)
    pool.free(a)
    assert pool.match_prefix(chain) == [0, 1]


def test_caching_can_be_turned_off():
    pool = make_pool(caching=False)
    run(pool, PROMPT)
    assert pool.stats.cached_blocks == 0
    assert run(pool, PROMPT) == [3, 4, 5]


def test_copy_on_write_copies_a_shared_block_only_once_written():
    pool = make_pool()
    parent: list[int] = []
    pool.allocate(parent, 6)  # [0, 1]; block 1 holds 2 of 4 tokens
    child = pool.fork(parent)
    assert pool.blocks_needed(child, 7, write_from=6) == 1
    assert pool.allocate(child, 7, write_from=6) == [BlockCopy(1, 2)]
    assert child == [0, 2] and parent == [0, 1]
    # The parent is now the only holder of block 1: it writes in place.
    assert pool.allocate(parent, 7, write_from=6) == []
    assert [pool.blocks[i].ref_count for i in range(3)] == [2, 1, 1]
    # A fork at a block boundary shares only full blocks: nothing to copy.
    other = pool.fork(child)
    assert pool.allocate(other, 9, write_from=8) == []
    assert other == [0, 2, 3]
    for table in (parent, child, other):
        pool.free(table)
    assert pool.num_free_blocks == 8


def test_a_refused_allocation_takes_nothing():
    pool = make_pool(num_blocks=3)
    run(pool, [*range(8), 0])  # [0, 1 cached, 2], all held
    chain = hashes(list(range(8)))
    hits = pool.match_prefix(chain)
    assert hits == [0, 1]
    assert pool.blocks_needed([], 12, cached=hits) == 1
    assert not pool.can_allocate([], 12, cached=hits)
    assert [pool.blocks[i].ref_count for i in range(3)] == [1, 1, 1]


def test_reset_forgets_every_prefix_and_keeps_blocks_in_use():
    pool = make_pool()
    held = run(pool, PROMPT)  # [0, 1, 2], 0 and 1 cached
    pool.free(run(pool, [*list(range(50, 58)), 1]))  # [3, 4 cached, 5]
    pool.reset_cache()
    assert pool.stats.cached_blocks == 0 and pool.num_free_blocks == 5
    assert pool.match_prefix(hashes(PROMPT)) == []
    pool.free(held)
    assert pool.num_free_blocks == 8
    table: list[int] = []
    pool.allocate(table, 8 * BS)
    assert sorted(table) == list(range(8)) and pool.stats.evictions == 0
