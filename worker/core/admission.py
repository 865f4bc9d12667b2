"""Seats and KV blocks: whether a sequence may start or grow, and who gives way when not.

The scheduler (``worker.core.scheduler``) decides the order in which work is placed; this
module decides whether the memory for it is there. A swapped or waiting sequence starts only
while a seat and its KV blocks are free, past ``watermark_blocks``; tokens found in the prefix
cache cost neither budget nor compute. Without room, an interactive arrival takes it from the
latest running batch sequence at once (batch work only fills idle capacity), and an arrival
that has waited ``share_wait_steps`` may take it from the tenant furthest over its share
(``worker.core.fairness.Shares``). A running sequence that cannot grow preempts the latest
batch sequence while any runs, else the latest arrival (fair: of the tenant furthest over its
share of the KV blocks). A preempted sequence's K/V are swapped out to the host pool
(``PreemptionMode.SWAP``, while the pool has room) or dropped and recomputed later
(``RECOMPUTE``, the default).
"""

from __future__ import annotations

import enum
import time
from collections import deque

from worker.core.adapter_gate import AdapterGate
from worker.core.batch import BlockMove, MoveKind, ScheduledSequence, SchedulerOutput
from worker.core.block_manager import BlockManager
from worker.core.config import PreemptionMode
from worker.core.fairness import ServiceLedger, Shares, StepCharges
from worker.core.prefix_lookup import count_lookup, prefix_hits
from worker.core.prompt_scoring import tokens_within
from worker.core.sequence import Band, Sequence, SequenceStatus


class AdmissionOutcome(enum.Enum):
    """What ``KVAdmission.admit`` did, so what the scheduler does with the rest of the queue."""

    ADMITTED = "admitted"
    PASSED = "passed"  # its adapter has no slot: others may overtake it
    CAPPED = "capped"  # its tenant holds all the seats it may: its others wait too
    NO_ROOM = "no_room"  # no seat or KV blocks: admissions stop for this step


