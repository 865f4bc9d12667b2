"""A prompt scored for its logprobs is charged by what scoring costs: in the step's token
limits (a scored chunk takes ``cost`` times its tokens of the step) and in fairness (its
tenant's counter rises by as much), so a flood of scored prompts is cut and served as a flood
of plain prompts that take as long would be."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from worker.core.block_manager import BlockManager
from worker.core.config import FairnessConfig
from worker.core.prompt_scoring import scoring_cost, tokens_within, work_tokens
from worker.core.scheduler import Scheduler
from worker.core.sequence import Sequence
from worker.model.llama import projection_shapes
from worker.sampling.sampling_params import SamplingParams

COST = 2.5


def make_seq(name: str, prompt_len: int, *, tenant: str, scored: bool, order: int) -> Sequence:
    params = SamplingParams(max_tokens=1, prompt_logprobs=20 if scored else None)
    tokens = list(range(3, 3 + prompt_len))
    return Sequence(name, tokens, params, order, tenant=tenant)


def make_scheduler(max_tokens: int = 40) -> Scheduler:
    return Scheduler(
        block_manager=BlockManager(num_blocks=256, block_size=4),
        max_num_seqs=16,
        max_num_batched_tokens=max_tokens,
        fairness=FairnessConfig(lone_prompt_step_tokens=None),
        scored_token_cost=COST,
    )


def test_smollm2s_scoring_costs_its_vocabulary_projection_over_its_layers():
    """SmolLM2-135M: 576 x 49,152 multiply-adds to score a position beside 30 layers of
    3,538,944 (qkv 960 x 576, o 576 x 576, gate_up 3,072 x 576, down 576 x 1,536)."""
    config = SimpleNamespace(
        hidden_size=576, intermediate_size=1536, num_heads=9, num_kv_heads=3, head_dim=64
    )
    layer = sum(out * inp for out, inp in projection_shapes(config))
    assert layer == 3_538_944
    cost = scoring_cost(hidden_size=576, vocab_size=49152, layer_macs=layer, num_layers=30)
    assert cost == pytest.approx(1 + 576 * 49152 / (30 * 3_538_944)) and 1.26 < cost < 1.27


def test_only_prompt_positions_of_a_scoring_request_cost_more():
    scored = make_seq("s", 10, tenant="a", scored=True, order=0)
    plain = make_seq("p", 10, tenant="a", scored=False, order=1)
    assert work_tokens(plain, 0, 10, COST) == 10
    assert work_tokens(scored, 0, 10, COST) == 25
    assert work_tokens(scored, 8, 2, COST) == 5
    assert work_tokens(scored, 10, 1, COST) == 1  # its decode: nothing to score
    assert tokens_within(scored, 0, 20, COST) == 8 and tokens_within(plain, 0, 20, COST) == 20
    assert tokens_within(scored, 0, 1, COST) == 1  # always a token


def test_a_scored_prompt_fills_the_steps_limit_at_its_cost():
    sched = make_scheduler(max_tokens=40)
    sched.add(make_seq("scored", 100, tenant="a", scored=True, order=0))
    out = sched.schedule()
    assert [(s.seq.request_id, s.num_tokens) for s in out.scheduled] == [("scored", 16)]
    assert out.num_tokens == 40  # 16 positions, each at 2.5 tokens of work


def test_a_scoring_tenant_is_charged_its_cost_and_served_less_for_it():
    """Two tenants flood with prompts of one length, one scored: the scoring tenant's counter
    rises 2.5 times as fast per token, so over many steps it computes 1 / 2.5 the tokens."""
    sched = make_scheduler(max_tokens=20)
    for i in range(8):
        sched.add(make_seq(f"a{i}", 200, tenant="a", scored=True, order=2 * i))
        sched.add(make_seq(f"b{i}", 200, tenant="b", scored=False, order=2 * i + 1))
    computed = {"a": 0, "b": 0}
    for _ in range(60):
        out = sched.schedule()
        for s in out.scheduled:
            computed[s.seq.tenant] += s.num_tokens
            s.seq.num_computed_tokens += s.num_tokens
        assert out.num_tokens <= 20
    counters = {t: sched.ledger.counter(t) for t in computed}
    assert counters["a"] == pytest.approx(counters["b"], rel=0.1)
    assert computed["b"] / computed["a"] == pytest.approx(COST, rel=0.15)
    assert math.isclose(sched.ledger.accounts["a"].prefill_tokens, counters["a"], rel_tol=1e-9)


def test_warm_up_prices_scoring_on_this_machine_never_below_the_shapes(target):
    """The warm-up times scored and plain steps of one size in turns; the scheduler and the
    ledger take the larger of that ratio and the shapes' estimate."""
    from worker import LLMEngine, engine_config
    from worker.engine.warmup import measure_scoring_cost, measure_step_times

    engine = LLMEngine(target, engine_config(dtype="float32"))
    shapes = engine.scheduler.scored_token_cost
    execute, blocks = engine.runner.execute, engine.block_manager
    vocab = engine.config.vocab_size
    measured = measure_scoring_cost(execute, blocks, tokens=64, vocab_size=vocab)
    assert measured is not None and measured > 1.0  # the scored step does more
    plain = measure_step_times(execute, blocks, row_limit=64, max_model_len=512, vocab_size=vocab)
    engine._measure_scoring_cost(plain)  # what the warm-up does after its sweep
    cost = engine.scheduler.scored_token_cost
    assert 1.0 < shapes <= cost == engine.scheduler.ledger.scored_token_cost
    # A prompt the pool cannot hold is not measured; the measurement's blocks went back.
    too_long = blocks.num_blocks * blocks.block_size
    assert measure_scoring_cost(execute, blocks, tokens=too_long, vocab_size=vocab) is None
    assert blocks.num_free_blocks == blocks.num_blocks
