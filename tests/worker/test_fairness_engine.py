"""Fair scheduling in the engine with everything else in play: adapters in few slots,
prefix-cache hits, speculative decoding and swap preemption. The order changes; the tokens
must not: every request's greedy output equals the one it gets alone on a plain engine."""

from __future__ import annotations

import pytest

from factories import assert_no_block_leaks, drain, make_peft_adapter, random_prompts
from worker import SamplingParams
from worker.core.config import FairnessConfig, engine_config
from worker.engine.llm_engine import LLMEngine
from worker.errors import InvalidRequestError


@pytest.fixture(scope="module")
def adapters(target, tmp_path_factory):
    root = tmp_path_factory.mktemp("fair-adapters")
    return {
        name: make_peft_adapter(target, root / name, rank=4, targets=["q_proj", "v_proj"], seed=i)
        for i, name in enumerate(["x", "y"])
    }


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def workload() -> list[tuple[str, list[int], str | None, int]]:
    """(tenant, prompt, adapter, max_tokens): a heavy tenant with long prompts, two light
    ones on adapters, and repeated prompts that hit the prefix cache."""
    long = random_prompts(6, min_len=40, max_len=60, seed=5)
    short = random_prompts(6, min_len=3, max_len=12, seed=6)
    jobs = [("heavy", p, None, 24) for p in long]
    jobs += [("light", p, "x" if i % 2 else None, 8) for i, p in enumerate(short)]
    jobs += [("other", p, "y", 8) for p in short[:3]]
    jobs += [("heavy", p, None, 6) for p in long[:2]]  # the same prompts again: cache hits
    return jobs


def run(engine: LLMEngine, jobs, adapters) -> dict[str, list[int]]:
    for name, path in adapters.items():
        engine.load_adapter(name, path)
    for i, (tenant, prompt, adapter, max_tokens) in enumerate(jobs):
        engine.add_request(
            f"r{i}",
            prompt,
            greedy(max_tokens),
            adapter=adapter,
            tenant=tenant,
            tenant_weight=2.0 if tenant == "light" else 1.0,
        )
    return {rid: out.token_ids for rid, out in drain(engine).items()}


@pytest.mark.parametrize(
    "variant",
    [
        {},
        # Speculating whatever it costs: this test is about exactness.
        {
            "speculative_model": "ngram",
            "num_speculative_tokens": 3,
            "speculative_position_cost": 0.0,
            "speculative_draft_cost": 0.0,
        },
        {"preemption_mode": "swap", "num_kv_blocks": 40, "num_host_blocks": 24},
    ],
    ids=["plain", "speculative", "swap"],
)
def test_fair_engine_outputs_match_the_plain_engine_with_adapters_cache_and_preemption(
    target, adapters, variant
):
    jobs = workload()
    kwargs = {"dtype": "float32", "block_size": 4, "max_loras": 1, "max_num_batched_tokens": 32}
    expected = run(
        LLMEngine(target, engine_config(fairness=FairnessConfig(policy="fcfs"), **kwargs)),
        jobs,
        adapters,
    )
    engine = LLMEngine(target, engine_config(fairness=FairnessConfig(), **kwargs, **variant))
    assert run(engine, jobs, adapters) == expected
    accounts = engine.scheduler.ledger.accounts
    assert set(accounts) == {"heavy", "light", "other"}
    assert all(a.num_seqs == 0 for a in accounts.values())
    assert accounts["light"].weight == 2.0
    # Every generated token but each request's last was fed back and charged as a decode
    # (plus verified drafts when speculating); prefix hits made heavy's repeats cheaper.
    fed = {t: 0 for t in accounts}
    for tenant, _prompt, _adapter, max_tokens in jobs:
        fed[tenant] += max_tokens - 1
    for tenant, account in accounts.items():
        assert account.decode_tokens >= fed[tenant]
    heavy_prompts = sum(len(p) for t, p, _, _ in jobs if t == "heavy")
    if "preemption_mode" not in variant:
        assert accounts["heavy"].prefill_tokens < heavy_prompts
    if variant.get("preemption_mode") == "swap":
        assert engine.scheduler.num_swap_outs > 0
    if variant.get("speculative_model"):
        assert engine.spec_decode_stats.num_verifications > 0
    assert_no_block_leaks(engine)


def test_a_tenant_weight_outside_its_bounds_is_refused(target):
    engine = LLMEngine(target, engine_config(dtype="float32"))
    for weight in (0.0, 1e-4, -1.0, float("nan"), float("inf"), 1e9):
        with pytest.raises(InvalidRequestError, match="tenant_weight"):
            engine.add_request("r", [1, 2, 3], greedy(2), tenant="t", tenant_weight=weight)
    assert not engine.has_unfinished_requests


def test_the_gateway_bounds_weights_as_the_engine_does():
    """A weight the gateway accepts is one the engine accepts, also after the float32 of the
    gRPC field (a tiny weight would round to 0, which the worker reads as unset)."""
    import numpy as np

    from gateway.tenancy.weights import MAX_WEIGHT, MIN_WEIGHT
    from worker.core.fairness import MAX_TENANT_WEIGHT, MIN_TENANT_WEIGHT

    assert (MIN_WEIGHT, MAX_WEIGHT) == (MIN_TENANT_WEIGHT, MAX_TENANT_WEIGHT)
    assert float(np.float32(MIN_WEIGHT)) >= MIN_TENANT_WEIGHT and np.float32(MAX_WEIGHT) == 1000
