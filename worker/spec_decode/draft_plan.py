"""Which of a draft model's candidates a step verifies, and whether one more draft pass pays.

A draft model ranks its candidates by its own probabilities: at each depth of its chain,
the token it drafts and its runner-ups (alternatives). As in EAGLE-2 (Li et al., 2024),
the draft's confidence in a candidate, the product of its probabilities along the path
to it, estimates how likely the target is to emit it; here it is calibrated online by
what the target actually emitted (``Calibration``). A step verifies the candidates of all
its drafting sequences by falling estimate for as long as each one's expected token is
worth its verification row, read off the measured cost of rows (``VerifyCost``), and the
draft makes one more pass while the tokens that pass can add are worth its time.

Costs are in units of a plain decode step of the batch: a draft pass costs ``draft_cost``
(whatever it feeds: its weights are read once), and ``verify_cost(decodes, rows / decodes)``
is what ``rows`` more rows add.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from worker.spec_decode.proposal import Proposal

# verify_cost(decoding sequences, rows per sequence): the step time those rows add.
VerifyCost = Callable[[int, float], float]

# Rows a further pass is expected to bring per sequence that takes it (its chain draft and
# a couple of alternatives), for pricing the pass before its candidates are known.
ROWS_PER_PASS = 3.0


@dataclass(slots=True)
class Calibration:
    """Moving sums of what the target emitted past its own token (accepted drafts and hit
    alternatives) against what the draft's confidences predicted, per verification."""

    emitted: float = 0.5
    predicted: float = 0.5

    @property
    def factor(self) -> float:
        """Estimated probability per unit of draft confidence (1: a calibrated draft)."""
        return min(1.5, max(0.05, self.emitted / max(self.predicted, 1e-6)))

    def update(self, predicted: float, emitted: int, weight: float) -> None:
        self.emitted += weight * (emitted - self.emitted)
        self.predicted += weight * (predicted - self.predicted)


@dataclass(slots=True)
class Candidate:
    value: float  # estimated probability that the target emits this token here
    confidence: float  # the draft's own: the product of its probabilities along the path
    index: int  # the sequence's index in the plan
    depth: int
    token: int
    chain: bool  # the chain's draft at this depth, else an alternative


@dataclass(slots=True)
class Selection:
    """What one sequence verifies: the chain's first ``chain`` drafts, and alternatives as
    (depth, token), each standing in for the chain's draft at that depth."""

    chain: int = 0
    alternatives: list[tuple[int, int]] = field(default_factory=list)
    confidence: float = 0.0  # the draft's summed confidence in them: its prediction
    probe: bool = False  # verified as a probe, not for its worth

    @property
    def rows(self) -> int:
        return self.chain + len(self.alternatives)


