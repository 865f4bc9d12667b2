"""Paged KV cache bookkeeping: a fixed pool of blocks, per-sequence block tables, refcounts.

PagedAttention (Kwon et al., SOSP 2023): the KV cache is cut into fixed-size blocks so a
sequence's cache need not be contiguous, and memory is wasted only in its last block.
This module is pure Python (no torch): it decides *which* physical block holds which
tokens; the model runner owns the tensors and performs the copies this module asks for.

Sharing: blocks carry reference counts. ``fork`` shares a whole table (parallel sampling);
the first write into a shared block copies it (copy-on-write). With prefix caching, a full
block registered under its content hash (``worker.core.prefix_cache``) stays reusable after its
last owner frees it: free blocks are either *clean* (no content worth keeping) or
*evictable* (cached, least recently freed first). Allocation takes clean blocks first and
evicts cached ones only when none is left; a prefix hit revives an evictable block.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

from worker.core.prefix_cache import BlockHash, PrefixCacheStats


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    # Content hash while the block is in the prefix cache (full and computed); else None.
    block_hash: BlockHash | None = None


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """Copy one block's K/V before this step's forward pass (copy-on-write)."""

    src: int
    dst: int


class NoFreeBlocksError(RuntimeError):
    """Raised when an allocation was attempted without checking capacity first."""


class BlockManager:
    """Owns the pool of KV blocks and hands them to sequences' block tables.

    A block table is a plain ``list[int]`` owned by the caller (the sequence); this class
    grows it, shares it, caches its full blocks and frees it.
    """

    def __init__(self, *, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Lowest ids first, so scripted scenarios can assert exact block ids.
        self._clean: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # least recently freed first
        self._cached: dict[BlockHash, int] = {}
        self.stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody holds (clean or evictable): what can be allocated now."""
        return len(self._clean) + len(self._evictable)

    # --- capacity ------------------------------------------------------------------------

    def blocks_needed(
        self,
        block_table: list[int],
        num_tokens: int,
        *,
        cached: Sequence[int] = (),
        write_from: int | None = None,
    ) -> int:
        """Free blocks consumed to hold ``num_tokens`` tokens in all.

        ``cached``: prefix-hit blocks appended first (a hit nobody holds consumes a free
        block too). ``write_from``: the first position written next; a shared block there
        needs a private copy.
        """
        total = -(-num_tokens // self.block_size)
        new = max(0, total - len(block_table) - len(cached))
        revived = sum(1 for b in cached if self.blocks[b].ref_count == 0)
        return new + revived + self._needs_copy(block_table, write_from)

    def can_allocate(
        self,
        block_table: list[int],
        num_tokens: int,
        *,
        reserve: int = 0,
        cached: Sequence[int] = (),
        write_from: int | None = None,
    ) -> bool:
        """Whether growing to ``num_tokens`` leaves at least ``reserve`` blocks free."""
        needed = self.blocks_needed(block_table, num_tokens, cached=cached, write_from=write_from)
        return needed + reserve <= self.num_free_blocks

    def holds_writable(self, block_table: list[int], position: int) -> bool:
        """Whether the table already has a private block for ``position``: writing it
        then needs no new block and no copy (``blocks_needed`` would say 0)."""
        index = position // self.block_size
        return index < len(block_table) and self.blocks[block_table[index]].ref_count == 1

    # --- tables --------------------------------------------------------------------------

    def match_prefix(self, block_hashes: Sequence[BlockHash]) -> list[int]:
        """The cached blocks holding the longest run of ``block_hashes`` (no side effects)."""
        if not self.enable_caching:
            return []
        hits = []
        for h in block_hashes:
            block_id = self._cached.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def allocate(
        self,
        block_table: list[int],
        num_tokens: int,
        *,
        cached: Sequence[int] = (),
        write_from: int | None = None,
    ) -> list[BlockCopy]:
        """Grow ``block_table`` in place until it holds ``num_tokens`` tokens.

        Takes over the ``cached`` blocks first (from ``match_prefix``), then fresh ones, and
        gives the block at ``write_from`` a private copy if it is shared. Returns the copies
        the caller must make before writing; refuses (taking nothing) if blocks run short.
        """
        needed = self.blocks_needed(block_table, num_tokens, cached=cached, write_from=write_from)
        if needed > self.num_free_blocks:
            raise NoFreeBlocksError(f"need {needed} blocks, {self.num_free_blocks} free")
        for block_id in cached:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._evictable[block_id]
            block.ref_count += 1
            block_table.append(block_id)
        copies = []
        if self._needs_copy(block_table, write_from):
            assert write_from is not None
            index = write_from // self.block_size
            shared = self.blocks[block_table[index]]
            shared.ref_count -= 1  # still >= 1: another table holds it
            block_table[index] = self._take()
            copies.append(BlockCopy(shared.block_id, block_table[index]))
        for _ in range(-(-num_tokens // self.block_size) - len(block_table)):
            block_table.append(self._take())
        return copies

    def fork(self, block_table: list[int]) -> list[int]:
        """A new table sharing every block of ``block_table`` (copied on first write), of
        its type."""
        for block_id in block_table:
            self.blocks[block_id].ref_count += 1
        return block_table.copy()

    def cache_blocks(
        self, block_table: list[int], block_hashes: Sequence[BlockHash], *, start: int = 0
    ) -> None:
        """Register the table's full, computed blocks ``start..len(block_hashes)-1``.

        A hash another block already holds is left alone (two identical prompts prefilled
        at once): that copy stays private and is simply not reused.
        """
        if not self.enable_caching:
            return
        for index in range(start, len(block_hashes)):
            block = self.blocks[block_table[index]]
            h = block_hashes[index]
            if block.block_hash is not None or h in self._cached:
                continue
            block.block_hash = h
            self._cached[h] = block.block_id
            self.stats.cached_blocks += 1

    def free(self, block_table: list[int]) -> None:
        """Drop this table's references; unreferenced blocks are reusable at once.

        Reversed, so a sequence's tail is evicted before its head: the head is likelier to
        be shared, and a chain is useless past its first missing block.
        """
        for block_id in reversed(block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is not None:
                    self._evictable[block_id] = None
                else:
                    self._clean.append(block_id)
            elif block.ref_count < 0:
                raise RuntimeError(f"block {block_id} freed twice")
        block_table.clear()

    def trim(self, block_table: list[int], num_tokens: int) -> None:
        """Drop the table's blocks past the first ``num_tokens`` tokens (rejected speculative
        tokens' slots). Those blocks were never registered in the cache: only blocks of
        computed tokens are."""
        keep = -(-num_tokens // self.block_size)
        if keep < len(block_table):
            tail = block_table[keep:]
            del block_table[keep:]
            self.free(tail)

    def reset_cache(self) -> None:
        """Forget every cached prefix (benchmarks, or after weights change in place)."""
        for block in self.blocks:
            if block.block_hash is not None:
                block.block_hash = None
                if block.ref_count == 0:
                    self._clean.append(block.block_id)
        self._evictable.clear()
        self._cached.clear()
        self.stats.cached_blocks = 0

    def slot(self, block_table: list[int], position: int) -> int:
        """Flat KV slot (``block_id * block_size + offset``) of token ``position``."""
        return block_table[position // self.block_size] * self.block_size + (
            position % self.block_size
        )

    # --- internals -----------------------------------------------------------------------

    def _needs_copy(self, block_table: list[int], write_from: int | None) -> bool:
        if write_from is None:
            return False
        index = write_from // self.block_size
        return index < len(block_table) and self.blocks[block_table[index]].ref_count > 1

    def _take(self) -> int:
        """A free block, held once: a clean one, else the least recently freed cached one."""
        if self._clean:
            block_id = self._clean.popleft()
        elif self._evictable:
            block_id, _ = self._evictable.popitem(last=False)
            block = self.blocks[block_id]
            del self._cached[block.block_hash]
            block.block_hash = None
            self.stats.evictions += 1
            self.stats.cached_blocks -= 1
        else:
            raise NoFreeBlocksError("no free blocks")
        self.blocks[block_id].ref_count = 1
        return block_id
