"""Iteration-level (continuous) batching: which sequences run in the next forward pass.

Orca (Yu et al., OSDI 2022) schedules per iteration rather than per batch, so a finished
sequence's place is taken at the very next step. Every sequence is "tokens to compute":
a decode needs one, a prefill needs its prompt, cut into chunks that fit the step's
token budget (chunked prefill, as in Sarathi / vLLM v1). Running decodes go first, then
unfinished prefills, then new arrivals. When KV blocks run out, the latest arrival is
preempted and recomputed later.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from worker.block_manager import BlockManager
from worker.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledSequence:
    seq: Sequence
    # Tokens ``seq.tokens[start:start + num_tokens]`` get computed this step.
    start: int
    num_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the sequence, so a new token is sampled."""
        return self.start + self.num_tokens == self.seq.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    num_tokens: int = 0  # kept equal to the sum of scheduled num_tokens

    def add(self, placed: ScheduledSequence) -> None:
        self.scheduled.append(placed)
        self.num_tokens += placed.num_tokens

    def drop(self, seq: Sequence) -> None:
        """Take back ``seq``'s place, if it has one this step."""
        for i, placed in enumerate(self.scheduled):
            if placed.seq is seq:
                self.num_tokens -= placed.num_tokens
                del self.scheduled[i]
                return

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        *,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        watermark_blocks: int = 0,
        max_loras: int = 0,
        max_lora_wait_steps: int = 64,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # Admit new work only while this many blocks stay free, so running
        # sequences can keep decoding without an immediate preemption.
        self.watermark_blocks = watermark_blocks
        # At most this many distinct adapters run at once (their device slots). A request
        # kept out for max_lora_wait_steps stops other adapters from starting, so the
        # running ones drain and it gets a slot: no adapter waits forever.
        self.max_loras = max_loras
        self.max_lora_wait_steps = max_lora_wait_steps
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0  # since start, for metrics and tests

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out (finished or aborted) and free its blocks at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq.block_table)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        # Decodes first (one token each), then running prefills that were cut short.
        ordered = sorted(self.running, key=lambda s: (s.num_uncomputed_tokens > 1, s.arrival_order))
        for seq in ordered:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_tokens = min(seq.num_uncomputed_tokens, budget)
            if not self._make_room(seq, num_tokens, out):
                continue
            out.add(self._schedule(seq, num_tokens))
            budget = self.max_num_batched_tokens - out.num_tokens
        if not out.preempted:
            budget = self._admit_waiting(budget, out)
        return out

    def _make_room(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> bool:
        """Preempt latest arrivals until ``seq`` can grow; False if ``seq`` itself went."""
        total = seq.num_computed_tokens + num_tokens
        while not self.block_manager.can_allocate(seq.block_table, total):
            victim = max(self.running, key=lambda s: s.arrival_order)
            self._preempt(victim)
            out.preempted.append(victim)
            out.drop(victim)  # it may already hold a place in this step
            if victim is seq:
                return False
        return True

    def _admit_waiting(self, budget: int, out: SchedulerOutput) -> int:
        """Start waiting sequences in arrival order while budget, seats and blocks last.

        A request whose adapter has no free slot is passed over (base-model requests and
        requests for adapters already running may overtake it); running out of KV blocks
        stops admission outright, so memory is granted strictly first come, first served.
        """
        adapters = AdapterGate(self.running, self.waiting, self.max_loras, self.max_lora_wait_steps)
        for seq in list(self.waiting):
            if budget == 0 or len(self.running) >= self.max_num_seqs:
                break
            if not adapters.admits(seq):
                seq.lora_wait_steps += 1
                continue
            num_tokens = min(seq.num_uncomputed_tokens, budget)
            total = seq.num_computed_tokens + num_tokens
            if not self.block_manager.can_allocate(
                seq.block_table, total, reserve=self.watermark_blocks
            ):
                break
            adapters.start(seq)
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = time.monotonic()
            out.add(self._schedule(seq, num_tokens))
            budget -= num_tokens
        return budget

    def _schedule(self, seq: Sequence, num_tokens: int) -> ScheduledSequence:
        start = seq.num_computed_tokens
        self.block_manager.allocate(seq.block_table, start + num_tokens)
        return ScheduledSequence(seq, start, num_tokens)

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: drop the KV, keep the tokens, go back to the queue's head."""
        self.running.remove(seq)
        self.block_manager.free(seq.block_table)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)


class AdapterGate:
    """Admission rule for adapter slots (S-LoRA-style), rebuilt once per step."""

    def __init__(
        self, running: list[Sequence], waiting: deque[Sequence], max_loras: int, max_wait: int
    ) -> None:
        self.max_loras = max_loras
        self.active = {s.adapter_id for s in running if s.adapter_id is not None}
        # The oldest request kept out too long: until its adapter gets a slot, no other
        # adapter may start a request, so the running adapters drain.
        self.starving = next(
            (
                s.adapter_id
                for s in waiting
                if s.adapter_id is not None and s.lora_wait_steps >= max_wait
            ),
            None,
        )

    def admits(self, seq: Sequence) -> bool:
        adapter = seq.adapter_id
        if adapter is None:
            return True
        if self.starving is not None and adapter != self.starving:
            return False
        return adapter in self.active or len(self.active) < self.max_loras

    def start(self, seq: Sequence) -> None:
        if seq.adapter_id is not None:
            self.active.add(seq.adapter_id)
            seq.lora_wait_steps = 0
