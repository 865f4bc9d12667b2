"""The decode step budget (worker.core.step_budget): the curve of step times it learns, the
default it takes, and the scheduler's steps under it, as scripted scenarios."""

from __future__ import annotations

import pytest

from worker.core.block_manager import BlockManager
from worker.core.config import FairnessConfig
from worker.core.fairness import split_rows
from worker.core.scheduler import Scheduler
from worker.core.sequence import Sequence
from worker.core.step_budget import (
    ACTIVE_GRACE_S,
    IDLE_STEPS,
    MIN_PREFILL_TOKENS,
    DecodeStepBudget,
    StepTimes,
    default_budget,
)
from worker.sampling.sampling_params import SamplingParams

# A machine where a step costs 10 ms plus 0.1 ms a token up to 256 tokens, then more per
# token (attention over long prompts): 10, 16.4, 35.6, 140 ms.
SWEEP = {1: 0.0101, 64: 0.0164, 256: 0.0356, 1024: 0.140}


# --- the curve ---------------------------------------------------------------------------------


def test_the_curve_interpolates_between_measured_points():
    times = StepTimes(SWEEP)
    assert times.seconds(1) == pytest.approx(0.0101)
    assert times.seconds(64) == pytest.approx(0.0164)
    assert times.seconds(160) == pytest.approx(0.0164 + (0.0356 - 0.0164) * 96 / 192)
    assert times.seconds(0.5) == pytest.approx(0.0101)  # below the first point: its time


def test_past_the_last_point_time_grows_in_proportion_to_tokens():
    times = StepTimes(SWEEP)
    assert times.seconds(2048) == pytest.approx(0.280)


def test_the_tokens_within_a_time_invert_the_curve():
    times = StepTimes(SWEEP)
    assert times.max_tokens_within(0.0164) == 64
    assert times.max_tokens_within(0.026) == 160  # halfway from 64 to 256
    assert times.max_tokens_within(0.140) == 1024
    assert times.max_tokens_within(0.280) == 2048
    assert times.max_tokens_within(0.005) == 0  # even one token takes longer
    assert StepTimes().max_tokens_within(1.0) is None  # nothing known yet


def test_a_larger_step_never_reads_as_cheaper():
    """A noisy sweep where 128 tokens timed below 64: the curve holds 64's time there."""
    times = StepTimes({1: 0.010, 64: 0.030, 128: 0.020, 256: 0.050})
    assert times.points() == ([1.0, 64.0, 128.0, 256.0], [0.010, 0.030, 0.030, 0.050])
    assert times.max_tokens_within(0.030) == 128


def test_observed_steps_replace_the_sweep_once_there_are_enough():
    times = StepTimes(SWEEP, min_observations=4)
    for seconds in (0.030, 0.032, 0.100, 0.031):  # one slow outlier among four
        assert times.seconds(64) == pytest.approx(0.0164)  # not yet four
        times.observe(64, seconds)
    # The median of the four (0.0315), not the outlier, and not the sweep's figure.
    assert times.seconds(64) == pytest.approx(0.0315)
    assert times.max_tokens_within(0.0356) == 256  # the later point is kept above it


def test_observations_of_nearby_sizes_share_a_band():
    """Steps of 60 to 68 tokens fall in the half-octave band of 64: their medians make one
    point, at the median size."""
    times = StepTimes(min_observations=3)
    for tokens, seconds in ((60, 0.010), (64, 0.011), (68, 0.012)):
        times.observe(tokens, seconds)
    assert times.points() == ([64.0], [0.011])


def test_only_the_latest_observations_count():
    times = StepTimes(window=4, min_observations=4)
    for _ in range(4):
        times.observe(64, 0.100)
    for _ in range(4):
        times.observe(64, 0.020)  # the machine got faster
    assert times.seconds(64) == pytest.approx(0.020)


@pytest.mark.parametrize("bad", [(0, 0.1), (-3, 0.1), (8, 0.0), (8, float("nan"))])
def test_meaningless_observations_are_ignored(bad):
    times = StepTimes(min_observations=1)
    times.observe(*bad)
    assert not times.known


# --- the measured default ----------------------------------------------------------------------


