"""How much batch work a step may carry beside interactive work.

Batch work (the Batch API's lines) fills what interactive work leaves. On an accelerator a
decode step of a few rows leaves most of the machine idle, so batch rows beside it cost the
interactive rows little; on a CPU each row costs time. Either way the rule is the same, read
from what steps cost on this machine (``worker.core.step_budget.StepTimes``): while a step
carries interactive work, batch work may add only the tokens that keep the step within
``BATCH_SLOWDOWN`` of the interactive work's own time; where that work is decodes alone, batch
decode rows only, priced on the times of steps of decodes alone (``batch_rows_beside_decodes``).
The rest of the batch work waits (its decodes take turns), holding its KV blocks: under steady
interactive traffic batch prompts start only between its requests. With no interactive work
every batch decode runs and the lines' prompt chunks fill the step up to ``BATCH_STEP_S`` (at
least ``MIN_PREFILL_TOKENS``); an interactive arrival stops such a step within its layer
(``worker.model.step_interrupt``), and the bound is what a step dropped that way may waste.
``BatchBand`` holds a scheduler's share of the step in the making by these rules.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from worker.core.batch import SchedulerOutput
from worker.core.sequence import Band, Sequence, SequenceStatus
from worker.core.step_budget import (
    ACTIVE_GRACE_S,
    MIN_PREFILL_TOKENS,
    DecodeStepBudget,
    StepTimes,
)

# The most a step carrying interactive work may be slowed by the batch work beside it.
BATCH_SLOWDOWN = 0.10
# The longest a step of batch work alone may take (what an interactive arrival may make it
# drop: it stops within the layer it is in and is run again).
BATCH_STEP_S = 0.25


def batch_token_room(
    times: StepTimes, interactive_tokens: int, *, slowdown: float = BATCH_SLOWDOWN
) -> int | None:
    """Tokens of batch work a step of ``interactive_tokens`` may add (none: within
    ``BATCH_STEP_S``); None when nothing is known of step times (no bound)."""
    if interactive_tokens < 1:
        within = times.max_tokens_within(BATCH_STEP_S)
        return None if within is None else max(1, within)
    alone = times.seconds(interactive_tokens)
    if alone is None:
        return None
    within = times.max_tokens_within(alone * (1 + slowdown))
    if within is None:
        return None
    return max(0, within - interactive_tokens)


def batch_rows_beside_decodes(
    budget: DecodeStepBudget, rows: int, *, slowdown: float = BATCH_SLOWDOWN
) -> int | None:
    """Batch decode rows a step of ``rows`` interactive decodes alone may add and stay within
    ``slowdown`` of those rows' own time on ``budget.decode_times``; None while that curve
    knows nothing (``batch_token_room`` then rules). No batch prompt chunk joins such a step:
    it would make it a step of another kind (on a CPU the native decode step takes decodes
    alone: two rows of the default model 6 ms on a Zen 4, 11-14 ms with one prompt token
    beside them; on a GPU, a CUDA graph)."""
    decodes = budget.decode_times
    alone = decodes.seconds(rows)
    if alone is None:
        return None
    return max(0, (decodes.max_tokens_within(alone * (1 + slowdown)) or 0) - rows)


class BatchBand:
    """The batch band's share of the step in the making (one per scheduler): set from the
    interactive work around it at each step's start (``plan``), taken as batch work is placed
    (``hold_back``, ``spend``), given back whole when an interactive prompt joins the step
    (``give_back``). ``steps_stop``: the engine stops a step of batch work alone when
    interactive work arrives (``worker.model.step_interrupt``; off under tensor parallelism,
    where every rank must run every layer), so no grace second after interactive work."""

    def __init__(self, *, steps_stop: bool = False) -> None:
        self.steps_stop = steps_stop
        # Batch tokens the step may still add beside its interactive work; None: no bound
        # (no interactive work, or step times unknown).
        self.room: int | None = None
        self.alone = False  # no interactive work: the room bounds batch prompts only
        # Beside interactive decodes alone: batch decodes only, no prompt chunks.
        self.decodes_only = False
        # Batch decodes given their turn in this step, with their turn before (given back
        # with the step's places: ``give_back``).
        self._turns_given: list[tuple[Sequence, int]] = []
        self._decode_turns = 0  # decode turns handed out so far
        self.interactive_left_at = -ACTIVE_GRACE_S  # when the latest interactive one left

    def plan(
        self, budget: DecodeStepBudget | None, work: Iterable[Sequence], max_tokens: int
    ) -> None:
        """This step's batch room beside the interactive sequences among ``work`` (running and
        waiting): within a tenth of their own step time (``batch_token_room``), counting
        their decodes and their prompts' next chunks (an arrival's first step is held to it
        too); beside interactive decodes alone, batch decode rows only, priced on steps of
        decodes alone (``batch_rows_beside_decodes``). Without ``steps_stop``, within
        ``ACTIVE_GRACE_S`` of the latest interactive sequence's end as if one decoded: a
        closed-loop client's next request comes just after its answer, and would otherwise wait
        for a whole step of batch work. Without interactive work, a step of batch work within
        ``BATCH_STEP_S``. No bound without step times."""
        self._turns_given.clear()
        self.decodes_only = False
        self.room = None
        if budget is None:
            return
        interactive = rows = 0
        prompts = False
        for seq in work:
            if seq.band is Band.INTERACTIVE and seq.num_uncomputed_tokens:
                tokens = min(seq.num_uncomputed_tokens, max_tokens)
                interactive += tokens
                decode = seq.status is SequenceStatus.RUNNING and tokens == 1
                if decode and not seq.spec_token_ids:
                    rows += 1
                else:
                    prompts = True
        interactive = min(interactive, max_tokens)
        if (
            not interactive
            and not self.steps_stop
            and time.monotonic() - self.interactive_left_at < ACTIVE_GRACE_S
        ):
            interactive = rows = 1
        self.alone = interactive == 0
        if rows and not prompts:
            batch_rows = batch_rows_beside_decodes(budget, rows)
            if batch_rows is not None:
                self.decodes_only = True
                self.room = batch_rows
                return
        self.room = batch_token_room(budget.times, interactive)

    def hold_back(self, decodes: list[Sequence]) -> list[Sequence]:
        """Of ``decodes``, those that run this step: beside interactive work, batch decodes
        take at most the step's room, in turns (least recently placed first); the others
        wait a step, holding their blocks. Alone, every decode; the prompts' chunks take what
        the step has left."""
        room = self.room
        if room is None:
            return decodes
        batch = [s for s in decodes if s.band is not Band.INTERACTIVE]
        if self.alone:
            self.room = max(room - len(batch), MIN_PREFILL_TOKENS)
            return decodes
        if len(batch) <= room:
            self.room = 0 if self.decodes_only else room - len(batch)
            return decodes
        kept = set(map(id, sorted(batch, key=lambda s: s.last_decode_turn)[:room]))
        for seq in batch:
            if id(seq) in kept:
                self._turns_given.append((seq, seq.last_decode_turn))
                self._decode_turns += 1
                seq.last_decode_turn = self._decode_turns
        self.room = 0
        return [s for s in decodes if s.band is Band.INTERACTIVE or id(s) in kept]

    def spend(self, tokens: int) -> None:
        """A batch prompt's ``tokens`` placed in the step (the room is bounded)."""
        if self.room is not None:
            self.room -= tokens

    def give_back(self, out: SchedulerOutput) -> None:
        """A step that carries an interactive prompt carries no batch work: the batch rows
        placed before it (decodes, which go first) give their places back, and their turns,
        and the rest of the step's batch room is gone. So an arrival's first token waits
        for its own prompt only (the step times price one prompt of so many tokens, not decode
        rows beside it). Only once the prompt is placed: an arrival that cannot start (its
        adapter has no slot, its tenant is at its cap) stops no batch work."""
        if self.room is None or not any(
            p.seq.band is Band.INTERACTIVE and p.seq.num_uncomputed_tokens > 1
            for p in out.scheduled
        ):
            return
        self.room = 0
        for placed in [p for p in out.scheduled if p.seq.band is not Band.INTERACTIVE]:
            out.drop(placed.seq)
        for seq, turn in self._turns_given:
            seq.last_decode_turn = turn
        self._turns_given.clear()
