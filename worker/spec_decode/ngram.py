"""Prompt lookup (n-gram) proposer: no model, just the sequence's own tokens.

Saxena (2023), "Prompt Lookup Decoding": find the most recent earlier occurrence of the
sequence's last n tokens (longest n first) and propose what followed it. Outputs that copy
their input (summaries, rewrites, code edits, RAG answers) get long accepted runs for free.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from worker.core.sequence import Sequence
from worker.sampling.rows import SamplingRow
from worker.spec_decode.proposal import Proposal


class NgramProposer:
    ranks_candidates = False

    def __init__(self, *, max_n: int = 4, min_n: int = 1) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n = max_n
        self.min_n = min_n

    def propose(
        self, seqs: list[Sequence], ks: list[int], rows: list[SamplingRow]
    ) -> list[Proposal]:
        return [
            Proposal(lookup(s.tokens, k, self.max_n, self.min_n))
            for s, k in zip(seqs, ks, strict=True)
        ]

    def release(self, seq: Sequence) -> None:
        pass

    def may_draft_for(self, seq: Sequence) -> bool:
        return True  # a lookup needs no history of its own


def lookup(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """Up to k tokens that followed the latest earlier match of the longest suffix n-gram."""
    a = np.fromiter(tokens, dtype=np.int64, count=len(tokens))
    for n in range(min(max_n, len(a) - 1), min_n - 1, -1):
        suffix = a[-n:]
        # Windows starting at 0..len-n-1: every earlier n-gram, not the suffix itself.
        windows = sliding_window_view(a[:-1], n)  # [len - n, n]
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return a[start : start + k].tolist()
    return []