def test_the_default_budget_is_three_of_a_lone_streams_decode_steps():
    """The one-row decode step (on a CPU the one-call native step, shorter than the sweep's
    one-token prompt step through torch), else the sweep's one-token step."""
    assert IDLE_STEPS == 3
    assert default_budget(SWEEP, {1: 0.0071, 8: 0.0093}) == pytest.approx(3 * 0.0071)
    assert default_budget(SWEEP) == pytest.approx(3 * 0.0101)
    assert default_budget(SWEEP, {8: 0.0093}) == pytest.approx(3 * 0.0101)
    assert default_budget({64: 0.0164}) is None  # no one-token step measured
    assert default_budget({}, {}) is None


def test_a_budget_must_be_positive():
    with pytest.raises(ValueError):
        DecodeStepBudget(StepTimes(SWEEP), 0.0)


# --- the scheduler under a budget --------------------------------------------------------------


def make_scheduler(
    *, budget_s: float | None, max_tokens: int = 1024, policy: str = "fair"
) -> Scheduler:
    return Scheduler(
        block_manager=BlockManager(num_blocks=512, block_size=16),
        max_num_seqs=128,
        max_num_batched_tokens=max_tokens,
        step_budget=None if budget_s is None else DecodeStepBudget(StepTimes(SWEEP), budget_s),
        fairness=FairnessConfig(policy=policy),
    )


def make_seq(order: int, prompt_len: int, tenant: str = "a") -> Sequence:
    return Sequence(f"r{order}", [3] * prompt_len, SamplingParams(), order, tenant=tenant)


def run_step(sched: Scheduler) -> list[tuple[str, int, int]]:
    out = sched.schedule()
    plan = [(s.seq.request_id, s.start, s.num_tokens) for s in out.scheduled]
    for s in out.scheduled:
        s.seq.num_computed_tokens += s.num_tokens
        if s.samples:
            s.seq.append_token(7)
    return plan


def decoding(sched: Scheduler, count: int, tenant: str = "d", first: int = 100) -> list[Sequence]:
    """``count`` sequences past their prompts, each with a token to decode."""
    seqs = [make_seq(first + i, 4, tenant=tenant) for i in range(count)]
    for seq in seqs:
        sched.add(seq)
    while any(not seq.output_token_ids for seq in seqs):
        run_step(sched)
    return seqs


def test_a_step_of_prefill_alone_fills_the_token_limit():
    sched = make_scheduler(budget_s=0.0164)
    sched.add(make_seq(0, 2000))
    assert run_step(sched) == [("r0", 0, 1024)]


def test_beside_decodes_a_prompt_gets_what_the_budget_leaves():
    """A budget of 16.4 ms is 64 tokens on this curve: 4 decodes and 60 prompt tokens."""
    sched = make_scheduler(budget_s=0.0164)
    decoding(sched, 4)
    sched.add(make_seq(0, 2000))
    plan = run_step(sched)
    assert plan == [("r100", 4, 1), ("r101", 4, 1), ("r102", 4, 1), ("r103", 4, 1), ("r0", 0, 60)]
    assert run_step(sched)[-1] == ("r0", 60, 60)


def test_beside_its_own_tenants_decodes_alone_a_prompt_fills_the_step():
    """The budget guards other tenants' decodes: a tenant's prompt beside only its own
    decodes takes the whole token limit; once another tenant decodes too, the budget's."""
    sched = make_scheduler(budget_s=0.0164)
    decoding(sched, 4, tenant="a")
    sched.add(make_seq(0, 2000, tenant="a"))
    assert run_step(sched)[-1] == ("r0", 0, 1020)
    decoding(sched, 1, tenant="b", first=200)
    plan = run_step(sched)
    assert [rid for rid, _, n in plan if n == 1] == ["r100", "r101", "r102", "r103", "r200"]
    assert plan[-1][0] == "r0" and plan[-1][2] == 64 - 5  # the budget's 64 tokens, less 5 decodes


def test_beside_another_tenants_prompt_a_prompt_gets_what_the_budget_leaves():
    """A quiet tenant's prompt goes first (its counter is lowest) beside a flood's decodes;
    the flood's own prompt then gets only what the budget leaves, so the step that carries
    the quiet prompt stays short."""
    sched = make_scheduler(budget_s=0.0164)
    decoding(sched, 4, tenant="flood")
    sched.add(make_seq(0, 2000, tenant="flood"))
    assert run_step(sched)[-1] == ("r0", 0, 1020)
    sched.add(make_seq(1, 40, tenant="quiet"))
    plan = run_step(sched)
    assert plan[4:] == [("r1", 0, 40), ("r0", 1020, 20)]


