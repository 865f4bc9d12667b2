"""What a proposer returns, and the interface both proposers share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from worker.sampler import SamplingRow
from worker.sequence import Sequence


@dataclass(slots=True)
class Proposal:
    token_ids: list[int]  # up to k draft tokens, possibly none
    # [len(token_ids), vocab]: the distribution each draft was drawn from; None when the
    # drafts were chosen deterministically (one-hot q: n-gram lookup, greedy draft).
    probs: torch.Tensor | None = None


class Proposer(Protocol):
    def propose(
        self, seqs: list[Sequence], ks: list[int], rows: list[SamplingRow]
    ) -> list[Proposal]:
        """Up to ``ks[i]`` draft tokens to follow ``seqs[i].tokens``."""
        ...

    def release(self, seq: Sequence) -> None:
        """Forget ``seq`` (finished or aborted): free whatever is held for it."""
        ...

    def may_draft_for(self, seq: Sequence) -> bool:
        """Whether to draft for ``seq`` at all (a draft model first has to catch up on the
        history it has not followed)."""
        ...
