"""Prefix caching, n > 1 forks and swap preemption in the engine (tiny model, fp32).

The oracle is always the engine without the feature: caching off, separate requests,
a pool large enough that nothing is preempted. Every scenario ends with no block held.
"""

from __future__ import annotations

import math

import pytest

from factories import (
    assert_no_block_leaks,
    drain,
    make_checkpoint,
    make_peft_adapter,
    random_prompts,
)
from worker import LLM, SamplingParams
from worker.core.config import engine_config
from worker.engine.llm_engine import LLMEngine

MAX_NEW = 12


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("prefix"), seed=21, max_position_embeddings=1100)


@pytest.fixture(scope="module")
def adapters(checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: make_peft_adapter(
            checkpoint, root / name, rank=4, targets=["k_proj", "v_proj"], seed=i
        )
        for i, name in enumerate(["one", "two"])
    }


def greedy(max_tokens: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def run(engine: LLMEngine, requests: dict, **kwargs) -> dict:
    """Queue ``{request_id: (prompt, params)}`` at once, run to the end; final outputs by id."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params, **kwargs)
    return drain(engine)


def conversation(engine: LLMEngine, sessions: list[list[int]], turns: int, **kwargs):
    """Multi-turn chats: each turn resends the history, its answer, and a new message.

    Returns every turn's outputs, by turn then session."""
    history = [list(s) for s in sessions]
    news = random_prompts(turns * len(sessions), min_len=3, max_len=9, seed=5)
    transcript = []
    for turn in range(turns):
        outs = run(
            engine, {f"t{turn}-s{i}": (h, greedy()) for i, h in enumerate(history)}, **kwargs
        )
        answers = [outs[f"t{turn}-s{i}"] for i in range(len(history))]
        transcript.append(answers)
        for i, answer in enumerate(answers):
            history[i] = history[i] + answer.token_ids + news[turn * len(history) + i]
    return transcript


SYSTEM = random_prompts(1, min_len=37, max_len=37, seed=3)[0]
ENGINE_VARIANTS = {
    "default": {},
    "block-size-4-chunked": {"block_size": 4, "max_num_batched_tokens": 13},
    "small-pool": {"block_size": 4, "num_kv_blocks": 40},
}


@pytest.mark.parametrize("variant", sorted(ENGINE_VARIANTS))
def test_caching_on_and_off_give_the_same_tokens_and_later_turns_hit(checkpoint, variant):
    sessions = [SYSTEM + p for p in random_prompts(4, min_len=1, max_len=12, seed=8)]
    results = {}
    for caching in (False, True):
        llm = LLM(
            checkpoint, dtype="float32", enable_prefix_caching=caching, **ENGINE_VARIANTS[variant]
        )
        results[caching] = conversation(llm.engine, sessions, turns=3)
        assert_no_block_leaks(llm.engine)
        stats = llm.engine.prefix_cache_stats
        if caching:
            assert 0 < stats.hits <= stats.queries and stats.hit_rate > 0.3
        else:
            assert stats.queries == stats.hits == stats.cached_blocks == 0
    for off, on in zip(results[False], results[True], strict=True):
        assert [o.token_ids for o in off] == [o.token_ids for o in on]
    if variant == "small-pool":
        return  # preemptions and evictions: what stays cached depends on the timing
    bs = ENGINE_VARIANTS[variant].get("block_size", 16)
    for previous, turn in zip(results[True], results[True][1:], strict=False):
        for before, out in zip(previous, turn, strict=True):
            # The whole previous turn is reused, its answer too (but for the answer's last
            # token, never fed back): every full block of it.
            computed = len(before.prompt_token_ids) + len(before.token_ids) - 1
            assert out.num_cached_tokens == computed // bs * bs
    assert all(o.num_cached_tokens == 0 for turn in results[False] for o in turn)


def test_another_adapter_changed_weights_or_another_tenant_never_hit(checkpoint, adapters):
    engine = LLMEngine(checkpoint, engine_config(dtype="float32", max_loras=2))
    engine.load_adapter("sql", adapters["one"])
    prompt = [*SYSTEM, 5, 6, 7]

    def cached(request_id: str, **kwargs) -> int:
        return run(engine, {request_id: (prompt, greedy())}, **kwargs)[request_id].num_cached_tokens

    assert cached("first", adapter="sql", tenant="acme") == 0
    assert cached("same", adapter="sql", tenant="acme") == 32  # two full blocks of 16
    assert cached("base", tenant="acme") == 0
    assert cached("other-tenant", adapter="sql", tenant="globex") == 0
    engine.unload_adapter("sql")
    engine.load_adapter("sql", adapters["two"])  # same name, new weights
    changed = run(engine, {"changed": (prompt, greedy())}, adapter="sql", tenant="acme")["changed"]
    assert changed.num_cached_tokens == 0
    fresh = LLMEngine(
        checkpoint, engine_config(dtype="float32", max_loras=2, enable_prefix_caching=False)
    )
    fresh.load_adapter("sql", adapters["two"])
    expected = run(fresh, {"x": (prompt, greedy())}, adapter="sql", tenant="acme")["x"]
    assert changed.token_ids == expected.token_ids
    assert_no_block_leaks(engine)


def test_tenants_share_base_model_prefixes_only_when_allowed(checkpoint):
    prompt = [*SYSTEM, 9, 9]
    for share, expected in ((False, 0), (True, 32)):
        engine = LLMEngine(
            checkpoint, engine_config(dtype="float32", share_base_model_prefixes=share)
        )
        run(engine, {"a": (prompt, greedy())}, tenant="acme")
        assert run(engine, {"b": (prompt, greedy())}, tenant="globex")["b"].num_cached_tokens == (
            expected
        )


SAMPLED = {
    "sampled": {"temperature": 0.9, "top_p": 0.95},
    "penalized": {"temperature": 0.7, "top_k": 20, "frequency_penalty": 0.5},
    "greedy": {"temperature": 0.0},
}


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("kind", sorted(SAMPLED))
def test_n_samples_fork_after_the_prompt_and_match_separate_seeded_requests(
    checkpoint, kind, caching
):
    prompt = random_prompts(1, min_len=21, max_len=21, seed=13)[0]  # 21 = 16 + a partial block
    params = [
        SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, seed=100 + i, **SAMPLED[kind])
        for i in range(4)
    ]
    oracle = LLMEngine(checkpoint, engine_config(dtype="float32", enable_prefix_caching=False))
    expected = run(oracle, {f"r{i}": (prompt, p) for i, p in enumerate(params)})
    engine = LLMEngine(checkpoint, engine_config(dtype="float32", enable_prefix_caching=caching))
    engine.add_samples([f"r{i}" for i in range(4)], prompt, params)
    outs = drain(engine)
    assert [outs[f"r{i}"].token_ids for i in range(4)] == [
        expected[f"r{i}"].token_ids for i in range(4)
    ]
    if kind != "greedy":
        assert len({tuple(o.token_ids) for o in outs.values()}) > 1  # the samples differ
    assert_no_block_leaks(engine)


