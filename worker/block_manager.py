"""Paged KV cache bookkeeping: a fixed pool of blocks, per-sequence block tables, refcounts.

PagedAttention (Kwon et al., SOSP 2023): the KV cache is cut into fixed-size blocks so a
sequence's cache need not be contiguous, and memory is wasted only in its last block.
This module is pure Python (no torch): it decides *which* physical block holds which
tokens; the model runner owns the tensors. Blocks carry reference counts so that forks
(parallel sampling) and prefix caching can share them later without reshaping this API.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0


class NoFreeBlocksError(RuntimeError):
    """Raised when an allocation was attempted without checking capacity first."""


class BlockManager:
    """Owns the pool of KV blocks and hands them to sequences' block tables.

    A block table is a plain ``list[int]`` owned by the caller (the sequence); this class
    grows it, shares it and frees it.
    """

    def __init__(self, *, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Lowest ids first, so scripted scenarios can assert exact block ids.
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, block_table: list[int], num_tokens: int) -> int:
        """New blocks required for ``block_table`` to hold ``num_tokens`` tokens in all."""
        return max(0, -(-num_tokens // self.block_size) - len(block_table))

    def can_allocate(self, block_table: list[int], num_tokens: int, *, reserve: int = 0) -> bool:
        """Whether growing to ``num_tokens`` leaves at least ``reserve`` blocks free."""
        return self.blocks_needed(block_table, num_tokens) + reserve <= len(self._free)

    def allocate(self, block_table: list[int], num_tokens: int) -> None:
        """Grow ``block_table`` in place until it holds ``num_tokens`` tokens."""
        needed = self.blocks_needed(block_table, num_tokens)
        if needed > len(self._free):
            raise NoFreeBlocksError(f"need {needed} blocks, {len(self._free)} free")
        for _ in range(needed):
            block = self.blocks[self._free.popleft()]
            block.ref_count = 1
            block_table.append(block.block_id)

    def fork(self, block_table: list[int]) -> list[int]:
        """A new table sharing every block of ``block_table`` (copy-on-write is the caller's)."""
        for block_id in block_table:
            self.blocks[block_id].ref_count += 1
        return list(block_table)

    def free(self, block_table: list[int]) -> None:
        """Drop this table's references; blocks nobody references return to the pool at once."""
        # Reversed, so the tail of a sequence is reused last (its head is likelier shared).
        for block_id in reversed(block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free.append(block_id)
            elif block.ref_count < 0:
                raise RuntimeError(f"block {block_id} freed twice")
        block_table.clear()

    def slot(self, block_table: list[int], position: int) -> int:
        """Flat KV slot (``block_id * block_size + offset``) of token ``position``."""
        return block_table[position // self.block_size] * self.block_size + (
            position % self.block_size
        )