def test_a_tenant_counts_as_active_for_a_grace_after_its_last_sequence_left():
    """A closed-loop client's next question arrives just after its answer: until the grace
    runs out, another tenant's prompt still gets only the budget's room."""
    sched = make_scheduler(budget_s=0.0164)
    decoding(sched, 4, tenant="flood")
    (quiet,) = decoding(sched, 1, tenant="quiet", first=500)
    sched.remove(quiet)
    sched.add(make_seq(0, 2000, tenant="flood"))
    assert run_step(sched)[-1] == ("r0", 0, 60)
    sched.tenants_left_at["quiet"] -= ACTIVE_GRACE_S
    assert run_step(sched)[-1] == ("r0", 60, 1020)


def test_without_a_budget_decodes_ride_beside_a_full_chunk():
    sched = make_scheduler(budget_s=None)
    decoding(sched, 4)
    sched.add(make_seq(0, 2000))
    assert run_step(sched)[-1] == ("r0", 0, 1020)


def test_decodes_past_the_budget_still_run_beside_a_minimum_of_prefill():
    """90 decodes take longer than the 64-token budget: all decode, and a prompt still
    advances by MIN_PREFILL_TOKENS, so new requests are admitted."""
    sched = make_scheduler(budget_s=0.0164)
    decoding(sched, 90)
    sched.add(make_seq(0, 2000))
    plan = run_step(sched)
    assert len(plan) == 91 and all(n == 1 for _, _, n in plan[:-1])
    assert plan[-1] == ("r0", 0, MIN_PREFILL_TOKENS)


def test_a_budget_still_unknown_caps_nothing():
    sched = Scheduler(
        block_manager=BlockManager(num_blocks=512, block_size=16),
        max_num_seqs=64,
        max_num_batched_tokens=1024,
        step_budget=DecodeStepBudget(StepTimes(), 0.0164),
    )
    decoding(sched, 4)
    sched.add(make_seq(0, 2000))
    assert run_step(sched)[-1] == ("r0", 0, 1020)


def test_the_budgets_prefill_goes_to_tenants_in_fair_order():
    """Two tenants' prompts behind the same decodes: the room the budget leaves goes to the
    tenant served least (here the newcomer b, whose counter starts at the lowest), as
    without a budget."""
    sched = make_scheduler(budget_s=0.0164)
    decoding(sched, 4)
    sched.add(make_seq(0, 2000, tenant="a"))
    run_step(sched)  # a's first 60 tokens
    sched.add(make_seq(1, 40, tenant="b"))
    plan = run_step(sched)
    assert plan[4:] == [("r1", 0, 40), ("r0", 60, 20)]


# --- decode rows under a flood -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("demand", "weights", "total", "expected"),
    [
        ({"a": 90, "b": 1}, {}, 64, {"a": 63, "b": 1}),  # b asks less than its share
        ({"a": 40, "b": 40}, {}, 64, {"a": 32, "b": 32}),
        ({"a": 60, "b": 40}, {"a": 3.0}, 64, {"a": 48, "b": 16}),
        ({"a": 40, "b": 40}, {"a": 3.0}, 64, {"a": 40, "b": 24}),  # a needs less than 48
        ({"a": 10, "b": 3, "c": 50}, {}, 30, {"a": 10, "b": 3, "c": 17}),  # filled in rounds
        ({"a": 5, "b": 5, "c": 5}, {}, 7, {"a": 3, "b": 2, "c": 2}),  # remainder: one more
        ({"a": 9, "b": 9, "c": 9}, {}, 2, {"a": 1, "b": 1, "c": 1}),  # at least one each
        ({"a": 3, "b": 0}, {}, 2, {"a": 2, "b": 0}),
    ],
)
def test_rows_are_split_max_min_fair_by_weight(demand, weights, total, expected):
    assert split_rows(demand, weights, total) == expected


