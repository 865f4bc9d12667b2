"""Iteration-level (continuous) batching: which sequences run in the next forward pass.

Orca (Yu et al., OSDI 2022) schedules per iteration rather than per batch, so a finished
sequence's place is taken at the very next step. Every sequence is "tokens to compute":
a decode needs one, a prefill needs its prompt, cut into chunks that fit the step's
token budget (chunked prefill, as in Sarathi / vLLM v1). Running decodes go first; the
rest of the budget goes to unfinished prefills, swapped-out sequences and new arrivals,
tenant by tenant in order of the service each has received (``worker.core.fairness``; or in
arrival order under FCFS). A new arrival whose leading blocks are in the prefix cache
starts past them. While a step carries a tenant's decodes, a ``DecodeStepBudget`` may cap
other tenants' prompt tokens below ``max_num_batched_tokens`` so that the step's time stays
within the decodes' latency budget (Sarathi-Serve's stall-free batching:
``worker.core.step_budget``). Whether a sequence has the seats and KV blocks to start or
grow, and which sequence is preempted when they run out, is ``worker.core.admission``'s.

Bands: interactive work comes before batch work (``Band``; the Batch API's lines). Batch
sequences fill what interactive work leaves and give it back at once: prefills and arrivals
are placed band by band (``_next_queue``), a batch arrival waits while interactive work
cannot start, an interactive arrival that finds no seat or KV blocks takes them from a running
batch sequence and a batch sequence is preempted before any interactive one
(``worker.core.admission``), and the step's share of batch work beside interactive work is
``worker.core.bands.BatchBand``'s: within a tenth of that work's own time, none beside an
interactive prompt. Within a band, tenants share as above.
"""

from __future__ import annotations

import time
from collections import deque

from worker.core.adapter_gate import AdapterGate
from worker.core.admission import AdmissionOutcome, KVAdmission
from worker.core.bands import BatchBand
from worker.core.batch import ScheduledSequence, SchedulerOutput
from worker.core.block_manager import BlockManager
from worker.core.burst import BurstRule
from worker.core.config import FairnessConfig, PreemptionMode
from worker.core.decode_turns import DecodeTurns
from worker.core.fairness import ServiceLedger, StepCharges
from worker.core.prefix_cache import extend_block_hashes
from worker.core.prompt_scoring import tokens_within
from worker.core.sequence import Band, Sequence, SequenceStatus
from worker.core.step_budget import ACTIVE_GRACE_S, MIN_PREFILL_TOKENS, DecodeStepBudget


