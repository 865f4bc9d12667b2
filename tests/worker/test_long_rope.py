"""Phi-3's LongRoPE against transformers (fp32): the tables for the short and the long factors,
and the switch, a sequence past ``original_max_position_embeddings`` rotating every position
with the long factors (a prompt past it from the start, one crossing it while decoding, its
cached K/V computed again), with prefix-cache hits only within one set of factors, and drafts
that stop at the switch."""

from __future__ import annotations

import pytest
import torch
from family_factories import LONG_ROPE_AT, make_family_checkpoint
from transformers import AutoConfig
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

from factories import load_hf_model, random_prompts
from worker import LLM, SamplingParams
from worker.model.model_config import ModelConfig
from worker.model.rope import RopeTables

ENGINE = {"dtype": "float32", "block_size": 4, "num_kv_blocks": 64, "max_num_batched_tokens": 16}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_family_checkpoint(tmp_path_factory.mktemp("longrope"), "phi3-longrope", seed=3)


def hf_greedy(model, prompt: list[int], max_new: int) -> list[int]:
    model.generation_config.eos_token_id = None
    ids = torch.tensor([prompt])
    out = model.generate(input_ids=ids, max_new_tokens=max_new, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def test_tables_match_transformers_short_and_long(base):
    """Rows [0, max) rotate with the short factors, [max, 2 max) with the long ones; both
    scaled by the attention factor sqrt(1 + ln 4 / ln 24)."""
    config = ModelConfig.from_pretrained(base)
    max_positions = config.max_position_embeddings
    tables = RopeTables.build(config.head_dim, config.rope, max_positions, torch.float32)
    hf = Phi3RotaryEmbedding(AutoConfig.from_pretrained(base))
    x = torch.zeros(1, dtype=torch.float32)
    short, long = torch.arange(LONG_ROPE_AT)[None], torch.arange(max_positions)[None]
    for positions, offset in ((short, 0), (long, max_positions)):
        cos, sin = hf(x, positions)  # transformers picks the factors by the positions' span
        rows = positions[0] + offset
        torch.testing.assert_close(tables.cos[rows], cos[0], rtol=0, atol=1e-6)
        half = tables.cos.shape[-1] // 2  # of the rotary features (3/4 of the head)
        torch.testing.assert_close(
            tables.signed_sin[rows, half:], sin[0, :, half:], rtol=0, atol=1e-6
        )
        torch.testing.assert_close(
            tables.signed_sin[rows, :half], -sin[0, :, :half], rtol=0, atol=1e-6
        )
    assert not torch.allclose(tables.cos[:LONG_ROPE_AT], tables.cos[max_positions:][:LONG_ROPE_AT])


def test_short_crossing_and_long_sequences_match_transformers(base):
    """One batch: a prompt that stays short, two that cross the switch while decoding (their
    K/V dropped and computed again, long), one long from the start; n = 2 samples crossing."""
    lengths = (12, 20, 24, 33)
    pool = random_prompts(4, min_len=40, max_len=40, seed=7)
    prompts = [p[:n] for p, n in zip(pool, lengths, strict=True)]
    max_new = [8, 10, 6, 10]
    hf = load_hf_model(base)
    expected = [hf_greedy(hf, p, n) for p, n in zip(prompts, max_new, strict=True)]
    llm = LLM(base, **ENGINE)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_new]
    outputs = llm.generate(prompts, params)
    assert [o.token_ids for o in outputs] == expected
    engine = llm.engine
    engine.add_samples(["a", "b"], prompts[1], [params[1]] * 2)
    done = {}
    while engine.has_unfinished_requests:
        done.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
    assert done == {"a": expected[1], "b": expected[1]}


def test_prefix_hits_stay_within_one_set_of_factors(base):
    """After a sequence crossed, its long K/V are cached under their own root: a short prompt
    with the same leading tokens computes them short, a long one hits them."""
    [prompt] = random_prompts(1, min_len=20, max_len=20, seed=11)
    hf = load_hf_model(base)
    first = prompt + hf_greedy(hf, prompt, 10)  # 30 tokens: crossed at 25
    llm = LLM(base, **ENGINE)
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    assert llm.generate([prompt], greedy)[0].token_ids == first[20:]
    short, long = first[:LONG_ROPE_AT], first[: LONG_ROPE_AT + 4]
    for again in (short, long):
        out = llm.generate([again], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))[
            0
        ]
        assert out.token_ids == hf_greedy(hf, again, 3)
        if again is long:
            assert out.num_cached_tokens >= LONG_ROPE_AT  # the crossed sequence's long blocks


@pytest.mark.parametrize("proposer", ["draft-of-the-family", "ngram"])
def test_speculative_decoding_drafts_no_row_past_the_switch(base, proposer):
    """A short sequence's drafts stop at the switch (their tokens would need the long factors);
    verification rows of long sequences rotate long. The target is its own draft (always
    right, alternatives off the chain), or n-gram lookup."""
    lengths = (20, 22, 23, 24, 30)
    pool = random_prompts(5, min_len=40, max_len=40, seed=9)
    prompts = [p[:n] for p, n in zip(pool, lengths, strict=True)]
    hf = load_hf_model(base)
    expected = [hf_greedy(hf, p, 8) for p in prompts]
    llm = LLM(
        base,
        **ENGINE,
        speculative_model=str(base) if proposer != "ngram" else "ngram",
        num_speculative_tokens=3,
        speculative_alternatives=2 if proposer != "ngram" else 0,
        speculative_position_cost=0.0,
        speculative_draft_cost=0.0,
        speculative_draft_quantization="none",
    )
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    assert llm.engine.spec_decode_stats.num_verifications > 0
