"""Speculation counters, for metrics and tests."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SpecDecodeStats:
    """Counters since start. A *verification* is one sequence's drafts checked in one step."""

    num_verifications: int = 0
    num_proposed: int = 0  # draft tokens verified by the target
    num_accepted: int = 0  # of those, accepted
    num_emitted: int = 0  # tokens verifications produced: accepted + one each
    num_backoff_steps: int = 0  # steps that did not speculate because the batch was large
    num_alternatives: int = 0  # alternative drafts verified beside the chains
    num_alternatives_accepted: int = 0  # of those, the target's token (one more emitted)
    proposed_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)

    def record(
        self,
        num_proposed: int,
        num_accepted: int,
        *,
        alternatives: int = 0,
        alternative_hit: bool = False,
    ) -> None:
        """One verification: ``num_proposed`` chain drafts, of which ``num_accepted``
        leading ones accepted; ``alternatives`` verified beside them, one hit or none."""
        self.num_verifications += 1
        self.num_proposed += num_proposed
        self.num_accepted += num_accepted
        self.num_alternatives += alternatives
        self.num_alternatives_accepted += alternative_hit
        self.num_emitted += num_accepted + 1 + alternative_hit
        missing = num_proposed - len(self.proposed_per_position)
        if missing > 0:
            self.proposed_per_position.extend([0] * missing)
            self.accepted_per_position.extend([0] * missing)
        for i in range(num_proposed):
            self.proposed_per_position[i] += 1
            self.accepted_per_position[i] += i < num_accepted

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_proposed if self.num_proposed else 0.0

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        """Of drafts at position i, the fraction accepted (all before it were too)."""
        return [
            a / p if p else 0.0
            for a, p in zip(self.accepted_per_position, self.proposed_per_position, strict=True)
        ]

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verification (accepted drafts + the target's own token)."""
        return self.num_emitted / self.num_verifications if self.num_verifications else 0.0

    def as_dict(self) -> dict:
        return {
            "num_verifications": self.num_verifications,
            "num_proposed": self.num_proposed,
            "num_accepted": self.num_accepted,
            "num_emitted": self.num_emitted,
            "num_backoff_steps": self.num_backoff_steps,
            "num_alternatives": self.num_alternatives,
            "num_alternatives_accepted": self.num_alternatives_accepted,
            "acceptance_rate": self.acceptance_rate,
            "acceptance_rate_per_position": self.acceptance_rate_per_position,
            "mean_accepted_length": self.mean_accepted_length,
        }