class KVAdmission:
    """Grants seats and KV blocks to the scheduler's sequences and takes them back by
    preemption. It shares the scheduler's queues and moves sequences between them."""

    def __init__(
        self,
        *,
        block_manager: BlockManager,
        host_block_manager: BlockManager | None,
        preemption_mode: PreemptionMode | str,
        max_num_seqs: int,
        watermark_blocks: int,
        ledger: ServiceLedger,
        running: list[Sequence],
        waiting: deque[Sequence],
        swapped: list[Sequence],
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        # Admit new work only while this many blocks stay free, so running
        # sequences can keep decoding without an immediate preemption.
        self.watermark_blocks = watermark_blocks
        self.preemption_mode = PreemptionMode(preemption_mode)
        if self.preemption_mode is PreemptionMode.SWAP and host_block_manager is None:
            raise ValueError("swap preemption needs a host block pool")
        self.host_block_manager = host_block_manager
        self.ledger = ledger
        self.running = running
        self.waiting = waiting
        self.swapped = swapped
        self.num_preemptions = 0  # since start, for metrics and tests
        self.num_swap_outs = 0  # of which by swapping

    def admit(
        self,
        seq: Sequence,
        budget: int,
        out: SchedulerOutput,
        adapters: AdapterGate,
        step: StepCharges,
        *,
        scored_token_cost: float,
    ) -> AdmissionOutcome:
        """Start a swapped or waiting sequence with up to ``budget`` tokens, if it fits.
        Tokens found in the prefix cache cost neither budget nor compute."""
        cap = self.ledger.config.max_running_per_tenant
        if cap is not None and sum(s.tenant == seq.tenant for s in self.running) >= cap:
            return AdmissionOutcome.CAPPED
        if not adapters.admits(seq):
            if seq.status is SequenceStatus.WAITING:
                seq.lora_wait_steps += 1
            return AdmissionOutcome.PASSED
        swapped = seq.status is SequenceStatus.SWAPPED
        hits = [] if swapped else prefix_hits(self.block_manager, seq)
        bs = self.block_manager.block_size
        num_ready = seq.num_computed_tokens if swapped else len(hits) * bs
        within = tokens_within(seq, num_ready, budget, scored_token_cost)
        num_tokens = min(seq.num_tokens - num_ready, within)
        while len(self.running) >= self.max_num_seqs or not self.block_manager.can_allocate(
            [], num_ready + num_tokens, reserve=self.watermark_blocks, cached=hits
        ):
            needed = self.block_manager.blocks_needed([], num_ready + num_tokens)
            if not self._take_batch_room(seq, out) and not self._take_share_room(seq, needed, out):
                seq.share_wait_steps += 1
                return AdmissionOutcome.NO_ROOM
        seq.share_wait_steps = 0
        if swapped:
            assert self.host_block_manager is not None
            self.block_manager.allocate(seq.block_table, num_ready)
            out.moves.extend(
                BlockMove(MoveKind.SWAP_IN, host, device)
                for host, device in zip(seq.host_block_table, seq.block_table, strict=True)
            )
            self.host_block_manager.free(seq.host_block_table)
            self.swapped.remove(seq)
        else:
            self.block_manager.allocate(seq.block_table, num_ready, cached=hits)
            seq.num_registered_blocks = len(hits)
            seq.num_computed_tokens = num_ready
            count_lookup(self.block_manager, seq, num_ready)
            self.waiting.remove(seq)
        self._start(seq, adapters)
        out.add(step.note(self.place(seq, num_tokens, out)))
        return AdmissionOutcome.ADMITTED

    def make_room(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> bool:
        """Preempt until ``seq`` can grow; False if ``seq`` itself went. The victim is the
        latest arrival (fair: of the tenant furthest over its share of the KV blocks)."""
        start = seq.num_computed_tokens
        while not self.block_manager.can_allocate(
            seq.block_table, start + num_tokens, write_from=start
        ):
            victim = self._victim()
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def fit_speculation(self, seq: Sequence, num_tokens: int, budget: int) -> int:
        """How many of ``seq``'s draft tokens ride along: only on a decode, only within the
        token budget, and only in blocks that are free now (speculation never preempts)."""
        if not seq.spec_token_ids or num_tokens != seq.num_uncomputed_tokens:
            return 0
        num_spec = min(len(seq.spec_token_ids), budget - num_tokens)
        start = seq.num_computed_tokens
        while num_spec > 0 and not self.block_manager.can_allocate(
            seq.block_table, start + num_tokens + num_spec, write_from=start
        ):
            num_spec -= 1
        return max(num_spec, 0)

    def place(
        self, seq: Sequence, num_tokens: int, out: SchedulerOutput, num_spec: int = 0
    ) -> ScheduledSequence:
        """Give ``seq`` the blocks for this step's tokens (room was made for them); a shared
        block it writes into is copied first."""
        start = seq.num_computed_tokens
        end = start + num_tokens + num_spec
        copies = self.block_manager.allocate(seq.block_table, end, write_from=start)
        out.moves.extend(BlockMove(MoveKind.COPY, c.src, c.dst) for c in copies)
        return ScheduledSequence(seq, start, num_tokens, num_spec)

    def _take_batch_room(self, seq: Sequence, out: SchedulerOutput) -> bool:
        """An interactive arrival that finds no seat or KV blocks takes them from the latest
        running batch sequence, at once: batch work only fills idle capacity."""
        victim = self._latest_batch() if seq.band is Band.INTERACTIVE else None
        if victim is None:
            return False
        self._preempt(victim, out)
        return True

    def _latest_batch(self) -> Sequence | None:
        """The running batch sequence to give way first: the lowest band's latest arrival."""
        batch = [s for s in self.running if s.band is not Band.INTERACTIVE]
        return max(batch, key=lambda s: (s.band, s.arrival_order)) if batch else None

    def _take_share_room(self, seq: Sequence, num_blocks: int, out: SchedulerOutput) -> bool:
        """Preempt one sequence of the tenant furthest over its share, if ``seq``'s tenant
        stays within its own share once admitted and ``seq`` has waited long enough."""
        if not self.ledger.fair or seq.share_wait_steps < self.ledger.config.share_wait_steps:
            return False
        victim = self._shares().room_for(seq, num_blocks)
        if victim is None:
            return False
        self._preempt(victim, out)
        return True

    def _victim(self) -> Sequence:
        """Whom to preempt when a running sequence cannot grow: the latest batch sequence
        while any runs; else the latest arrival (fair: of the tenant furthest over its share
        of the KV blocks)."""
        batch = self._latest_batch()
        if batch is not None:
            return batch
        if not self.ledger.fair:
            return max(self.running, key=lambda s: s.arrival_order)
        return self._shares().victim()

    def _shares(self) -> Shares:
        return Shares(self.ledger, self.running, self.max_num_seqs, self.block_manager.num_blocks)

    def _start(self, seq: Sequence, adapters: AdapterGate) -> None:
        adapters.start(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        if seq.metrics.first_scheduled_time is None:
            seq.metrics.first_scheduled_time = time.monotonic()
            self.ledger.record_queue_time(seq.tenant, seq.metrics.queue_time or 0.0)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Swap ``seq`` out if the policy and the host pool allow, else drop its K/V for a
        recompute; a recomputed sequence goes back to the queue's head."""
        self.running.remove(seq)
        out.preempted.append(seq)
        out.drop(seq)  # it may already hold a place in this step
        seq.clear_spec()
        seq.num_preemptions += 1
        self.num_preemptions += 1
        host = self.host_block_manager
        computed = seq.num_computed_tokens
        if (
            self.preemption_mode is PreemptionMode.SWAP
            and host is not None
            and computed > 0
            and host.can_allocate([], computed)
        ):
            host.allocate(seq.host_block_table, computed)
            out.moves.extend(
                BlockMove(MoveKind.SWAP_OUT, device, host_block)
                # Blocks past the computed tokens (placed this step) hold nothing yet.
                for device, host_block in zip(seq.block_table, seq.host_block_table, strict=False)
            )
            self.block_manager.free(seq.block_table)
            seq.num_registered_blocks = 0
            self.num_swap_outs += 1
            seq.status = SequenceStatus.SWAPPED
            self.swapped.append(seq)
            return
        self.block_manager.free(seq.block_table)
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
