"""The back-off policy: how many drafts each sequence gets in a step, and when speculation
pays at all (for a draft model, with the step's plan: ``draft_plan``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

from worker.core.sequence import Sequence
from worker.spec_decode.draft_plan import Calibration, Selection, StepPlan
from worker.spec_decode.step_cost import LiveStepCosts

# A fixed cost per verified position and decoding sequence, for tests and for users who
# set one: about what a row costs on a memory-bound CPU with native bf16. By default the
# engine measures it (step_cost.py).
POSITION_COST = 0.02


# verify_cost(decoding sequences, drafts each): what verifying that many drafts per sequence
# adds to a step, per sequence, in units of a plain step's time per token.
VerifyCost = Callable[[int, int], float]


def flat_verify_cost(position_cost: float) -> VerifyCost:
    """A fixed cost per verified position and decoding sequence."""
    return lambda num_decodes, num_drafts: position_cost * num_decodes * num_drafts


def best_draft_count(
    acceptance: float, k: int, costs: list[float], alternative_rate: float = 0.0
) -> int:
    """The number of drafts n (0..k) that yields the most tokens per unit of time, where
    ``costs[n]`` is what n drafts add to the step. The j-th draft is reached with
    probability ~acceptance^(j - 1); there the step emits a token (the draft, or the
    target's own in its place), and one more where an alternative of that draft catches the
    target's token (``alternative_rate``); past the n-th, the target adds its own. So n
    drafts yield sum over j <= n of acceptance^(j - 1) (1 + alternative_rate), plus
    acceptance^n, tokens (1 + a + ... + a^n without alternatives), at 1 + costs[n]."""
    best_n, best_rate = 0, 1.0
    for n, tokens in enumerate(_tokens_by_drafts(acceptance, k, alternative_rate), start=1):
        rate = tokens / (1.0 + costs[n])
        if rate > best_rate:
            best_n, best_rate = n, rate
    return best_n


def _tokens_by_drafts(acceptance: float, k: int, alternative_rate: float) -> Iterator[float]:
    """Expected tokens of a step with 1, 2, ..., k drafts (see best_draft_count)."""
    emitted, reach = 0.0, 1.0
    for _ in range(k):
        emitted += reach * (1.0 + alternative_rate)
        reach *= acceptance
        yield emitted + reach


@dataclass(slots=True)
class _Track:
    acceptance: float = 0.5  # moving average of the per-position acceptance
    alternative_rate: float = 0.0  # ... of an alternative catching the target's token there
    pause: int = 0  # steps left without speculating
    next_pause: int = 0  # length of the next pause: doubles while drafts keep failing
    probe: bool = False  # a pause just ended: draft at least one token to measure again
    # A draft model's: what the target emitted against the draft's confidence.
    calibration: Calibration = field(default_factory=Calibration)


class BackoffPolicy:
    """How many drafts each sequence gets in a step, and when speculation pays at all.

    Not in large batches: above ``max_batch_size`` decoding sequences, verification costs
    real compute. Per sequence, with α its moving acceptance per position, the j-th draft
    is used with probability ~α^j, and n drafts cost ``verify_cost(decoding sequences, n)``
    (what their verification rows add to the step, in units of the time per token of a
    plain step: measured, ``step_cost.StepCostCurve``, or a fixed cost per position and
    sequence) + n x ``draft_cost`` (the proposer's own cost per draft relative to a target
    step: 0 for prompt lookup). A draft model's alternatives count on both sides: their
    rows (a moving average of rows per draft), and the rate at which one catches the
    target's token where the chain breaks (per sequence, one more token each time). The
    sequence gets the n that yields the most tokens per unit of time
    (``best_draft_count``): one that copies its input drafts up to k tokens a step, one
    that rarely matches drafts one or none. The cost of rows is not linear (on CPU a few
    rows cost nearly nothing and many cost a lot), hence the whole curve, not a slope.

    A sequence whose first draft is not worth its cost (or whose acceptance falls below
    ``min_acceptance``, a floor that is off by default) pauses, then probes with a draft;
    each failed probe doubles the pause (up to ``max_pause_steps``). A new sequence starts
    from the engine-wide acceptance: while drafts mostly fail (a poor draft model for this
    traffic), newcomers start paused too, so they only probe now and then."""

    def __init__(
        self,
        *,
        max_batch_size: int,
        min_acceptance: float,
        pause_steps: int = 8,
        max_pause_steps: int = 256,
        verify_cost: VerifyCost | None = None,
        draft_cost: float = 0.0,
        step_costs: LiveStepCosts | None = None,
    ) -> None:
        """``step_costs``: the measured costs of rows, corrected by ``observe_step`` (then
        ``verify_cost`` is theirs)."""
        self.max_batch_size = max_batch_size
        self.min_acceptance = min_acceptance
        self.pause_steps = pause_steps
        self.max_pause_steps = max_pause_steps
        self.step_costs = step_costs
        if step_costs is not None:
            verify_cost = step_costs.verify_cost
        self.verify_cost = verify_cost or flat_verify_cost(POSITION_COST)
        self.draft_cost = draft_cost
        # By decoding sequences: the cost of 0, 1, ... drafts each (asked per sequence a step).
        self._costs: dict[tuple[int, float], list[float]] = {}
        self._tracks: dict[Sequence, _Track] = {}
        self.acceptance = 0.5  # engine-wide moving average, over every verification
        self.alternative_rate = 0.0  # the same for alternatives catching the target's token
        self.rows_per_draft = 1.0  # verified rows per draft: itself and its alternatives
        # A draft model's, engine-wide: its calibration, and the share of the target's
        # choices one pass's candidates cover (its top candidates' summed probability).
        self.calibration = Calibration()
        self.level_mass = 0.7

    def allows_batch(self, num_decodes: int) -> bool:
        return num_decodes <= self.max_batch_size

    def num_drafts(self, seq: Sequence, k: int, num_decodes: int) -> int:
        """Drafts for ``seq`` this step, at most ``k``, with ``num_decodes`` decoding."""
        track = self._track(seq)
        if track.pause:
            track.pause -= 1
            track.probe = track.pause == 0
            return 0
        n = best_draft_count(
            track.acceptance, k, self._draft_costs(num_decodes, k), track.alternative_rate
        )
        if n == 0 and not track.probe:
            self._pause(track)  # each pause after a failed probe is twice as long
            return 0
        track.probe = False
        return max(n, 1)  # a probe drafts one token even where none is worth it

    def observe_step(self, num_decodes: int, rows: int, seconds: float) -> None:
        """A timed decode step of the target: ``num_decodes`` sequences, ``rows`` draft
        rows verified in all (see ``LiveStepCosts``)."""
        if self.step_costs is not None:
            self.step_costs.observe(num_decodes, rows, seconds)
            self._costs.clear()

    # A draft model's steps: its confidence sizes them (draft_plan), not a chain's length.

    def may_draft(self, seq: Sequence) -> bool:
        """Whether ``seq`` drafts this step (False while it is paused, counting down)."""
        track = self._track(seq)
        if track.pause:
            track.pause -= 1
            track.probe = track.pause == 0
            return False
        return True

    def plan(self, seqs: list[Sequence], num_decodes: int) -> StepPlan:
        return StepPlan(
            num_decodes=num_decodes,
            factors=[self._track(s).calibration.factor for s in seqs],
            draft_cost=self.draft_cost,
            verify_cost=self.verify_cost,
            level_mass=self.level_mass,
            probes=[self._track(s).probe for s in seqs],
        )

    def planned(self, seq: Sequence, selection: Selection) -> None:
        """``seq``'s selection this step: where nothing was worth verifying, the draft pass
        was not worth its time, so it pauses (each pause after a failed probe twice as long)."""
        track = self._track(seq)
        track.probe = False
        if not selection.rows:
            self._pause(track)

    def observe_level_mass(self, masses: list[float]) -> None:
        for mass in masses:
            self.level_mass += 0.05 * (mass - self.level_mass)

    def calibrate(self, seq: Sequence, selection: Selection, emitted: int) -> None:
        """After verifying ``selection``: the target emitted ``emitted`` tokens past its own."""
        track = self._track(seq)
        track.calibration.update(selection.confidence, emitted, weight=0.1)
        self.calibration.update(selection.confidence, emitted, weight=0.05)
        if emitted:
            track.next_pause = self.pause_steps  # drafts landed: a later pause starts short
        elif selection.probe:
            self._pause(track)  # a failed probe: the next pause is twice as long

    def _draft_costs(self, num_decodes: int, k: int) -> list[float]:
        # Each draft brings its alternatives' rows too: verified rows per draft, to a tenth.
        rows = round(self.rows_per_draft, 1)
        costs = self._costs.setdefault((num_decodes, rows), [0.0])
        while len(costs) <= k:
            n = len(costs)
            costs.append(self.verify_cost(num_decodes, n * rows) + n * self.draft_cost)
        return costs

    def update(
        self,
        seq: Sequence,
        num_proposed: int,
        num_accepted: int,
        *,
        alternatives: int = 0,
        alternative_hit: bool = False,
    ) -> None:
        """One verification of ``seq``'s chain of ``num_proposed`` drafts (``num_accepted``
        accepted) and ``alternatives`` beside it, one of which caught the target's token
        (``alternative_hit``) or none."""
        track = self._track(seq)
        # Positions tried: each accepted one, and the first rejected (later ones never ran).
        tried = num_accepted + (num_accepted < num_proposed)
        if not tried:  # alternatives alone (a draft model's plan): no chain to measure
            return
        rate = num_accepted / tried
        self.acceptance = 0.8 * self.acceptance + 0.2 * rate
        track.acceptance = 0.7 * track.acceptance + 0.3 * rate
        hit_rate = alternative_hit / tried
        self.alternative_rate = 0.8 * self.alternative_rate + 0.2 * hit_rate
        track.alternative_rate = 0.7 * track.alternative_rate + 0.3 * hit_rate
        if num_proposed:
            drafted = 1.0 + alternatives / num_proposed
            self.rows_per_draft = 0.9 * self.rows_per_draft + 0.1 * drafted
        if track.acceptance < self.min_acceptance:
            self._pause(track)
            track.acceptance = self.min_acceptance  # retry from the threshold, not below
        elif num_accepted:
            track.next_pause = self.pause_steps  # drafts landed: a later pause starts short

    def release(self, seq: Sequence) -> None:
        self._tracks.pop(seq, None)

    def _track(self, seq: Sequence) -> _Track:
        track = self._tracks.get(seq)
        if track is None:
            track = self._tracks[seq] = self._new_track()
        return track

    def _pause(self, track: _Track) -> None:
        track.pause = max(1, track.next_pause)
        track.next_pause = min(2 * track.pause, self.max_pause_steps)
        track.probe = False

    def _new_track(self) -> _Track:
        if self.acceptance >= self.min_acceptance:
            # From the traffic's acceptance: where drafts mostly fail, the first draft is
            # not worth its cost and the newcomer starts with a pause.
            return _Track(
                acceptance=self.acceptance,
                alternative_rate=self.alternative_rate,
                next_pause=self.pause_steps,
                calibration=replace(self.calibration),
            )
        # Start paused, as if the first try had failed already.
        return _Track(self.min_acceptance, pause=self.pause_steps, next_pause=2 * self.pause_steps)
