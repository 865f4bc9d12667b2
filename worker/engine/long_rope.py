"""LongRoPE's switch (Phi-3's long-context checkpoints; Ding et al., 2024).

A LongRoPE model rotates a sequence with its short factors while the sequence holds at most
``original_max_position_embeddings`` tokens, and with its long factors once it holds more, every
position at once, the ones already cached included: transformers' Phi-3 drops its cache and
computes the whole sequence again when it crosses. So here: a prompt past the threshold runs long
from the start; a sequence that crosses while decoding has its K/V dropped and is computed again,
long (``Scheduler.recompute``). Long K/V live under their own prefix-cache root, so a short
sequence never hits them, nor a long one short ones.
"""

from __future__ import annotations

import hashlib

from worker.core.scheduler import Scheduler
from worker.core.sequence import Sequence


def long_root(root: bytes) -> bytes:
    """The prefix-cache root of a long sequence whose short root is ``root``."""
    return hashlib.sha256(root + b"longrope").digest()


class LongRopeSwitch:
    def __init__(self, threshold: int) -> None:
        self.threshold = threshold  # original_max_position_embeddings

    def admit(self, seq: Sequence) -> None:
        """A new sequence: long from the start if its prompt is past the threshold."""
        if seq.num_tokens > self.threshold:
            self._make_long(seq)

    def switch(self, scheduler: Scheduler) -> None:
        """Before a step: the sequences that crossed the threshold with their last token go
        long (their K/V computed again)."""
        for seq in [s for s in scheduler.running if self._crossed(s)]:
            self._make_long(seq)
            scheduler.recompute(seq)
        for seq in scheduler.waiting:  # preempted (no K/V) just as they crossed
            if self._crossed(seq):
                self._make_long(seq)

    def _crossed(self, seq: Sequence) -> bool:
        return not seq.long_rope and seq.num_tokens > self.threshold

    @staticmethod
    def _make_long(seq: Sequence) -> None:
        seq.long_rope = True
        seq.cache_root = long_root(seq.cache_root)
        seq.block_hashes = []