def test_a_quiet_tenants_decode_runs_every_step_beside_a_flood_whose_rows_take_turns():
    """90 of a flood's decodes and one of a quiet tenant's, a budget of 64 tokens: each step
    places the quiet row and 63 of the flood's, those left out the step before first, so
    no flood row waits more than one step."""
    sched = make_scheduler(budget_s=0.0164)
    flood = decoding(sched, 90, tenant="flood")
    quiet = decoding(sched, 1, tenant="quiet", first=500)[0]
    waits = dict.fromkeys((s.request_id for s in flood), 0)
    before = [len(s.output_token_ids) for s in flood]
    for _ in range(6):
        plan = run_step(sched)
        placed = {rid for rid, _, _ in plan}
        assert quiet.request_id in placed
        assert len(placed) == 64
        for rid in waits:
            waits[rid] = 0 if rid in placed else waits[rid] + 1
            assert waits[rid] <= 1
    gained = {len(s.output_token_ids) - n for s, n in zip(flood, before, strict=True)}
    assert gained <= {4, 5}  # 63 rows a step for 90 streams: everyone kept the same pace


def test_a_flood_with_no_one_beside_it_decodes_whole():
    sched = make_scheduler(budget_s=0.0164)
    decoding(sched, 90, tenant="flood")
    assert len(run_step(sched)) == 90


def test_fcfs_decodes_every_row():
    sched = make_scheduler(budget_s=0.0164, policy="fcfs")
    decoding(sched, 90, tenant="flood")
    decoding(sched, 1, tenant="quiet", first=500)
    assert len(run_step(sched)) == 91


# --- in the engine -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from factories import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("budget"), max_position_embeddings=512)


def make_engine(checkpoint, **options):
    from worker import LLMEngine, engine_config

    options = {"dtype": "float32", "block_size": 4, "num_kv_blocks": 1024, **options}
    return LLMEngine(checkpoint, engine_config(**options))


def test_warm_up_measures_the_steps_and_takes_three_lone_decode_steps_as_the_budget(checkpoint):
    engine = make_engine(checkpoint, warmup=True, max_num_batched_tokens=256)
    budget = engine.scheduler.step_budget
    assert budget is not None
    tokens, _ = budget.times.points()
    assert tokens == [1.0, 16.0, 32.0, 64.0, 128.0, 256.0]  # the sweep, up to the step limit
    rows, seconds = budget.decode_times.points()
    assert rows[0] == 1 and budget.seconds == pytest.approx(IDLE_STEPS * seconds[0])
    assert (
        make_engine(checkpoint, warmup=True, decode_step_budget_ms=0).scheduler.step_budget is None
    )
    assert make_engine(checkpoint).scheduler.step_budget is None  # no warm-up, none set


def test_a_set_budget_learns_the_steps_as_they_run(checkpoint):
    from factories import drain, random_prompts
    from worker import SamplingParams

    engine = make_engine(checkpoint, decode_step_budget_ms=50.0)
    budget = engine.scheduler.step_budget
    assert budget is not None and budget.seconds == 0.050 and budget.token_cap() is None
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for i, prompt in enumerate(random_prompts(4, min_len=3, max_len=10, seed=1)):
        engine.add_request(str(i), prompt, params)
    drain(engine)
    assert budget.times.known and budget.token_cap() is not None


def test_a_tight_budget_changes_the_steps_not_the_tokens(checkpoint):
    """Greedy outputs with steps cut to their decodes and MIN_PREFILL_TOKENS of prompt are
    those of unbounded steps (chunked prefill computes the same K/V); every step that carried
    decodes carried at most that much prompt."""
    from factories import drain, random_prompts
    from worker import SamplingParams

    prompts = random_prompts(6, min_len=20, max_len=120, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = {}
    for budget_ms in (0, 1e-6):
        engine = make_engine(checkpoint, warmup=True, decode_step_budget_ms=budget_ms)
        steps = []
        schedule = engine.scheduler.schedule

        def recorded(schedule=schedule, steps=steps):
            out = schedule()
            steps.append([(s.num_tokens, s.seq.num_uncomputed_tokens) for s in out.scheduled])
            return out

        engine.scheduler.schedule = recorded
        for i, prompt in enumerate(prompts):
            # A tenant each: the budget caps prompts beside other tenants' decodes.
            engine.add_request(str(i), prompt, params, tenant=f"t{i}")
            engine.step()  # arrivals spread over decoding steps
        outputs[budget_ms] = {r: o.token_ids for r, o in drain(engine).items()}
        if budget_ms:
            mixed = [s for s in steps if any(left <= 1 for _, left in s) and len(s) > 1]
            assert mixed  # steps that carried decodes beside prompts
            for step in mixed:
                assert sum(n for n, left in step if left > 1) <= MIN_PREFILL_TOKENS, step
    assert outputs[1e-6] == outputs[0]
