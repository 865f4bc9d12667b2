"""What a scheduling step hands the runner: the sequences in this step's batch, with the
tokens each computes, and the K/V block moves to make before the forward pass."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from worker.core.prompt_scoring import work_tokens
from worker.core.sequence import Sequence


class MoveKind(enum.Enum):
    SWAP_OUT = "swap_out"  # device block -> host block
    SWAP_IN = "swap_in"  # host block -> device block
    COPY = "copy"  # device block -> device block (copy-on-write)


@dataclass(frozen=True, slots=True)
class BlockMove:
    kind: MoveKind
    src: int
    dst: int


@dataclass(slots=True)
class ScheduledSequence:
    seq: Sequence
    # Tokens ``seq.tokens[start:start + num_tokens]`` get computed this step, followed by
    # ``seq.spec_token_ids[:num_spec]`` (draft tokens to verify; not counted as computed).
    start: int
    num_tokens: int
    num_spec: int = 0

    @property
    def num_fed(self) -> int:
        """Tokens this sequence puts through the forward pass."""
        return self.num_tokens + self.num_spec

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the sequence, so a new token is sampled."""
        return self.start + self.num_tokens == self.seq.num_tokens

    @property
    def plain_decode(self) -> bool:
        """One token after cached ones, sampling the next, no drafts: what the native decode
        step takes (``ModelRunner._execute_native_step``) and the decode-step curve prices
        (``DecodeStepBudget.decode_times``)."""
        return self.num_tokens == 1 and self.start > 0 and not self.num_spec and self.samples


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # K/V block moves to make, in this order, before the forward pass.
    moves: list[BlockMove] = field(default_factory=list)
    # The step's work, kept equal to the sum of scheduled num_fed, each position that scores
    # its prompt counted ``scored_token_cost`` times (``worker.core.prompt_scoring``).
    num_tokens: int = 0
    scored_token_cost: float = 1.0

    def add(self, placed: ScheduledSequence) -> None:
        self.scheduled.append(placed)
        self.num_tokens += self._work(placed)

    def _work(self, placed: ScheduledSequence) -> int:
        if placed.seq.params.prompt_logprobs is None:
            return placed.num_fed
        cost = self.scored_token_cost
        return work_tokens(placed.seq, placed.start, placed.num_tokens, cost) + placed.num_spec

    def drop(self, seq: Sequence) -> None:
        """Take back ``seq``'s place, if it has one this step."""
        for i, placed in enumerate(self.scheduled):
            if placed.seq is seq:
                self.num_tokens -= self._work(placed)
                del self.scheduled[i]
                return

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
