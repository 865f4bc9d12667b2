"""What a proposer returns, and the interface both proposers share."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from worker.core.sequence import Sequence
from worker.sampling.rows import SamplingRow


@dataclass(slots=True)
class Proposal:
    token_ids: list[int]  # up to k draft tokens, possibly none
    # [len(token_ids), vocab]: the distribution each draft was drawn from; None when the
    # drafts were chosen deterministically (one-hot q: n-gram lookup, greedy draft).
    probs: torch.Tensor | None = None
    # Per draft: other tokens the proposer rates likely there, best first. The target
    # verifies them beside the chain: where the chain breaks at draft i and the target's
    # token is one of i's alternatives, the step keeps it and the target's token after it.
    alternatives: list[list[int]] = field(default_factory=list)
    # A draft model's own probability of each draft and of each alternative (its
    # confidence, which ``draft_plan`` turns into the rows worth verifying); empty else.
    confidence: list[float] = field(default_factory=list)
    alternative_probs: list[list[float]] = field(default_factory=list)


class Proposer(Protocol):
    # Whether proposals carry the proposer's confidence (a draft model's probabilities),
    # so that the step's plan sizes them (draft_plan); else the policy sizes chains.
    ranks_candidates: bool

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