def test_aborting_the_sample_that_computes_the_prompt_hands_over_to_a_sibling(checkpoint):
    engine = LLMEngine(checkpoint, engine_config(dtype="float32"))
    prompt = random_prompts(1, min_len=30, max_len=30, seed=2)[0]
    engine.add_samples(["a", "b", "c"], prompt, [greedy()] * 3)
    engine.abort("a")
    engine.abort("c")
    outs = drain(engine)
    assert set(outs) == {"b"} and len(outs["b"].token_ids) == MAX_NEW
    assert_no_block_leaks(engine)


def test_n8_samples_of_a_long_prompt_share_its_blocks(checkpoint):
    """Memory: ≤ 1.2x the prompt's blocks plus the samples' own generated tokens."""
    prompt = random_prompts(1, min_len=1000, max_len=1000, seed=4)[0]
    max_tokens = 24
    engine = LLMEngine(checkpoint, engine_config(dtype="float32", num_kv_blocks=200))
    pool = engine.block_manager
    params = [SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=i) for i in range(8)]
    engine.add_samples([f"s{i}" for i in range(8)], prompt, params)
    peak = 0
    while engine.has_unfinished_requests:
        engine.step()
        peak = max(peak, pool.num_blocks - pool.num_free_blocks)
    prompt_blocks = math.ceil(1000 / 16)
    own = 8 * math.ceil(max_tokens / 16)
    assert peak <= 1.2 * prompt_blocks + own, (peak, prompt_blocks, own)
    assert peak < 2 * prompt_blocks  # separate requests would hold 8x
    assert_no_block_leaks(engine)


PRESSURE = {"block_size": 4, "num_kv_blocks": 30, "max_num_batched_tokens": 64}


@pytest.mark.parametrize("caching", [True, False])
def test_swap_recompute_and_no_preemption_give_the_same_tokens(checkpoint, caching):
    prompts = random_prompts(6, min_len=8, max_len=40, seed=1)
    greedy_reqs = {f"g{i}": (p, greedy(20)) for i, p in enumerate(prompts)}
    results = {}
    for mode in ("none", "recompute", "swap"):
        kwargs = {} if mode == "none" else {**PRESSURE, "preemption_mode": mode}
        engine = LLMEngine(
            checkpoint, engine_config(dtype="float32", enable_prefix_caching=caching, **kwargs)
        )
        outs = run(engine, greedy_reqs)
        # n = 3 seeded samples under pressure too: forks, copy-on-write and swaps together.
        sampled = [SamplingParams(max_tokens=20, ignore_eos=True, seed=7 + i) for i in range(3)]
        engine.add_samples(["n0", "n1", "n2"], prompts[0] + prompts[1], sampled)
        engine.add_request("late", prompts[2], greedy(20))
        outs.update(drain(engine))
        results[mode] = {k: o.token_ids for k, o in outs.items()}
        if mode != "none":
            assert engine.scheduler.num_preemptions > 0
        if mode == "swap":
            assert engine.scheduler.num_swap_outs > 0
        assert_no_block_leaks(engine)
    assert results["recompute"] == results["none"]
    assert results["swap"] == results["none"]
