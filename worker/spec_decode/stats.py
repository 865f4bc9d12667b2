"""Speculation counters (for metrics and tests) and the back-off policy."""

from __future__ import annotations

from dataclasses import dataclass, field

from worker.sequence import Sequence


@dataclass(slots=True)
class SpecDecodeStats:
    """Counters since start. A *verification* is one sequence's drafts checked in one step."""

    num_verifications: int = 0
    num_proposed: int = 0  # draft tokens verified by the target
    num_accepted: int = 0  # of those, accepted
    num_emitted: int = 0  # tokens verifications produced: accepted + one each
    num_backoff_steps: int = 0  # steps that did not speculate because the batch was large
    proposed_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_proposed: int, num_accepted: int) -> None:
        self.num_verifications += 1
        self.num_proposed += num_proposed
        self.num_accepted += num_accepted
        self.num_emitted += num_accepted + 1
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
            "acceptance_rate": self.acceptance_rate,
            "acceptance_rate_per_position": self.acceptance_rate_per_position,
            "mean_accepted_length": self.mean_accepted_length,
        }


@dataclass(slots=True)
class _Track:
    acceptance: float = 0.5  # moving average of the accepted fraction
    pause: int = 0  # steps left without speculating
    next_pause: int = 0  # length of the next pause: doubles while drafts keep failing


class BackoffPolicy:
    """When speculation pays: not in large batches (verification then costs real compute),
    and not for a sequence whose drafts keep being rejected: it pauses, then retries, and
    each failed retry doubles the pause (up to ``max_pause_steps``). A new sequence starts
    from the engine-wide acceptance: while drafts mostly fail (a poor draft model for this
    traffic), newcomers start paused too, so they only probe now and then."""

    def __init__(
        self,
        *,
        max_batch_size: int,
        min_acceptance: float,
        pause_steps: int = 8,
        max_pause_steps: int = 256,
    ) -> None:
        # At or below this many decoding sequences a step is bound by reading the weights,
        # so verifying k + 1 positions costs about what one does.
        self.max_batch_size = max_batch_size
        # Below this moving-average acceptance the drafts cost more than they save.
        self.min_acceptance = min_acceptance
        self.pause_steps = pause_steps
        self.max_pause_steps = max_pause_steps
        self._tracks: dict[Sequence, _Track] = {}
        self.acceptance = 0.5  # engine-wide moving average, over every verification

    def allows_batch(self, num_decodes: int) -> bool:
        return num_decodes <= self.max_batch_size

    def allows(self, seq: Sequence) -> bool:
        track = self._tracks.get(seq)
        if track is None:
            track = self._tracks[seq] = self._new_track()
        if track.pause == 0:
            return True
        track.pause -= 1
        return False

    def update(self, seq: Sequence, num_proposed: int, num_accepted: int) -> None:
        track = self._tracks.get(seq) or self._tracks.setdefault(seq, self._new_track())
        rate = num_accepted / num_proposed
        self.acceptance = 0.8 * self.acceptance + 0.2 * rate
        track.acceptance = 0.7 * track.acceptance + 0.3 * rate
        if track.acceptance < self.min_acceptance:
            track.pause = track.next_pause
            track.next_pause = min(2 * track.next_pause, self.max_pause_steps)
            track.acceptance = self.min_acceptance  # retry from the threshold, not below
        elif track.acceptance >= 2 * self.min_acceptance:
            track.next_pause = self.pause_steps

    def release(self, seq: Sequence) -> None:
        self._tracks.pop(seq, None)

    def _new_track(self) -> _Track:
        if self.acceptance >= self.min_acceptance:
            return _Track(acceptance=max(0.5, self.acceptance), next_pause=self.pause_steps)
        # Start paused, as if the first try had failed already.
        return _Track(self.min_acceptance, pause=self.pause_steps, next_pause=2 * self.pause_steps)
