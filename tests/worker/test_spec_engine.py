"""Speculative decoding in the engine (tiny models, fp32) against plain decoding.

The oracle is always the engine without speculation (itself checked against transformers):
greedy tokens must be identical whatever the proposer proposes; sampled tokens must follow
the exact target distribution, computed here from transformers. Every scenario ends with
no KV block held, in the target's pool or the draft's.
"""

from __future__ import annotations

import itertools
import json
import shutil

import pytest
import torch

from factories import (
    TINY_VOCAB,
    assert_no_block_leaks,
    drain,
    load_hf_model,
    make_checkpoint,
    make_peft_adapter,
    random_prompts,
)
from spec_checks import assert_follows_law, assert_same_tokens_and_logprobs, exact_joint
from switchboard_kernels.linear_native import native_linear
from worker import LLM, SamplingParams
from worker.core.config import engine_config
from worker.engine.llm_engine import LLMEngine
from worker.errors import SpeculativeConfigError
from worker.spec_decode.ngram import lookup

MAX_NEW = 24


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory):
    """Same vocabulary, other weights: disagrees with the target most of the time."""
    return make_checkpoint(tmp_path_factory.mktemp("draft"), seed=99, num_layers=1)


def with_output_vocab(checkpoint, path, *, seed: int):
    """A copy of ``checkpoint`` whose output layer keeps a random half of the tokens (as
    `switchboard draft distill` writes it: the ids in draft_vocab.json)."""
    shutil.copytree(checkpoint, path, dirs_exist_ok=True)
    vocab = torch.randperm(TINY_VOCAB, generator=torch.Generator().manual_seed(seed))
    (path / "draft_vocab.json").write_text(json.dumps(vocab[: TINY_VOCAB // 2].tolist()))
    return path


@pytest.fixture(scope="module")
def half_vocab_target(target, tmp_path_factory):
    return with_output_vocab(target, tmp_path_factory.mktemp("half-vocab"), seed=3)


@pytest.fixture(scope="module")
def adapters(target, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: make_peft_adapter(
            target, root / name, rank=4, targets=["q_proj", "v_proj", "down_proj"], seed=i
        )
        for i, name in enumerate(["one", "two"])
    }


def greedy(max_tokens: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def copying_prompts(num: int, seed: int) -> list[list[int]]:
    """Prompts that repeat themselves, so prompt lookup finds matches."""
    return [p * 3 for p in random_prompts(num, min_len=3, max_len=10, seed=seed)]


def speculative(target, spec: str, k: int = 4, **kwargs) -> LLM:
    """An engine that speculates whenever it may: these tests are about exactness, so the
    cost model (which would not let a draft as big as the target run) is off, and the draft
    keeps its exact weights (a draft equal to the target is then always right)."""
    kwargs.setdefault("speculative_position_cost", 0.0)
    kwargs.setdefault("speculative_draft_cost", 0.0)
    kwargs.setdefault("speculative_draft_quantization", "none")
    return LLM(target, dtype="float32", speculative_model=spec, num_speculative_tokens=k, **kwargs)


def proposer_path(name: str, target, other_draft, half_vocab_target=None) -> str:
    return {
        "ngram": "ngram",
        "draft-disagrees": str(other_draft),
        "draft-is-target": str(target),
        "draft-is-target-on-half-the-vocabulary": str(half_vocab_target),
    }[name]


PROPOSERS = [
    "ngram",
    "draft-disagrees",
    "draft-is-target",
    "draft-is-target-on-half-the-vocabulary",
]
VARIANTS = {
    "default": {},
    "block-size-4-chunked": {"block_size": 4, "max_num_batched_tokens": 19},
    "preemption": {"block_size": 4, "num_kv_blocks": 40},
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("proposer", PROPOSERS)
def test_greedy_tokens_are_identical_with_and_without_speculation(
    target, other_draft, half_vocab_target, proposer, variant
):
    prompts = copying_prompts(3, seed=1) + random_prompts(3, min_len=1, max_len=30, seed=2)
    expected = LLM(target, dtype="float32").generate(prompts, greedy())
    path = proposer_path(proposer, target, other_draft, half_vocab_target)
    llm = speculative(target, path, **VARIANTS[variant])
    outputs = llm.generate(prompts, greedy())
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
    stats = llm.engine.spec_decode_stats
    assert stats.num_verifications > 0 and stats.num_proposed > 0
    if proposer == "draft-is-target":
        assert stats.acceptance_rate == 1.0
        assert stats.mean_accepted_length > 3
    if proposer == "draft-disagrees":
        assert stats.acceptance_rate < 0.5
    if proposer == "draft-is-target-on-half-the-vocabulary":
        assert 0.0 < stats.acceptance_rate < 1.0  # right only where the target's token is kept
    if variant == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0
    assert_no_block_leaks(llm.engine)


@pytest.mark.parametrize("proposer", ["ngram", "draft-is-target"])
def test_greedy_with_adapters_mixed_in_one_batch(target, other_draft, adapters, proposer):
    prompts = copying_prompts(6, seed=4)
    names = ["one", None, "two", "one", "two", None]
    plain = LLM(target, dtype="float32", max_loras=2)
    llm = speculative(target, proposer_path(proposer, target, other_draft), max_loras=2)
    for engine in (plain, llm):
        for name, path in adapters.items():
            engine.load_adapter(name, path)
    expected = plain.generate(prompts, greedy(), adapters=names)
    outputs = llm.generate(prompts, greedy(), adapters=names)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
    # The adapters change the outputs (else this test would not test them).
    base = plain.generate(prompts, greedy())
    assert [o.token_ids for o in base] != [o.token_ids for o in expected]
    stats = llm.engine.spec_decode_stats
    assert stats.num_accepted > 0
    if proposer == "draft-is-target":  # the draft runs the base model only
        assert stats.acceptance_rate < 1.0
    assert_no_block_leaks(llm.engine)


@pytest.mark.parametrize("variant", [*sorted(VARIANTS), "torch-attention"])
def test_alternatives_add_tokens_and_keep_greedy_tokens_and_logprobs(target, close_draft, variant):
    """A draft close to the target misses some of its tokens by a near tie, and its
    runner-up there is then often the target's token. Verified beside the chain (its own
    row: the position of the draft it stands in for, the cache up to it, itself), such an
    alternative adds the target's token after it to the step, from the K/V it moves into
    place; every token and logprob stays plain decoding's. The native decode kernel
    attends each alternative as a one-query sequence; the torch path (GPU, or no kernel)
    attends the tree as a chunk with a mask."""
    prompts = random_prompts(6, min_len=1, max_len=30, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=2, ignore_eos=True)
    expected = LLM(target, dtype="float32").generate(prompts, params)
    llm = speculative(target, str(close_draft), **VARIANTS.get(variant, {}))
    if variant == "torch-attention":
        llm.engine.runner.native_decodes = False
    outputs = llm.generate(prompts, params)
    assert_same_tokens_and_logprobs(outputs, expected)
    stats = llm.engine.spec_decode_stats
    assert stats.num_alternatives_accepted > 0
    assert stats.num_emitted == (
        stats.num_verifications + stats.num_accepted + stats.num_alternatives_accepted
    )
    assert_no_block_leaks(llm.engine)
    chain_only = speculative(target, str(close_draft), speculative_alternatives=0)
    assert [o.token_ids for o in chain_only.generate(prompts, params)] == [
        o.token_ids for o in expected
    ]
    assert chain_only.engine.spec_decode_stats.num_alternatives == 0


def test_verification_shares_steps_with_other_requests_prefills(target):
    """Requests arrive while others speculate; verify rows ride in the same forward pass."""
    prompts = copying_prompts(5, seed=6)
    expected = LLM(target, dtype="float32").generate(prompts, greedy())
    llm = speculative(target, str(target))
    engine = llm.engine
    mixed_steps = 0
    schedule = engine.scheduler.schedule

    def spy():
        nonlocal mixed_steps
        out = schedule()
        kinds = {
            "verify" if s.num_spec else "prefill"
            for s in out.scheduled
            if s.num_spec or s.start == 0
        }
        mixed_steps += kinds == {"verify", "prefill"}
        return out

    engine.scheduler.schedule = spy
    done = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, greedy())
        for _ in range(3):
            done.update({o.request_id: o for o in engine.step() if o.finished})
    done.update(drain(engine))
    assert [done[f"r{i}"].token_ids for i in range(len(prompts))] == [o.token_ids for o in expected]
    assert mixed_steps > 0
    assert_no_block_leaks(engine)


def test_multi_turn_chats_with_prefix_caching_match_and_hit(target):
    """Rejected drafts' slots never reach the prefix cache: later turns reuse cached blocks
    and still produce the plain engine's tokens."""
    sessions = copying_prompts(3, seed=8)
    news = random_prompts(6, min_len=2, max_len=6, seed=9)
    transcripts = {}
    for spec in (None, str(target), "ngram"):
        kwargs = {"speculative_model": spec} if spec else {}
        llm = LLM(target, dtype="float32", block_size=4, **kwargs)
        history = [list(s) for s in sessions]
        transcript = []
        for turn in range(2):
            outs = llm.generate(history, greedy(12))
            transcript.append([o.token_ids for o in outs])
            for i, out in enumerate(outs):
                history[i] = history[i] + out.token_ids + news[turn * 3 + i]
        transcripts[spec] = transcript
        assert llm.engine.prefix_cache_stats.hits > 0
        if spec is not None:
            assert_no_block_leaks(llm.engine)
    assert len({str(t) for t in transcripts.values()}) == 1


@pytest.mark.parametrize("proposer", ["ngram", "draft-is-target"])
def test_n_samples_speculate_independently(target, other_draft, proposer):
    prompt = copying_prompts(1, seed=10)[0]
    expected = LLM(target, dtype="float32").generate(prompt, greedy())[0].token_ids
    llm = speculative(target, proposer_path(proposer, target, other_draft), block_size=4)
    engine = llm.engine
    engine.add_samples(["a", "b", "c"], prompt, [greedy()] * 3)
    engine.add_samples(
        ["x", "y"],
        prompt,
        [SamplingParams(max_tokens=MAX_NEW, seed=s, top_k=5, ignore_eos=True) for s in (1, 2)],
    )
    outs = drain(engine)
    assert [outs[i].token_ids for i in "abc"] == [expected] * 3
    assert all(len(outs[i].token_ids) == MAX_NEW for i in "xy")
    assert engine.spec_decode_stats.num_verifications > 0
    assert_no_block_leaks(engine)


def test_logprobs_stop_tokens_and_max_tokens_under_speculation(target):
    prompts = copying_prompts(3, seed=11)
    plain = LLM(target, dtype="float32").generate(prompts, greedy())
    stop_at = plain[0].token_ids[7]
    params = SamplingParams(
        temperature=0.0, max_tokens=13, logprobs=2, stop_token_ids=[stop_at], ignore_eos=True
    )
    expected = LLM(target, dtype="float32").generate(prompts, params)
    outputs = speculative(target, str(target)).generate(prompts, params)
    for out, exp in zip(outputs, expected, strict=True):
        assert out.token_ids == exp.token_ids and out.finish_reason == exp.finish_reason
        for got, want in zip(out.logprobs, exp.logprobs, strict=True):
            assert got.token_id == want.token_id
            assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
            assert [t for t, _ in got.top_logprobs] == [t for t, _ in want.top_logprobs]


@pytest.mark.parametrize("vocabulary", ["whole", "half"])
def test_sampled_sequences_follow_the_target_distribution(
    target, close_draft, vocabulary, tmp_path
):
    """Three sampled tokens (top-k 3, temperature, repetition penalty): the joint law of
    2,000 speculative samples passes a chi-square test against the exact target law. The draft
    is close to the target, so accepted drafts, corrections and alternatives (a correction
    that is one of the draft's runner-ups, followed by a token from its row) occur; with half the
    vocabulary it never proposes the other half, which only corrections then supply.
    (Prompt lookup's one-hot proposals are checked in tests/worker/test_rejection_sampler.py.)"""
    prompt = [7, 8, 9, 129, 38, 163, 119, 119, 119, 75, 18, 14]
    settings = {"temperature": 1.5, "top_k": 3, "repetition_penalty": 1.2}
    joint = exact_joint(target, prompt, **settings)
    draft = (
        close_draft if vocabulary == "whole" else with_output_vocab(close_draft, tmp_path, seed=4)
    )
    llm = speculative(
        target,
        str(draft),
        k=2,
        max_num_seqs=512,
        speculative_max_batch_size=10_000,
        speculative_min_acceptance=0.0,
    )
    num = 2_000
    params = [SamplingParams(max_tokens=3, seed=s, ignore_eos=True, **settings) for s in range(num)]
    outs = llm.generate([prompt] * num, params)
    counts: dict = {}
    for o in outs:
        counts[tuple(o.token_ids)] = counts.get(tuple(o.token_ids), 0) + 1
    assert_follows_law(counts, joint)
    stats = llm.engine.spec_decode_stats
    assert stats.num_proposed > 1_500 and 0.3 < stats.acceptance_rate < 0.9
    if vocabulary == "whole":
        # Where a draft was rejected, the token drawn in its place (from the residual, where
        # the target outweighs the draft: rarely one of the draft's own runner-ups) was now
        # and then one of its alternatives, whose row then gave the next token. (On half the
        # vocabulary the draft outweighs the target on all it proposes: never.)
        assert stats.num_alternatives_accepted > 5
    assert_no_block_leaks(llm.engine)


def test_backoff_skips_speculation_in_large_batches(target):
    prompts = copying_prompts(6, seed=12)
    llm = speculative(target, "ngram", speculative_max_batch_size=4)
    outputs = llm.generate(prompts, greedy())
    expected = LLM(target, dtype="float32").generate(prompts, greedy())
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
    stats = llm.engine.spec_decode_stats
    assert stats.num_backoff_steps > 0


def test_default_costs_keep_a_draft_as_costly_as_the_target_to_rare_probes(target, monkeypatch):
    """With the cost model on, a draft that reads as many weight bytes as the target never
    pays (each draft would cost a whole step): it only probes after each pause, while prompt
    lookup (free to propose) speculates on most steps of the same copying prompts. Plain
    steps through the torch path, as verifications are: where the one-call native step runs
    plain decodes (a Zen 3), a verified row costs more than the plain step it is measured
    against, and lookup backs off too (the cost model's work, not this test's subject)."""
    monkeypatch.setattr(
        "worker.model.llama.LlamaModel.native_decode_step", lambda self, kv_caches: None
    )
    prompts = copying_prompts(2, seed=5)
    expected = LLM(target, dtype="float32").generate(prompts, greedy(40))
    costly = LLM(
        target,
        dtype="float32",
        speculative_model=str(target),
        num_speculative_tokens=4,
        speculative_draft_quantization="none",  # int8 would read a quarter of the bytes
    )
    assert costly.engine.speculator.policy.draft_cost == pytest.approx(1.0)
    outputs = costly.generate(prompts, greedy(40))
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
    probes = costly.engine.spec_decode_stats
    assert 0 < probes.num_verifications <= 2 * (40 // 8 + 1)
    assert probes.num_proposed == probes.num_verifications  # one draft per probe
    lookup = LLM(target, dtype="float32", speculative_model="ngram", num_speculative_tokens=4)
    assert [o.token_ids for o in lookup.generate(prompts, greedy(40))] == [
        o.token_ids for o in expected
    ]
    assert lookup.engine.spec_decode_stats.num_proposed > 2 * probes.num_proposed


def test_the_draft_cost_is_its_weights_ratio_unless_given(target, other_draft):
    """A draft model's pass costs its weights over the target's (a small batch's step reads
    them all); a cost given by the user stays as given; prompt lookup's is 0."""
    as_big = LLM(
        target,
        dtype="float32",
        speculative_model=str(target),
        speculative_position_cost=0.0,
        speculative_draft_quantization="none",
    )
    assert as_big.engine.speculator.policy.draft_cost == pytest.approx(1.0)
    given = LLM(
        target, dtype="float32", speculative_model=str(other_draft), speculative_draft_cost=0.3
    )
    given.generate(copying_prompts(2, seed=7), greedy(30))
    assert given.engine.speculator.policy.draft_cost == 0.3
    lookup = LLM(target, dtype="float32", speculative_model="ngram")
    assert lookup.engine.speculator.policy.draft_cost == 0.0


def test_a_requests_own_k_caps_its_drafts(target):
    """k per request: at most the engine's k (a larger one is capped), 0 turns speculation
    off for that request alone, unset takes the engine's; outputs stay the plain ones."""
    prompts = copying_prompts(4, seed=12)
    asked = [None, 2, 0, 9]
    expected = LLM(target, dtype="float32").generate(prompts, greedy())
    llm = speculative(target, str(target), k=4)  # the target as draft: every draft accepted
    most: dict[str, int] = {}
    propose = llm.engine.speculator.proposer.propose

    def spying(seqs, ks, rows, plan=None):
        for seq, k in zip(seqs, ks, strict=True):
            most[seq.request_id] = max(k, most.get(seq.request_id, 0))
        return propose(seqs, ks, rows, plan)

    llm.engine.speculator.proposer.propose = spying
    params = [
        SamplingParams(
            temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, num_speculative_tokens=k
        )
        for k in asked
    ]
    outputs = llm.generate(prompts, params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
    by_k = {k: most.get(o.request_id, 0) for k, o in zip(asked, outputs, strict=True)}
    assert by_k == {None: 4, 2: 2, 0: 0, 9: 4}
    # An engine that does not speculate serves a request that asks for it as usual.
    plain = LLM(target, dtype="float32").generate(prompts[:1], params[1])
    assert plain[0].token_ids == expected[0].token_ids
    assert_no_block_leaks(llm.engine)


@pytest.mark.parametrize(("short", "taken_up"), [(8, True), (30, False)])
def test_a_draft_takes_up_only_sequences_it_can_catch_up_on_cheaply(target, short, taken_up):
    """Four short requests keep the batch above the speculation limit (2); when they finish,
    the two long ones have generated ``short`` tokens: the draft takes them up within its
    first TAKE_UP_WITHIN (16) tokens, and leaves them alone past that (catching up on their
    whole history would cost more than their last tokens return). Outputs are unchanged."""
    from worker.spec_decode.draft import TAKE_UP_WITHIN

    prompts = random_prompts(6, min_len=4, max_len=8, seed=13)
    params = [greedy(short)] * 4 + [greedy(short + 30)] * 2
    expected = LLM(target, dtype="float32").generate(prompts, params)
    llm = speculative(target, str(target), k=4, speculative_max_batch_size=2)
    first_draft_at: dict[str, int] = {}
    propose = llm.engine.speculator.proposer.propose

    def spying(seqs, ks, rows, plan=None):
        for seq in seqs:
            first_draft_at.setdefault(seq.request_id, len(seq.output_token_ids))
        return propose(seqs, ks, rows, plan)

    llm.engine.speculator.proposer.propose = spying
    outputs = llm.generate(prompts, params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
    long_ones = {o.request_id for o in outputs[4:]}
    assert set(first_draft_at) == (long_ones if taken_up else set())
    assert all(0 < n <= TAKE_UP_WITHIN for n in first_draft_at.values())
    assert_no_block_leaks(llm.engine)


def test_mismatched_vocabulary_and_invalid_k_are_refused(target, tmp_path):
    bigger = make_checkpoint(tmp_path / "bigger", vocab_size=320)
    with pytest.raises(SpeculativeConfigError, match="vocabulary of 320 tokens, the target 256"):
        LLMEngine(
            target,
            engine_config(dtype="float32", speculative_model=bigger, num_speculative_tokens=2),
        )
    for k in (0, -1, 17, 2.5, True):
        with pytest.raises(SpeculativeConfigError, match="num_speculative_tokens must be"):
            LLMEngine(
                target,
                engine_config(dtype="float32", speculative_model="ngram", num_speculative_tokens=k),
            )
    for bad in (-1, 9, 1.5):
        with pytest.raises(SpeculativeConfigError, match="speculative_alternatives must be"):
            LLMEngine(
                target,
                engine_config(
                    dtype="float32", speculative_model="ngram", speculative_alternatives=bad
                ),
            )
    with pytest.raises(SpeculativeConfigError, match="speculative_model is not"):
        LLMEngine(target, engine_config(dtype="float32", num_speculative_tokens=3))
    with pytest.raises(SpeculativeConfigError, match=r"no config\.json"):
        LLMEngine(target, engine_config(dtype="float32", speculative_model=tmp_path / "nowhere"))


@pytest.mark.parametrize(
    ("tokens", "k", "expected"),
    [
        ([1, 2, 3, 4, 1, 2, 3], 3, [4, 1, 2]),  # longest suffix [1, 2, 3] matched
        ([5, 1, 2, 9, 1, 2, 7, 1, 2], 2, [7, 1]),  # the latest earlier match wins
        ([1, 2, 3], 2, []),  # nothing repeats
        ([4, 4, 4], 5, [4]),  # overlapping match; only what follows is proposed
    ],
)
def test_prompt_lookup_proposes_what_followed_the_latest_longest_match(tokens, k, expected):
    assert lookup(tokens, k, max_n=3, min_n=1) == expected


def test_worker_flags_reach_the_engine(target):
    from switchboard.cli import build_parser
    from switchboard.worker_command import worker_engine_kwargs

    args = build_parser().parse_args(
        ["worker", "--speculative-model", "ngram", "--num-speculative-tokens", "3"]
    )
    kwargs = worker_engine_kwargs(args)
    engine = LLMEngine(target, engine_config(dtype="float32", **kwargs))
    assert engine.speculator is not None and engine.speculator.k == 3
    off = worker_engine_kwargs(build_parser().parse_args(["worker"]))
    assert LLMEngine(target, engine_config(dtype="float32", **off)).spec_decode_stats is None
    args = build_parser().parse_args(
        ["worker", "--speculative-model", str(target), "--speculative-alternatives", "5"]
    )
    engine = LLMEngine(target, engine_config(dtype="float32", **worker_engine_kwargs(args)))
    assert engine.speculator.proposer.num_alternatives == 5
    from worker.core.config import NUM_ALTERNATIVES

    assert build_parser().parse_args(["worker"]).speculative_alternatives == NUM_ALTERNATIVES


def test_backoff_pauses_a_failing_sequence_and_starts_newcomers_paused():
    from worker.core.sequence import Sequence
    from worker.spec_decode.backoff import BackoffPolicy

    policy = BackoffPolicy(max_batch_size=8, min_acceptance=0.2, pause_steps=4)
    first = Sequence("a", [1], SamplingParams(), 0)
    assert policy.num_drafts(first, 4, 1) > 0
    tries = 0
    while policy.num_drafts(first, 4, 1) and tries < 10:
        policy.update(first, 4, 0)  # every draft rejected
        tries += 1
    assert tries == 3  # 0.5 -> 0.35 -> 0.245 -> 0.17: paused
    assert [policy.num_drafts(first, 4, 1) for _ in range(3)] == [0] * 3
    assert policy.num_drafts(first, 4, 1) > 0  # the pause is over: a probe
    policy.update(first, 2, 0)  # the probe fails: the next pause is twice as long
    assert sum(not policy.num_drafts(first, 4, 1) for _ in range(8)) == 8
    for _ in range(40):
        policy.update(first, 4, 0)
    assert policy.acceptance < 0.2
    newcomer = Sequence("b", [1], SamplingParams(), 1)
    assert not policy.num_drafts(newcomer, 4, 1)  # drafts mostly fail: newcomers start paused


def test_drafts_per_step_follow_acceptance_and_batch_size():
    """n drafts where (1 + sum of acceptance^j) / (1 + n x cost) is highest (the cost: 2% of
    a step per position and decoding sequence, plus the proposer's own): long runs for a
    sequence that copies, one draft for one that rarely matches, none where the first draft
    is not worth it."""
    from worker.core.sequence import Sequence
    from worker.spec_decode.backoff import BackoffPolicy

    def settled(accepted: int, proposed: int, *, draft_cost: float = 0.0) -> tuple:
        policy = BackoffPolicy(max_batch_size=8, min_acceptance=0.0, draft_cost=draft_cost)
        seq = Sequence("a", [1], SamplingParams(), 0)
        for _ in range(30):
            policy.update(seq, proposed, accepted)
        return policy, seq

    policy, copying = settled(8, 8)  # every draft accepted: acceptance -> 1
    assert policy.num_drafts(copying, 16, 1) == 16
    assert policy.num_drafts(copying, 16, 8) == 16
    policy, half = settled(1, 4)  # one accepted, then one rejected: 0.5 per position
    # 1.9375 / 1.08 = 1.794 for 4 drafts beats 1.875 / 1.06 = 1.769 and 1.969 / 1.10 = 1.790
    assert policy.num_drafts(half, 16, 1) == 4
    assert policy.num_drafts(half, 16, 8) == 2  # 1.75 / 1.32 = 1.326 > 1.5 / 1.16, 1.875 / 1.48
    policy, half = settled(1, 4, draft_cost=0.3)
    assert policy.num_drafts(half, 16, 1) == 1  # 1.5 / 1.32 = 1.136 > 1.75 / 1.64 = 1.067
    policy, rare = settled(0, 4)
    rare_track = policy._tracks[rare]
    rare_track.pause, rare_track.acceptance = 0, 0.1
    assert policy.num_drafts(rare, 16, 1) == 1  # 1.1 / 1.02 > 1 > 1.11 / 1.04
    assert policy.num_drafts(rare, 16, 8) == 0  # 1.1 / 1.16 < 1: pauses instead


def test_the_draft_count_follows_a_cost_that_is_not_linear_in_the_rows():
    """Rows nearly free up to 4, then dear (as measured on a Zen 4 in bf16): a sequence of
    middling acceptance drafts 4, not the 8 that the cost of 4 drafts, spread evenly over
    every position, would allow."""
    from worker.spec_decode.backoff import best_draft_count
    from worker.spec_decode.step_cost import StepCostTable

    table = StepCostTable((1,), ((0, 4, 8, 16),), ((0.0175, 0.0180, 0.0210, 0.0285),))
    costs = [table.verify_cost(1, n) for n in range(17)]
    assert costs[4] == pytest.approx(0.5 / 17.5) and costs[16] == pytest.approx(11 / 17.5)
    assert best_draft_count(0.6, 16, costs) == 4
    averaged = costs[4] / 4  # the same curve read as a flat cost per position
    assert best_draft_count(0.6, 16, [n * averaged for n in range(17)]) == 8
    assert best_draft_count(0.98, 16, costs) == 16  # copying: every draft pays
    assert best_draft_count(0.05, 16, costs) == 1  # the first rows are nearly free


def test_alternatives_that_catch_the_targets_token_make_drafts_worth_more():
    """A draft accepted 20% of the time at 0.25 of a step does not pay (1.2 tokens for 1.25
    steps); if its alternatives catch the target's token another 20% of the time, it does
    (1.4 for 1.25). The policy learns that rate from verifications, and prices the rows the
    alternatives add."""
    from worker.core.sequence import Sequence
    from worker.spec_decode.backoff import BackoffPolicy, best_draft_count, flat_verify_cost

    costs = [0.25 * n for n in range(5)]
    assert best_draft_count(0.2, 4, costs) == 0
    assert best_draft_count(0.2, 4, costs, alternative_rate=0.2) == 1
    # tokens for n drafts: 1 + a + ... + a^n plus a^(j-1) x rate for each j <= n
    assert best_draft_count(0.5, 4, [0.0, 0.3, 0.5, 0.9, 1.3], alternative_rate=0.3) == 2

    policy = BackoffPolicy(
        max_batch_size=8, min_acceptance=0.0, draft_cost=0.25, verify_cost=flat_verify_cost(0.0)
    )
    seq = Sequence("a", [1], SamplingParams(), 0)
    for _ in range(20):  # 1 draft, 2 alternatives: rejected, an alternative hits every other
        policy.num_drafts(seq, 4, 1)
        policy.update(seq, 1, 0, alternatives=2, alternative_hit=True)
        policy.update(seq, 1, 0, alternatives=2, alternative_hit=False)
    assert policy.alternative_rate == pytest.approx(0.5, abs=0.1)
    assert policy.rows_per_draft == pytest.approx(3.0, abs=0.05)
    priced = BackoffPolicy(max_batch_size=8, min_acceptance=0.0, verify_cost=flat_verify_cost(0.1))
    priced.rows_per_draft = 3.0
    assert priced._draft_costs(1, 2) == pytest.approx([0.0, 0.3, 0.6])


def test_failed_probes_double_the_pause_under_the_cost_model():
    """A draft not worth its cost (acceptance 0.5 against a cost of 0.52) pauses, probes
    with one draft, and pauses twice as long after each probe that fails."""
    from worker.core.sequence import Sequence
    from worker.spec_decode.backoff import BackoffPolicy

    policy = BackoffPolicy(max_batch_size=8, min_acceptance=0.0, pause_steps=4, draft_cost=0.5)
    seq = Sequence("a", [1], SamplingParams(), 0)
    gaps = []
    for _ in range(4):
        steps = 0
        while not (drafts := policy.num_drafts(seq, 4, 1)):
            steps += 1
        assert drafts == 1  # a probe
        gaps.append(steps)
        policy.update(seq, 1, 0)
    assert gaps == [5, 9, 17, 33]
    policy.update(seq, 1, 1)  # a probe that lands: the next pause starts short again
    steps = 0
    while not policy.num_drafts(seq, 4, 1):
        steps += 1
    assert steps <= 5


def test_a_draft_models_cost_is_its_weights_over_the_targets(target, other_draft):
    """The draft cost the policy starts from: what one decode step of each reads, i.e. all
    weights with the tied embedding counted once as the output layer (transformers' own
    parameter count is the reference); int8 weights read a byte each (and a 4-byte scale per
    output feature) where fp32 ones read four."""
    from transformers import AutoModelForCausalLM

    llm = LLM(
        target,
        dtype="float32",
        speculative_model=str(other_draft),
        speculative_draft_quantization="none",
    )
    ratio = (
        AutoModelForCausalLM.from_pretrained(other_draft).num_parameters()
        / AutoModelForCausalLM.from_pretrained(target).num_parameters()
    )
    assert 0 < ratio < 1
    assert llm.engine.speculator.policy.draft_cost == pytest.approx(ratio)
    if native_linear() is not None:
        int8 = LLM(
            target,
            dtype="float32",
            speculative_model=str(other_draft),
            speculative_draft_quantization="int8",
        )
        # between a quarter of the fp32 ratio and a quarter plus the scales and norms
        assert ratio / 4 < int8.engine.speculator.policy.draft_cost < ratio / 3


def test_a_cut_down_output_layer_gives_the_full_layers_logits_where_it_keeps_tokens(
    target, half_vocab_target
):
    """Logits of a draft with draft_vocab.json: transformers' own at the kept tokens, -inf
    at the rest; its cost counts the kept rows of the output layer only."""
    from transformers import AutoModelForCausalLM

    from worker.spec_decode.draft import read_output_vocab

    kept = read_output_vocab(half_vocab_target)
    llm = LLM(
        target,
        dtype="float32",
        speculative_model=str(half_vocab_target),
        speculative_draft_quantization="none",
    )
    draft = llm.engine.speculator.proposer.model
    hidden_size = draft.config.hidden_size
    hidden = torch.randn(3, hidden_size, generator=torch.Generator().manual_seed(6))
    hf = load_hf_model(target)  # the reference: its own final norm and (tied) output layer
    with torch.no_grad():
        expected = hf.lm_head(hf.model.norm(hidden))
        ours = draft.compute_logits(hidden)
    dropped = torch.ones(TINY_VOCAB, dtype=torch.bool)
    dropped[kept] = False
    assert ours.shape == (3, TINY_VOCAB) and torch.isneginf(ours[:, dropped]).all()
    torch.testing.assert_close(ours[:, kept], expected[:, kept], atol=1e-4, rtol=1e-4)
    params = AutoModelForCausalLM.from_pretrained(target).num_parameters()
    cut = params - (TINY_VOCAB - len(kept)) * hidden_size
    assert llm.engine.speculator.policy.draft_cost == pytest.approx(cut / params)


def test_a_malformed_output_vocabulary_is_refused(target, tmp_path):
    draft = with_output_vocab(target, tmp_path / "draft", seed=5)
    for bad in ([], [1, 1], [TINY_VOCAB], "12", [1.5]):
        (draft / "draft_vocab.json").write_text(json.dumps(bad))
        with pytest.raises(SpeculativeConfigError, match="distinct token ids below"):
            LLMEngine(target, engine_config(dtype="float32", speculative_model=draft))


def test_step_table_prices_drafts_by_batch_and_rows():
    """T(B, n) = 20 ms + 1 ms per sequence + 0.5 ms per draft row, measured at 1, 2, 4 and
    8 sequences and 0, 1, 2, 4, 8 drafts each: read back exactly between the points (it is
    linear), extrapolated past them; n drafts each add n x B rows."""
    from worker.spec_decode.step_cost import StepCostTable

    def t(b: float, n: float) -> float:
        return 0.020 + 0.001 * b + 0.0005 * b * n

    batches, counts = (1, 2, 4, 8), (0, 1, 2, 4, 8)
    table = StepCostTable(
        batches,
        tuple(counts for _ in batches),
        tuple(tuple(t(b, n) for n in counts) for b in batches),
    )
    assert table.time(3, 3) == pytest.approx(t(3, 3), rel=0.03)  # bilinear: near, not exact
    assert table.time(2, 16) == pytest.approx(t(2, 16))  # past the last point: its slope
    for batch in (1, 2, 4, 8):
        for n in (1, 4, 6):
            expected = (t(batch, n) - t(batch, 0)) / t(batch, 0)
            assert table.verify_cost(batch, n) == pytest.approx(expected)
    flat = StepCostTable((1,), ((0, 8),), ((0.03, 0.03),))  # rows cost nothing
    assert flat.verify_cost(1, 4) == 0.0


def test_timing_noise_never_makes_more_rows_cheaper():
    """Timed points that dip (a hiccup of the machine on the smaller one) are pooled into
    the closest non-decreasing sequence."""
    from worker.spec_decode.step_cost import _monotone

    assert _monotone([1.0, 2.0, 3.0]) == (1.0, 2.0, 3.0)
    assert _monotone([2.0, 1.0, 3.0]) == (1.5, 1.5, 3.0)
    assert _monotone([1.0, 3.0, 2.0, 2.0, 5.0]) == pytest.approx((1.0, 7 / 3, 7 / 3, 7 / 3, 5.0))


def test_step_table_is_timed_on_the_engines_pool_and_gives_its_blocks_back(target):
    """The engine times decode steps over a shared cached context before serving (no
    position cost given), within the step's row limit; the measurement holds no block
    afterwards, and the engine serves as before."""
    from worker.spec_decode.step_cost import measure_step_costs

    engine = LLMEngine(
        target, engine_config(dtype="float32", speculative_model="ngram", num_speculative_tokens=4)
    )
    assert_no_block_leaks(engine)
    table = measure_step_costs(
        engine.runner.execute,
        engine.block_manager,
        max_batch=6,
        max_drafts=40,
        row_limit=24,
        max_model_len=engine.max_model_len,
        vocab_size=engine.config.vocab_size,
        device=engine.device,
        context=64,
    )
    assert table.batches == (1, 2, 4, 6)
    # Drafts capped by the row limit: B x (1 + n) <= 24.
    assert table.drafts == (
        (0, 1, 2, 4, 8, 16, 23),
        (0, 1, 2, 4, 8, 11),
        (0, 1, 2, 4, 5),
        (0, 1, 2, 3),
    )
    for seconds in table.seconds:
        assert all(0 < a <= b for a, b in itertools.pairwise(seconds))
    assert_no_block_leaks(engine)
    engine.add_request("r", [5, 6, 5, 6, 5, 6], SamplingParams(temperature=0.0, max_tokens=8))
    assert len(drain(engine)["r"].token_ids) == 8
    assert_no_block_leaks(engine)


def test_a_small_pool_times_a_shorter_context():
    """A pool too small for the context and eight sequences: the context shrinks first."""
    from worker.core.block_manager import BlockManager
    from worker.spec_decode.step_cost import measure_step_costs

    pool = BlockManager(num_blocks=12, block_size=4, enable_caching=False)
    fed = []
    table = measure_step_costs(
        lambda step: fed.append([s.start for s in step]),
        pool,
        max_batch=2,
        max_drafts=3,
        row_limit=64,
        max_model_len=1024,
        vocab_size=16,
        device=torch.device("cpu"),
        context=256,
    )
    assert table.batches == (1, 2)
    assert max(start for starts in fed for start in starts) < 256  # a shorter context
    assert pool.num_free_blocks == 12


def test_the_policy_prices_drafts_from_the_measured_table(target, monkeypatch):
    """The table the engine measures at start is what the back-off policy reads (here a
    known one in place of the timing), measured up to the largest batch that speculates and
    k drafts each (a draft model's alternatives too); a position cost given by the user
    skips measuring."""
    from worker.spec_decode import step_cost

    known = step_cost.StepCostTable((1, 8), ((0, 4), (0, 4)), ((0.010, 0.012), (0.020, 0.030)))
    asked = []

    def fake_measure(execute, block_manager, **kwargs):
        asked.append((kwargs["max_batch"], kwargs["max_drafts"], kwargs["row_limit"]))
        return known

    monkeypatch.setattr("worker.engine.assembly.measure_step_costs", fake_measure)
    engine = LLMEngine(
        target,
        engine_config(dtype="float32", speculative_model="ngram", speculative_max_batch_size=6),
    )
    assert asked == [(6, 4, 1024)]
    policy = engine.speculator.policy
    assert policy.verify_cost(1, 2) == pytest.approx(0.001 / 0.010)
    assert policy.verify_cost(8, 4) == pytest.approx(0.010 / 0.020)
    LLMEngine(
        target,
        engine_config(dtype="float32", speculative_model=str(target), speculative_alternatives=3),
    )
    assert asked[-1] == (8, 16, 1024)  # 4 drafts, each with 3 alternatives
    flat = LLMEngine(
        target,
        engine_config(dtype="float32", speculative_model="ngram", speculative_position_cost=0.05),
    )
    assert len(asked) == 2 and flat.speculator.policy.verify_cost(3, 2) == pytest.approx(0.3)
