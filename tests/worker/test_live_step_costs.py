"""LiveStepCosts: the start-up table of step costs, corrected by the steps the engine times."""

from __future__ import annotations

import itertools

import pytest
import torch

from factories import random_prompts
from worker import LLM, SamplingParams
from worker.core.config import SpeculativeConfig
from worker.spec_decode.backoff import BackoffPolicy
from worker.spec_decode.step_cost import MIN_OBSERVATIONS, LiveStepCosts, StepCostTable

# Timed at start: one sequence 20 ms plain, drafts free up to 8 rows (underestimated),
# 16 rows +50%; two sequences 24 ms plain, +25% with 4 drafts each.
TABLE = StepCostTable(
    (1, 2), ((0, 4, 8, 16), (0, 4)), ((0.020, 0.020, 0.020, 0.030), (0.024, 0.030))
)


def observed(costs: LiveStepCosts, num_decodes: int, rows: int, seconds: float, times: int):
    for _ in range(times):
        costs.observe(num_decodes, rows, seconds)


def test_before_enough_steps_the_table_holds():
    costs = LiveStepCosts(TABLE)
    observed(costs, 1, 8, 0.026, MIN_OBSERVATIONS - 1)
    for n in (0, 2, 8, 12, 16):
        assert costs.verify_cost(1, n) == pytest.approx(TABLE.verify_cost(1, n))
        assert costs.time(2, n / 2) == pytest.approx(TABLE.time(2, n / 2))


def test_steps_that_ran_replace_the_tables_figure():
    """Eight rows beside one sequence measured 26 ms as the engine ran (the table said 20):
    they cost 30% of a plain step, and the rows between interpolate between the figures."""
    costs = LiveStepCosts(TABLE)
    observed(costs, 1, 0, 0.020, MIN_OBSERVATIONS)
    observed(costs, 1, 8, 0.026, MIN_OBSERVATIONS)
    assert costs.verify_cost(1, 8) == pytest.approx(0.3)
    assert costs.verify_cost(1, 4) == pytest.approx(0.0)  # the table's point, unmoved
    assert costs.verify_cost(1, 6) == pytest.approx(0.15)
    assert costs.verify_cost(1, 16) == pytest.approx(0.5)
    # two sequences: nothing observed there, the table as it was
    assert costs.verify_cost(2, 4) == pytest.approx(TABLE.verify_cost(2, 4))


def test_the_median_of_the_latest_steps_counts():
    """An interrupted step is an outlier, not the price; old steps age out of the window."""
    costs = LiveStepCosts(TABLE, window=8)
    observed(costs, 1, 0, 0.020, 8)
    observed(costs, 1, 4, 0.022, 6)
    costs.observe(1, 4, 0.500)  # a hiccup
    assert costs.time(1, 4) == pytest.approx(0.022)
    observed(costs, 1, 4, 0.024, 8)  # the machine slowed: the window now holds these only
    assert costs.time(1, 4) == pytest.approx(0.024)


def test_the_tables_other_points_follow_the_machines_drift():
    """Plain steps now take 25 ms where the table said 20: its unobserved points scale by
    the same 1.25, so the cost of rows relative to a plain step stays the table's."""
    costs = LiveStepCosts(TABLE)
    observed(costs, 1, 0, 0.025, MIN_OBSERVATIONS)
    assert costs.time(1, 16) == pytest.approx(0.030 * 1.25)
    assert costs.verify_cost(1, 16) == pytest.approx(TABLE.verify_cost(1, 16))


def test_more_rows_never_cost_less():
    """An observed figure below the table's at fewer rows is pooled with it, not believed."""
    costs = LiveStepCosts(TABLE)
    observed(costs, 1, 0, 0.020, MIN_OBSERVATIONS)
    observed(costs, 1, 16, 0.021, MIN_OBSERVATIONS)  # below the drift-scaled 8-row figure?
    observed(costs, 1, 8, 0.024, MIN_OBSERVATIONS)
    times = [costs.time(1, n) for n in (0, 4, 8, 12, 16, 20)]
    assert all(a <= b + 1e-12 for a, b in itertools.pairwise(times))
    assert costs.time(1, 8) == pytest.approx(costs.time(1, 16))  # pooled: (24 + 21) / 2
    assert costs.time(1, 8) == pytest.approx(0.0225)


def test_bad_observations_are_ignored():
    costs = LiveStepCosts(TABLE)
    for args in ((0, 4, 0.02), (1, -1, 0.02), (1, 4, 0.0), (1, 4, float("nan"))):
        observed(costs, *args, MIN_OBSERVATIONS)
    assert costs.verify_cost(1, 4) == pytest.approx(TABLE.verify_cost(1, 4))


def test_the_policy_prices_drafts_from_what_it_observes():
    """A sequence accepting 60% a position drafts as far as the table makes worth it; once
    the engine has seen rows cost more than the table said, it drafts fewer."""
    policy = BackoffPolicy(max_batch_size=8, min_acceptance=0.0, step_costs=LiveStepCosts(TABLE))
    seq = object()
    policy._track(seq).acceptance = 0.6  # type: ignore[arg-type]
    before = policy.num_drafts(seq, 16, 1)  # type: ignore[arg-type]
    assert before >= 4  # four rows are free in the table
    for rows, seconds in ((0, 0.020), (1, 0.024), (2, 0.028), (4, 0.036), (8, 0.052)):
        for _ in range(MIN_OBSERVATIONS):
            policy.observe_step(1, rows, seconds)
    after = policy.num_drafts(seq, 16, 1)  # type: ignore[arg-type]
    assert 0 < after < before
    assert policy.verify_cost(1, 4) == pytest.approx(0.8)


def test_the_engine_reports_its_decode_steps(target, close_draft):
    """On CPU the speculator's policy gets every decode step, timed, with its rows."""
    llm = LLM(
        target,
        dtype="float32",
        speculative_model=str(close_draft),
        num_speculative_tokens=3,
        speculative_max_batch_size=4,
    )
    costs = llm.engine.speculator.policy.step_costs
    assert costs is not None
    llm.generate(random_prompts(2, min_len=3, max_len=8, seed=2), SamplingParams(max_tokens=24))
    seen = costs._samples
    assert sum(len(s) for s in seen.values()) >= 20
    assert any(rows > 0 for _, rows in seen)  # steps that verified drafts
    assert all(0 < t < 10 for s in seen.values() for t in s)
    assert {b for b, _ in seen} <= {1, 2}


def test_a_gpu_keeps_the_start_up_table():
    """Where the forward pass returns before the device is done (CUDA), steps are not timed
    as they run: no live correction (the table itself synchronizes as it times)."""
    from worker.spec_decode import setup

    spec = setup.build_speculator(
        SpeculativeConfig(model="ngram", num_tokens=4, max_batch_size=8, alternatives=0),
        dtype=torch.float32,
        device="cuda",
        block_manager=None,  # type: ignore[arg-type]
        max_model_len=64,
        vocab_size=16,
        tokenizer=None,
        target_weight_bytes=1,
        copy_kv_slots=lambda src, dst: None,
        measure_steps=lambda batch, drafts: TABLE,
    )
    assert spec is not None and spec.policy.step_costs is None
    assert spec.policy.verify_cost(1, 16) == pytest.approx(TABLE.verify_cost(1, 16))