class Scheduler:
    """Assembles each step from the running, swapped and waiting sequences it queues."""

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
        fairness: FairnessConfig | None = None,
        step_budget: DecodeStepBudget | None = None,
        scored_token_cost: float = 1.0,
        burst_prefill_tokens: int | None = None,
        batch_steps_stop: bool = False,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        # At most this many distinct adapters run at once (their device slots). A request
        # kept out for max_lora_wait_steps stops other adapters from starting, so the
        # running ones drain and it gets a slot: no adapter waits forever.
        self.max_loras = max_loras
        self.max_lora_wait_steps = max_lora_wait_steps
        self.host_block_manager = host_block_manager
        self.ledger = ServiceLedger(fairness or FairnessConfig())
        # A position that scores its prompt counts as this many prompt tokens, in the step's
        # token limits and in fairness (``worker.core.prompt_scoring``).
        self.scored_token_cost = scored_token_cost
        self.ledger.scored_token_cost = scored_token_cost
        # While a step carries decodes, its tokens stay within what this budget allows.
        self.step_budget = step_budget
        # A lone tenant's burst of prompts runs in short steps, its decodes waiting behind
        # at most a full step's prompt tokens (``worker.core.burst``); None: off.
        self.burst = (
            None
            if burst_prefill_tokens is None
            else BurstRule(burst_prefill_tokens, max_num_batched_tokens)
        )
        # The batch band's share of each step (``worker.core.bands``).
        self.batch_band = BatchBand(steps_stop=batch_steps_stop)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        # Seats and KV blocks: who starts, who grows, who is preempted (``worker.core.admission``).
        self.admission = KVAdmission(
            block_manager=block_manager,
            host_block_manager=host_block_manager,
            preemption_mode=preemption_mode,
            max_num_seqs=max_num_seqs,
            watermark_blocks=watermark_blocks,
            ledger=self.ledger,
            running=self.running,
            waiting=self.waiting,
            swapped=self.swapped,
        )
        self.decode_turns = DecodeTurns(self.ledger)
        # When each tenant's latest sequence left (``_active_tenants``).
        self.tenants_left_at: dict[str, float] = {}

    @property
    def num_preemptions(self) -> int:
        """Since start, for metrics and tests."""
        return self.admission.num_preemptions

    @property
    def num_swap_outs(self) -> int:
        """Of the preemptions, those that swapped out."""
        return self.admission.num_swap_outs

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        self.ledger.join(seq)

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
        else:
            return  # never queued here (a sample waiting for its fork)
        self.ledger.leave(seq)
        self.block_manager.free(seq.block_table)
        self.tenants_left_at[seq.tenant] = time.monotonic()
        if seq.band is Band.INTERACTIVE:
            self.batch_band.interactive_left_at = self.tenants_left_at[seq.tenant]

    def recompute(self, seq: Sequence) -> None:
        """Drop a running sequence's K/V, which no longer hold (LongRoPE's switch to its long
        factors: ``worker.engine.long_rope``); it is computed again first, as after a
        preemption."""
        self.running.remove(seq)
        seq.clear_spec()
        self.block_manager.free(seq.block_table)
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Start ``child`` (same prompt) where ``parent`` is, sharing all its blocks.

        Samples of one request join together, so ``max_num_seqs`` can be exceeded by up to
        n - 1 until they finish (refusing a fork would mean prefilling the prompt again)."""
        child.block_table = self.block_manager.fork(parent.block_table)
        child.num_computed_tokens = parent.num_computed_tokens
        child.block_hashes = list(parent.block_hashes)
        child.num_registered_blocks = parent.num_registered_blocks
        child.num_cached_tokens = parent.num_cached_tokens
        child.num_charged_tokens = parent.num_charged_tokens
        child.metrics.first_scheduled_time = parent.metrics.first_scheduled_time
        child.status = SequenceStatus.RUNNING
        self.running.append(child)
        self.ledger.join(child)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(scored_token_cost=self.scored_token_cost)
        step = StepCharges(self.ledger)
        self.batch_band.plan(
            self.step_budget, (*self.running, *self.waiting), self.max_num_batched_tokens
        )
        burst = self._burst()
        if burst is None:
            self._schedule_decodes(out, step)
            self._schedule_prefills(out, step)
        elif burst.decodes_due():
            self._schedule_decodes(out, step)
            limit = max(burst.chunk_tokens, out.num_tokens + MIN_PREFILL_TOKENS)
            self._schedule_prefills(out, step, limit)
            burst.placed(out.num_tokens, decodes=True)
        else:
            self._schedule_prefills(out, step, burst.chunk_tokens)
            stalled = not out.scheduled  # no prompt could start: the decodes need not wait
            if stalled:
                self._schedule_decodes(out, step)
            burst.placed(out.num_tokens, decodes=stalled)
        step.commit(out.scheduled)
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

    def _burst(self) -> BurstRule | None:
        """The burst rule, when this step is a burst's: one tenant active (none other left
        within ``ACTIVE_GRACE_S``), all its work interactive and none swapped out, no
        decode carrying drafts (they were proposed for this step), and prompts waiting for
        their first token that make a burst (``BurstRule.is_burst``)."""
        burst = self.burst
        if burst is None:
            return None
        work = [*self.running, *self.waiting]
        # Cheapest test first: a step of decodes alone (most steps) has no prompt waiting.
        prompts = [s.num_uncomputed_tokens for s in work if s.num_uncomputed_tokens > 1]
        if (
            not burst.is_burst(prompts)
            or self.swapped
            or any(s.band is not Band.INTERACTIVE or s.spec_token_ids for s in work)
            or len(self._active_tenants()) != 1
        ):
            burst.ended()
            return None
        return burst

    def _schedule_decodes(self, out: SchedulerOutput, step: StepCharges) -> None:
        """Running decodes first, one token each (plus drafts), in arrival order."""
        decodes = [s for s in self.running if s.num_uncomputed_tokens <= 1]
        decodes.sort(key=lambda s: s.arrival_order)
        blocks = self.block_manager
        for seq in self.decode_turns.within_budget(
            self.batch_band.hold_back(decodes), self.step_budget
        ):
            budget = self.max_num_batched_tokens - out.num_tokens
            if budget <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_tokens = seq.num_uncomputed_tokens
            start = seq.num_computed_tokens
            if (
                num_tokens == 1
                and not seq.spec_token_ids
                and blocks.holds_writable(seq.block_table, start)
            ):
                # Most steps of most decodes: the token's slot is in a block of its own, so
                # there is nothing to allocate and no one to preempt (the host's work per
                # step bounds a GPU's tok/s: bench/host_step.py).
                out.add(step.note(ScheduledSequence(seq, start, 1)))
                continue
            if not self.admission.make_room(seq, num_tokens, out):
                continue
            num_spec = self.admission.fit_speculation(seq, num_tokens, budget)
            out.add(step.note(self.admission.place(seq, num_tokens, out, num_spec)))

    def _schedule_prefills(
        self, out: SchedulerOutput, step: StepCharges, token_limit: int | None = None
    ) -> None:
        """The rest of the budget: prefills cut short, swapped sequences, new arrivals, up to
        ``max_num_batched_tokens`` or ``token_limit`` if lower (a burst's step).

        Fair: the tenant with the lowest counter (this step's tokens included) places its
        next piece of work, then the lowest again; within a tenant, its running prefills,
        then its swapped sequences, then its arrivals (none while one of its own is
        swapped). FCFS: the same order over everyone at once. A request whose adapter has
        no free slot, or whose tenant is at its seat cap, is passed over; running out of
        seats or KV blocks stops admissions outright (memory is granted strictly in order)
        unless the one kept out may take room from a tenant over its share.

        Fair: once a lone request (its tenant has nothing else running) has its whole
        prompt placed, other work adds at most ``lone_prompt_step_tokens`` to the step, so
        its first token waits for a short step instead of another tenant's full chunk.
        Other lone requests still join. A tenant whose chunks are cut so is served less,
        so its counter falls behind and it is placed first again.

        A prompt's tokens are bounded by ``_step_token_limit`` (lower while the step carries
        decodes) only while another tenant is active (``_active_tenants``): when its tenant is
        alone it may fill ``max_num_batched_tokens``. The budget keeps a flood from taking a
        neighbour's decode latency or first token; within a tenant, a long step trades its
        own streams' pace for its own first tokens and throughput, as every step does in vLLM
        (bench.vllm_serving, one tenant: capping there cost 15% of the throughput and doubled
        mean TTFT). An interactive prompt is not bounded for tenants with only batch work
        here (``_batch_only_tenants``); batch work is bounded by the batch room instead.
        """
        adapters = AdapterGate(self.running, self.waiting, self.max_loras, self.max_lora_wait_steps)
        top = self.max_num_batched_tokens
        if token_limit is not None:
            top = min(top, token_limit)
        queues = self._work_queues()
        admitting = not out.preempted
        lone_extra = self.ledger.config.lone_prompt_step_tokens if self.ledger.fair else None
        busy = {s.tenant for s in self.running}  # tenants with a sequence running
        short_limit = None  # the step's token limit once a lone request's prompt is in it
        step_limit = min(self._step_token_limit(out), top)
        others = self._active_tenants()
        batch_only = self._batch_only_tenants()
        band = self.batch_band
        yielded = False  # ``band.give_back`` done
        while queues:
            if out.num_tokens >= top:
                break
            tenant = self._next_queue(queues, step)
            queue = queues[tenant]
            seq = queue.popleft()
            if not queue:
                del queues[tenant]
            # The budget guards other tenants: a tenant's prompts may stall only its own work.
            guarded = others - batch_only if seq.band is Band.INTERACTIVE else others
            limit = step_limit if guarded - {seq.tenant} else top
            budget = limit - out.num_tokens
            if budget <= 0:
                continue
            lone = (
                seq.status is SequenceStatus.WAITING
                and seq.metrics.first_scheduled_time is None
                and seq.tenant not in busy
            )
            if short_limit is not None and not lone:
                budget = min(budget, short_limit - out.num_tokens)
                if budget <= 0:
                    continue
            if seq.band is not Band.INTERACTIVE and not yielded:
                yielded = True  # every interactive piece is placed by now (bands go in order)
                band.give_back(out)
            batch_room = None if seq.band is Band.INTERACTIVE else band.room
            if batch_room is not None:
                budget = min(budget, batch_room)
                if budget <= 0:
                    continue
            placed = out.num_tokens
            if seq.status is SequenceStatus.RUNNING:
                within = tokens_within(seq, seq.num_computed_tokens, budget, self.scored_token_cost)
                num_tokens = min(seq.num_uncomputed_tokens, within)
                if self.admission.make_room(seq, num_tokens, out):
                    out.add(step.note(self.admission.place(seq, num_tokens, out)))
            elif admitting and not self._behind_swapped(seq):
                outcome = self.admission.admit(
                    seq, budget, out, adapters, step, scored_token_cost=self.scored_token_cost
                )
                if outcome is AdmissionOutcome.ADMITTED:
                    busy.add(seq.tenant)
                    if lone and lone_extra is not None and out.scheduled[-1].samples:
                        short_limit = min(
                            short_limit or top,
                            out.num_tokens + lone_extra,
                        )
                if outcome is AdmissionOutcome.NO_ROOM:
                    admitting = False
                elif outcome is AdmissionOutcome.CAPPED and tenant in queues:
                    rest = deque(s for s in queue if s.status is SequenceStatus.RUNNING)
                    if rest:
                        queues[tenant] = rest
                    else:
                        del queues[tenant]
            if batch_room is not None:
                band.spend(out.num_tokens - placed)
            if out.preempted:
                admitting = False
        if not yielded:
            band.give_back(out)

    def _next_queue(self, queues: dict[str, deque[Sequence]], step: StepCharges) -> str:
        """Whose work is placed next: among the queues whose next piece is of the first band
        with any work, the tenant with the lowest counter (``StepCharges.lowest``), or the
        first queue under FCFS."""
        band = min(queue[0].band for queue in queues.values())
        if any(queue[0].band is not band for queue in queues.values()):
            queues = {key: queue for key, queue in queues.items() if queue[0].band is band}
        return step.lowest(queues, self.running) if self.ledger.fair else next(iter(queues))

    def _batch_only_tenants(self) -> set[str]:
        """Tenants with only batch work here: the step budget does not guard their decodes'
        pace against an interactive prompt (batch work waits for interactive work anyway)."""
        batch, interactive = set(), set()
        for queue in (self.running, self.waiting, self.swapped):
            for seq in queue:
                (interactive if seq.band is Band.INTERACTIVE else batch).add(seq.tenant)
        return batch - interactive

    def _active_tenants(self) -> set[str]:
        """Tenants with a sequence here, or whose last one left within ``ACTIVE_GRACE_S``."""
        now = time.monotonic()
        for tenant, left in list(self.tenants_left_at.items()):
            if now - left >= ACTIVE_GRACE_S:
                del self.tenants_left_at[tenant]
        active = set(self.tenants_left_at)
        for queue in (self.running, self.waiting, self.swapped):
            active.update(seq.tenant for seq in queue)
        return active

    def _step_token_limit(self, out: SchedulerOutput) -> int:
        """``max_num_batched_tokens``; while the step carries decodes, no more than the
        step budget's cap, but always room for ``MIN_PREFILL_TOKENS`` of prefill beside
        them, so that admissions and prompts keep moving however long the decodes take."""
        limit = self.max_num_batched_tokens
        if self.step_budget is None or not out.scheduled:
            return limit
        cap = self.step_budget.token_cap()
        if cap is None:
            return limit
        return min(limit, max(cap, out.num_tokens + MIN_PREFILL_TOKENS))

    def _work_queues(self) -> dict[str, deque[Sequence]]:
        """Prefill work by tenant (FCFS: one queue), each in the order it is served."""
        by_arrival = sorted(
            (s for s in self.running if s.num_uncomputed_tokens > 1), key=lambda s: s.arrival_order
        )
        queues: dict[str, deque[Sequence]] = {}
        for seq in [*by_arrival, *sorted(self.swapped, key=lambda s: s.arrival_order)]:
            queues.setdefault(self._queue_key(seq), deque()).append(seq)
        for seq in self.waiting:
            queues.setdefault(self._queue_key(seq), deque()).append(seq)
        for key, queue in queues.items():
            if any(s.band is not Band.INTERACTIVE for s in queue):
                queues[key] = deque(sorted(queue, key=lambda s: s.band))  # stable: band first
        return queues

    def _queue_key(self, seq: Sequence) -> str:
        return seq.tenant if self.ledger.fair else ""

    def _behind_swapped(self, seq: Sequence) -> bool:
        """A new arrival waits while a swapped sequence of its queue does."""
        key = self._queue_key(seq)
        return seq.status is SequenceStatus.WAITING and any(
            self._queue_key(s) == key for s in self.swapped
        )
