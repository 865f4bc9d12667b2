"""Scripted block-manager scenarios with exact block ids (no model, no torch)."""

import pytest

from worker.core.block_manager import BlockManager, NoFreeBlocksError


def make_pool(num_blocks: int = 8, block_size: int = 4) -> BlockManager:
    return BlockManager(num_blocks=num_blocks, block_size=block_size)


def test_allocation_hands_out_lowest_ids_and_grows_only_at_block_boundaries():
    pool = make_pool()
    table: list[int] = []
    pool.allocate(table, 5)  # 5 tokens -> 2 blocks
    assert table == [0, 1]
    pool.allocate(table, 8)  # still fits in 2 blocks of 4
    assert table == [0, 1]
    pool.allocate(table, 9)
    assert table == [0, 1, 2]
    assert pool.num_free_blocks == 5
    assert [pool.blocks[i].ref_count for i in range(4)] == [1, 1, 1, 0]


def test_slots_follow_the_block_table():
    pool = make_pool(block_size=4)
    other, table = [], []
    pool.allocate(other, 4)  # block 0
    pool.allocate(table, 6)  # blocks 1, 2
    assert [pool.slot(table, p) for p in range(6)] == [4, 5, 6, 7, 8, 9]


def test_free_returns_every_block_and_reuses_them():
    pool = make_pool(num_blocks=4)
    a, b = [], []
    pool.allocate(a, 8)  # [0, 1]
    pool.allocate(b, 4)  # [2]
    pool.free(a)
    assert a == [] and pool.num_free_blocks == 3
    c: list[int] = []
    pool.allocate(c, 12)
    # Block 3 was never used; then a's blocks, the tail first freed last.
    assert c == [3, 1, 0]
    pool.free(b)
    pool.free(c)
    assert pool.num_free_blocks == 4
    assert all(block.ref_count == 0 for block in pool.blocks)


def test_capacity_checks_and_refusal():
    pool = make_pool(num_blocks=2, block_size=4)
    table: list[int] = []
    assert pool.can_allocate(table, 8)
    assert not pool.can_allocate(table, 9)
    assert not pool.can_allocate(table, 8, reserve=1)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(table, 9)
    assert table == [] and pool.num_free_blocks == 2  # a refused allocation takes nothing


def test_fork_shares_blocks_until_both_are_freed():
    pool = make_pool(num_blocks=4)
    parent: list[int] = []
    pool.allocate(parent, 6)
    child = pool.fork(parent)
    assert child == parent == [0, 1]
    assert [pool.blocks[i].ref_count for i in (0, 1)] == [2, 2]
    pool.free(parent)
    assert pool.num_free_blocks == 2  # still held by the child
    pool.free(child)
    assert pool.num_free_blocks == 4


def test_double_free_is_detected():
    pool = make_pool()
    table: list[int] = []
    pool.allocate(table, 1)
    stale = list(table)
    pool.free(table)
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free(stale)


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_blocks_needed(block_size):
    pool = make_pool(num_blocks=64, block_size=block_size)
    assert pool.blocks_needed([], 1) == 1
    assert pool.blocks_needed([], block_size) == 1
    assert pool.blocks_needed([], block_size + 1) == 2
    assert pool.blocks_needed([7], block_size) == 0


def test_trim_frees_the_tail_blocks_of_rejected_speculative_tokens():
    pool = make_pool(num_blocks=8, block_size=4)
    table: list[int] = []
    pool.allocate(table, 6)  # [0, 1]: 6 computed tokens
    pool.cache_blocks(table, [b"h0"])  # the one full block is cached
    pool.allocate(table, 6 + 1 + 4, write_from=6)  # last token + 4 drafts: [0, 1, 2]
    assert table == [0, 1, 2]
    pool.trim(table, 6 + 1)  # one draft accepted: 7 tokens hold K/V
    assert table == [0, 1] and pool.num_free_blocks == 6
    assert pool.blocks[2].ref_count == 0 and pool.blocks[2].block_hash is None
    pool.trim(table, 8)  # nothing past the table: no-op
    assert table == [0, 1]
    assert pool.match_prefix([b"h0"]) == [0]  # the cached head is untouched


def test_trim_of_a_shared_table_only_drops_this_tables_references():
    pool = make_pool(num_blocks=8, block_size=4)
    parent: list[int] = []
    pool.allocate(parent, 8)  # [0, 1]
    child = pool.fork(parent)
    pool.trim(child, 4)
    assert child == [0] and parent == [0, 1]
    assert [pool.blocks[i].ref_count for i in (0, 1)] == [2, 1]


def test_holds_writable_agrees_with_the_general_count():
    """The scheduler's decode shortcut: a position the table already holds privately needs
    no block and no copy, exactly where ``blocks_needed`` says 0 for writing it."""
    pool = make_pool(num_blocks=16, block_size=4)
    table: list[int] = []
    pool.allocate(table, 6)  # blocks for positions 0-7
    shared = pool.fork(table)  # both tables now share every block
    own: list[int] = []
    pool.allocate(own, 5)
    for t in (table, shared, own):
        for position in range(12):
            needed = pool.blocks_needed(t, position + 1, write_from=position)
            assert pool.holds_writable(t, position) == (needed == 0)
    assert not pool.holds_writable(table, 5) and pool.holds_writable(own, 7)
    assert not pool.holds_writable(own, 8)  # past the table: a new block


def test_a_fork_of_a_mirrored_table_is_mirrored_and_its_own():
    """Sequences' tables keep an array of themselves (MirroredInts); a fork (the samples of
    an n > 1 request) must too, with an array that follows its own changes only."""
    from switchboard_kernels.mirrored_ints import MirroredInts

    pool = make_pool(num_blocks=8, block_size=4)
    parent = MirroredInts()
    pool.allocate(parent, 6)
    child = pool.fork(parent)
    assert type(child) is MirroredInts and child == parent == [0, 1]
    pool.allocate(child, 10)
    assert child.array.tolist() == child == [0, 1, 2] and parent.array.tolist() == [0, 1]
