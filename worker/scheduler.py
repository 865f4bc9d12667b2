"""Iteration-level (continuous) batching: which sequences run in the next forward pass.

Orca (Yu et al., OSDI 2022) schedules per iteration rather than per batch, so a finished
sequence's place is taken at the very next step. Every sequence is "tokens to compute":
a decode needs one, a prefill needs its prompt, cut into chunks that fit the step's
token budget (chunked prefill, as in Sarathi / vLLM v1). Running decodes go first, then
unfinished prefills, then swapped-out sequences, then new arrivals (none while a swapped
one still waits). A new arrival whose leading blocks are in the prefix cache starts past
them. When KV blocks run out, the latest arrival is preempted: its K/V are swapped out to
the host pool (``PreemptionMode.SWAP``, while the pool has room) or dropped and
recomputed later (``RECOMPUTE``, the default).
"""

from __future__ import annotations

import enum
import time
from collections import deque
from dataclasses import dataclass, field

from worker.adapter_gate import AdapterGate
from worker.block_manager import BlockManager
from worker.prefix_cache import extend_block_hashes
from worker.sequence import Sequence, SequenceStatus


class PreemptionMode(enum.StrEnum):
    RECOMPUTE = "recompute"
    SWAP = "swap"


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


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # K/V block moves to make, in this order, before the forward pass.
    moves: list[BlockMove] = field(default_factory=list)
    num_tokens: int = 0  # kept equal to the sum of scheduled num_fed

    def add(self, placed: ScheduledSequence) -> None:
        self.scheduled.append(placed)
        self.num_tokens += placed.num_fed

    def drop(self, seq: Sequence) -> None:
        """Take back ``seq``'s place, if it has one this step."""
        for i, placed in enumerate(self.scheduled):
            if placed.seq is seq:
                self.num_tokens -= placed.num_fed
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
        preemption_mode: PreemptionMode | str = PreemptionMode.RECOMPUTE,
        host_block_manager: BlockManager | None = None,
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
        self.preemption_mode = PreemptionMode(preemption_mode)
        if self.preemption_mode is PreemptionMode.SWAP and host_block_manager is None:
            raise ValueError("swap preemption needs a host block pool")
        self.host_block_manager = host_block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self.num_preemptions = 0  # since start, for metrics and tests
        self.num_swap_outs = 0  # of which by swapping

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out (finished or aborted) and free its blocks at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.swapped:
            self.swapped.remove(seq)
            assert self.host_block_manager is not None
            self.host_block_manager.free(seq.host_block_table)
        self.block_manager.free(seq.block_table)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Start ``child`` (same prompt) where ``parent`` is, sharing all its blocks.

        Samples of one request join together, so ``max_num_seqs`` can be exceeded by up to
        n - 1 until they finish (refusing a fork would mean prefilling the prompt again)."""
        child.block_table = self.block_manager.fork(parent.block_table)
        child.num_computed_tokens = parent.num_computed_tokens
        child.block_hashes = list(parent.block_hashes)
        child.num_registered_blocks = parent.num_registered_blocks
        child.num_cached_tokens = parent.num_cached_tokens
        child.metrics.first_scheduled_time = parent.metrics.first_scheduled_time
        child.status = SequenceStatus.RUNNING
        self.running.append(child)

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
            num_spec = self._fit_speculation(seq, num_tokens, budget)
            out.add(self._schedule(seq, num_tokens, out, num_spec))
            budget = self.max_num_batched_tokens - out.num_tokens
        if not out.preempted:
            adapters = AdapterGate(
                self.running, self.waiting, self.max_loras, self.max_lora_wait_steps
            )
            budget = self._resume_swapped(budget, out, adapters)
            if not self.swapped:
                self._admit_waiting(budget, out, adapters)
        return out

    def mark_computed(self, out: SchedulerOutput) -> None:
        """After the forward pass: advance progress; full blocks become cacheable."""
        bs = self.block_manager.block_size
        for placed in out.scheduled:
            seq = placed.seq
            seq.num_computed_tokens += placed.num_tokens
            full = seq.num_computed_tokens // bs
            if self.block_manager.enable_caching and full > seq.num_registered_blocks:
                extend_block_hashes(seq.block_hashes, seq.cache_root, seq.tokens, bs)
                self.block_manager.cache_blocks(
                    seq.block_table, seq.block_hashes[:full], start=seq.num_registered_blocks
                )
                seq.num_registered_blocks = full

    # --- policy --------------------------------------------------------------------------

    def _make_room(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> bool:
        """Preempt latest arrivals until ``seq`` can grow; False if ``seq`` itself went."""
        start = seq.num_computed_tokens
        while not self.block_manager.can_allocate(
            seq.block_table, start + num_tokens, write_from=start
        ):
            victim = max(self.running, key=lambda s: s.arrival_order)
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _fit_speculation(self, seq: Sequence, num_tokens: int, budget: int) -> int:
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

    def _resume_swapped(self, budget: int, out: SchedulerOutput, adapters: AdapterGate) -> int:
        """Swap sequences back in, earliest arrival first, while budget, seats and blocks last."""
        for seq in sorted(self.swapped, key=lambda s: s.arrival_order):
            if budget == 0 or len(self.running) >= self.max_num_seqs:
                break
            if not adapters.admits(seq):
                continue
            computed = seq.num_computed_tokens
            num_tokens = min(seq.num_uncomputed_tokens, budget)
            if not self.block_manager.can_allocate(
                [], computed + num_tokens, reserve=self.watermark_blocks
            ):
                break
            assert self.host_block_manager is not None
            self.block_manager.allocate(seq.block_table, computed)
            out.moves.extend(
                BlockMove(MoveKind.SWAP_IN, host, device)
                for host, device in zip(seq.host_block_table, seq.block_table, strict=True)
            )
            self.host_block_manager.free(seq.host_block_table)
            self.swapped.remove(seq)
            self._start(seq, adapters)
            out.add(self._schedule(seq, num_tokens, out))
            budget -= num_tokens
        return budget

    def _admit_waiting(self, budget: int, out: SchedulerOutput, adapters: AdapterGate) -> int:
        """Start waiting sequences in arrival order while budget, seats and blocks last.

        A request whose adapter has no free slot is passed over (base-model requests and
        requests for adapters already running may overtake it); running out of KV blocks
        stops admission outright, so memory is granted strictly first come, first served.
        Tokens found in the prefix cache cost neither budget nor compute.
        """
        for seq in list(self.waiting):
            if budget == 0 or len(self.running) >= self.max_num_seqs:
                break
            if not adapters.admits(seq):
                seq.lora_wait_steps += 1
                continue
            hits = self._prefix_hits(seq)
            num_hit_tokens = len(hits) * self.block_manager.block_size
            num_tokens = min(seq.num_tokens - num_hit_tokens, budget)
            if not self.block_manager.can_allocate(
                [], num_hit_tokens + num_tokens, reserve=self.watermark_blocks, cached=hits
            ):
                break
            self.block_manager.allocate(seq.block_table, num_hit_tokens, cached=hits)
            seq.num_registered_blocks = len(hits)
            seq.num_computed_tokens = num_hit_tokens
            self._count_lookup(seq, num_hit_tokens)
            self.waiting.remove(seq)
            self._start(seq, adapters)
            out.add(self._schedule(seq, num_tokens, out))
            budget -= num_tokens
        return budget

    def _prefix_hits(self, seq: Sequence) -> list[int]:
        """Cached blocks holding ``seq``'s leading tokens; the last token is always computed,
        since its logits are needed."""
        if not self.block_manager.enable_caching:
            return []
        bs = self.block_manager.block_size
        extend_block_hashes(seq.block_hashes, seq.cache_root, seq.tokens, bs)
        return self.block_manager.match_prefix(seq.block_hashes[: (seq.num_tokens - 1) // bs])

    def _count_lookup(self, seq: Sequence, num_hit_tokens: int) -> None:
        if not self.block_manager.enable_caching:
            return
        stats = self.block_manager.stats
        stats.queries += seq.num_tokens
        stats.hits += num_hit_tokens
        if seq.metrics.first_scheduled_time is None:  # first admission, not a recompute
            seq.num_cached_tokens = min(num_hit_tokens, seq.num_prompt_tokens)

    def _start(self, seq: Sequence, adapters: AdapterGate) -> None:
        adapters.start(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        if seq.metrics.first_scheduled_time is None:
            seq.metrics.first_scheduled_time = time.monotonic()

    def _schedule(
        self, seq: Sequence, num_tokens: int, out: SchedulerOutput, num_spec: int = 0
    ) -> ScheduledSequence:
        start = seq.num_computed_tokens
        end = start + num_tokens + num_spec
        copies = self.block_manager.allocate(seq.block_table, end, write_from=start)
        out.moves.extend(BlockMove(MoveKind.COPY, c.src, c.dst) for c in copies)
        return ScheduledSequence(seq, start, num_tokens, num_spec)

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
