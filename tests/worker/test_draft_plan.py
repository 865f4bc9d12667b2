"""worker.spec_decode.draft_plan: which of a draft model's candidates a step verifies and
whether another pass pays, worked by hand with flat costs (no model)."""

from __future__ import annotations

import pytest

from worker.spec_decode.backoff import flat_verify_cost
from worker.spec_decode.draft_plan import Calibration, StepPlan
from worker.spec_decode.proposal import Proposal


def make_proposal(levels: list[tuple[int, float, list[tuple[int, float]]]]) -> Proposal:
    """Per depth: the chain's draft, the draft's probability of it, (alternative, prob)."""
    return Proposal(
        token_ids=[t for t, _, _ in levels],
        alternatives=[[a for a, _ in alts] for _, _, alts in levels],
        confidence=[p for _, p, _ in levels],
        alternative_probs=[[q for _, q in alts] for _, _, alts in levels],
    )


def make_plan(proposals, *, row_cost=0.02, draft_cost=0.1, passes=2, factors=None, **kw):
    plan = StepPlan(
        num_decodes=kw.pop("num_decodes", len(proposals)),
        factors=factors or [1.0] * len(proposals),
        draft_cost=draft_cost,
        verify_cost=flat_verify_cost(row_cost),
        level_mass=kw.pop("level_mass", 0.7),
        **kw,
    )
    for i, proposal in enumerate(proposals):
        plan.add(i, proposal)
    for _ in range(passes):
        plan.pass_done()
    return plan


# Two levels: chain 10 (0.6) then 11 (0.5); alternatives 20 (0.2) and 21 (0.05) at depth 0,
# 30 (0.3) at depth 1. Estimated values: 10: 0.6, 11: 0.3, 20: 0.2, 30: 0.18, 21: 0.05.
TWO_LEVELS = [(10, 0.6, [(20, 0.2), (21, 0.05)]), (11, 0.5, [(30, 0.3)])]


def test_candidates_go_in_by_value_while_the_rate_rises():
    """Two passes at 0.1 each: base cost 1.2. At 0.02 a row every candidate pays (the rate
    rises to 2.33 / 1.30); at 0.06 the last one does not (2.28 / 1.44 = 1.583 beats
    2.33 / 1.50 = 1.553)."""
    cheap = make_plan([make_proposal(TWO_LEVELS)], row_cost=0.02).select()[0]
    assert (cheap.chain, cheap.alternatives) == (2, [(0, 20), (0, 21), (1, 30)])
    assert cheap.confidence == pytest.approx(0.6 + 0.3 + 0.2 + 0.18 + 0.05)
    dear = make_plan([make_proposal(TWO_LEVELS)], row_cost=0.06).select()[0]
    assert (dear.chain, dear.alternatives) == (2, [(0, 20), (1, 30)])


def test_calibration_scales_the_estimates():
    """A draft whose confidence the target bears out only half the time: values halve, and
    at 0.06 a row only the chain's first draft and the best alternative pay."""
    plan = make_plan([make_proposal(TWO_LEVELS)], row_cost=0.06, factors=[0.5])
    chosen = plan.select()[0]
    # values 0.3, 0.15, 0.1, ...: 1.3 / 1.26 = 1.032, 1.45 / 1.32 = 1.098, 1.55 / 1.38 = 1.123,
    # then 1.64 / 1.44 = 1.139, 1.665 / 1.50 = 1.110
    assert (chosen.chain, chosen.alternatives) == (2, [(0, 20), (1, 30)])
    assert chosen.confidence == pytest.approx(0.6 + 0.3 + 0.2 + 0.18)  # the draft's own


def test_an_alternative_may_stand_without_its_chain_draft_or_past_the_chain():
    """A sampled chain draft the draft itself rated low (0.1) below an alternative (0.5)
    at 0.15 a row: the alternative goes in alone (1.5 / 1.35 beats 1.6 / 1.50 with the
    chain's draft too). A depth-1 alternative (0.9 x 0.25) worth more than the chain's
    second draft (0.9 x 0.2) at 0.14 a row: it goes in past a chain of one."""
    levels = [(10, 0.1, [(20, 0.5)]), (11, 0.9, [(30, 0.05)])]
    chosen = make_plan([make_proposal(levels)], row_cost=0.15).select()[0]
    assert (chosen.chain, chosen.alternatives) == (0, [(0, 20)])
    levels = [(10, 0.9, []), (11, 0.2, [(30, 0.25)])]
    chosen = make_plan([make_proposal(levels)], row_cost=0.14).select()[0]
    # 1.9 / 1.34 = 1.418, + 0.225: 2.125 / 1.48 = 1.436, + 0.18: 2.305 / 1.62 = 1.423
    assert (chosen.chain, chosen.alternatives) == (1, [(1, 30)])


def test_a_candidate_never_goes_in_before_its_parent():
    """Values tie (0.3 x 1.0 = 0.3): the chain's draft, the parent, comes first."""
    levels = [(10, 0.3, [(20, 0.3)]), (11, 1.0, [])]
    chosen = make_plan([make_proposal(levels)], row_cost=0.01).select()[0]
    assert chosen.chain == 2 and chosen.alternatives == [(0, 20)]
    plan = make_plan([make_proposal(levels)])
    order = [(c.depth, c.chain) for c in plan._candidates()]
    assert order.index((0, True)) < order.index((1, True))


def test_nothing_is_verified_where_nothing_beats_a_plain_step():
    """Passes as dear as a step: no selection gains enough to beat a plain step; a probe
    still verifies its first draft."""
    proposals = [make_proposal(TWO_LEVELS)]
    assert make_plan(proposals, draft_cost=1.0).select()[0].rows == 0
    probe = make_plan(proposals, draft_cost=1.0, probes=[True]).select()[0]
    assert (probe.chain, probe.alternatives, probe.probe) == (1, [], True)
    assert probe.confidence == pytest.approx(0.6)


def test_the_step_selects_across_its_sequences():
    """Two sequences in a step of two: the confident one's candidates go in first."""
    sure = make_proposal([(10, 0.9, [(20, 0.05)]), (11, 0.9, [])])
    unsure = make_proposal([(12, 0.1, [(22, 0.05)]), (13, 0.1, [])])
    first, second = make_plan([sure, unsure], row_cost=0.02).select()
    assert first.chain == 2
    assert second.rows < first.rows


def test_another_pass_when_its_tokens_beat_its_time():
    """After one pass: a chain the draft is sure of (reach 0.9) expects 0.9 x 0.7 more
    tokens from a pass at 0.1: it continues; at reach 0.1 (0.07 more) it stops."""
    sure = make_plan([make_proposal([(10, 0.9, [])])], passes=1)
    assert sure.continuing([0]) == [0]
    unsure = make_plan([make_proposal([(10, 0.1, [])])], passes=1)
    assert unsure.continuing([0]) == []
    dear = make_plan([make_proposal([(10, 0.9, [])])], passes=1, draft_cost=1.0)
    assert dear.continuing([0]) == []


def test_calibration_follows_what_the_target_emits():
    calibration = Calibration()
    assert calibration.factor == pytest.approx(1.0)
    for _ in range(50):  # the draft predicts 2 tokens a verification, the target gives 1
        calibration.update(2.0, 1, weight=0.1)
    assert calibration.factor == pytest.approx(0.5, abs=0.01)
    for _ in range(50):
        calibration.update(1.0, 0, weight=0.1)
    assert calibration.factor == pytest.approx(0.05)  # floored