class StepPlan:
    """One step's drafting: ``add`` after each pass, ``continuing`` to choose who takes the
    next one, ``select`` at the end. ``factors``: each sequence's calibration factor;
    ``level_mass``: the share of the target's choices a pass's candidates are expected to
    cover (a moving average of the draft's top-candidate mass)."""

    def __init__(
        self,
        *,
        num_decodes: int,
        factors: list[float],
        draft_cost: float,
        verify_cost: VerifyCost,
        level_mass: float,
        probes: list[bool] | None = None,
    ) -> None:
        """``probes``: sequences that verify their first draft whatever it is worth (a pause
        just ended: what the target emits is what calibrates the draft's confidence)."""
        self.num_decodes = max(1, num_decodes)
        self.probes = probes or [False] * len(factors)
        self.factors = factors
        self.draft_cost = draft_cost
        self.verify_cost = verify_cost
        self.level_mass = level_mass
        self.spent = 0.0  # the passes run so far
        self.proposals: list[Proposal | None] = [None] * len(factors)
        self.masses: list[float] = []  # each level's candidate mass, for the moving average

    def add(self, index: int, proposal: Proposal) -> None:
        """The sequence's proposal after a pass gave it one more level."""
        self.proposals[index] = proposal
        level = len(proposal.token_ids) - 1
        self.masses.append(proposal.confidence[level] + sum(proposal.alternative_probs[level]))

    def pass_done(self) -> None:
        """A draft pass ran."""
        self.spent += self.draft_cost

    def continuing(self, active: list[int]) -> list[int]:
        """Of the sequences that may draft deeper, those that take one more pass; none if
        the pass is not worth its time for the step as a whole."""
        picked, step_tokens, step_cost = self._best()
        rows = sum(s.rows for s in picked.values())
        rate = step_tokens / step_cost
        gains = {i: self._reach(i) * self.factors[i] * self.level_mass for i in active}
        # A sequence whose next level cannot repay its own rows is left out first.
        row_cost = self._rows_cost(rows + ROWS_PER_PASS) - self._rows_cost(rows)
        wanted = [i for i in active if gains[i] > rate * row_cost]
        if not wanted:
            return []
        added = self.draft_cost + (
            self._rows_cost(rows + ROWS_PER_PASS * len(wanted)) - self._rows_cost(rows)
        )
        gain = sum(gains[i] for i in wanted)
        return wanted if (step_tokens + gain) / (step_cost + added) > rate else []

    def select(self) -> list[Selection]:
        """Each sequence's candidates to verify (the best set for the step's rate); none
        for any if even the best does not beat a plain step (the passes were not worth
        their time)."""
        picked, tokens, cost = self._best()
        if tokens / cost <= self.num_decodes:
            picked = {}
        for i, proposal in enumerate(self.proposals):
            if self.probes[i] and i not in picked and proposal is not None:
                picked[i] = Selection(chain=1, confidence=proposal.confidence[0], probe=True)
        return [picked.get(i, Selection()) for i in range(len(self.proposals))]

    def _best(self) -> tuple[dict[int, Selection], float, float]:
        """The candidates that maximize the step's tokens per unit of time: the best prefix
        of all candidates by falling value (a candidate comes after its parent)."""
        base_cost = 1.0 + self.spent
        tokens = float(self.num_decodes)
        best_tokens, best_cost, best_count = tokens, base_cost, 0
        order = self._candidates()
        chosen: list[Candidate] = []
        chain_depths: dict[int, int] = {}  # sequence -> chain drafts chosen
        for c in order:
            # Its parent, the chain's draft one level up, must be verified too.
            if c.depth > chain_depths.get(c.index, 0):
                continue
            if c.chain and c.depth != chain_depths.get(c.index, 0):
                continue
            chosen.append(c)
            if c.chain:
                chain_depths[c.index] = c.depth + 1
            tokens += c.value
            cost = base_cost + self._rows_cost(len(chosen))
            if tokens / cost > best_tokens / best_cost:
                best_tokens, best_cost, best_count = tokens, cost, len(chosen)
        picked: dict[int, Selection] = {}
        for c in chosen[:best_count]:
            s = picked.setdefault(c.index, Selection())
            if c.chain:
                s.chain += 1
            else:
                s.alternatives.append((c.depth, c.token))
            s.confidence += c.confidence
        for s in picked.values():
            s.alternatives.sort()  # by depth: the scheduler trims from the end
        return picked, best_tokens, best_cost

    def _candidates(self) -> list[Candidate]:
        out = []
        for i, proposal in enumerate(self.proposals):
            if proposal is None:
                continue
            reach = 1.0  # the draft's confidence that the chain gets this deep
            for depth, token in enumerate(proposal.token_ids):
                for alt, prob in zip(
                    proposal.alternatives[depth], proposal.alternative_probs[depth], strict=True
                ):
                    confidence = reach * prob
                    out.append(
                        Candidate(confidence * self.factors[i], confidence, i, depth, alt, False)
                    )
                reach *= proposal.confidence[depth]
                out.append(Candidate(reach * self.factors[i], reach, i, depth, token, True))
        # By falling value; a chain draft before the alternatives it parents on ties.
        out.sort(key=lambda c: (-c.value, c.depth, not c.chain))
        return out

    def _reach(self, index: int) -> float:
        """The draft's confidence that the target accepts this sequence's whole chain."""
        proposal = self.proposals[index]
        reach = 1.0
        for prob in proposal.confidence if proposal is not None else []:
            reach *= prob
        return reach

    def _rows_cost(self, rows: float) -> float:
        return self.verify_cost(self.num_decodes, rows / self.num_decodes) if rows else 0.0
