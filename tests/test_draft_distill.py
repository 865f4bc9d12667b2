"""`switchboard draft distill` on a tiny checkpoint: a normal HF checkpoint comes out, the
engine accepts it as a draft, and greedy output stays the target's own."""

from __future__ import annotations

import json

import pytest

from factories import add_byte_level_tokenizer, make_checkpoint
from worker import LLM, SamplingParams
from worker.spec_decode.distill import distill


@pytest.mark.parametrize("output_vocab", [0, 64])
def test_distilled_draft_is_a_checkpoint_the_engine_speculates_with(tmp_path, output_vocab):
    target = make_checkpoint(tmp_path / "target", vocab_size=400, num_layers=3, eos_token_id=0)
    add_byte_level_tokenizer(target)
    result = distill(
        target,
        tmp_path / "draft",
        num_layers=2,
        num_prompts=8,
        max_tokens=24,
        seq_len=32,
        batch_size=2,
        output_vocab=output_vocab,
        train_minutes=0.2,
    )
    assert result.train_steps > 5
    assert result.final_loss < result.first_loss  # it learned something from the target

    from transformers import AutoConfig, AutoTokenizer

    assert AutoConfig.from_pretrained(result.path).num_hidden_layers == 2
    vocab_file = result.path / "draft_vocab.json"
    if output_vocab:
        kept = json.loads(vocab_file.read_text())
        assert len(kept) == result.output_vocab == 64 and 0 in kept  # EOS (id 0) always
    else:
        assert not vocab_file.exists() and result.output_vocab == 400
    assert AutoTokenizer.from_pretrained(result.path).get_vocab() == (
        AutoTokenizer.from_pretrained(target).get_vocab()
    )
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    prompts = ["hello world", "the quick brown fox"]
    expected = LLM(target, dtype="float32").generate(prompts, params)
    llm = LLM(target, dtype="float32", speculative_model=result.path, num_speculative_tokens=3)
    outputs = llm.generate(prompts, params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
    assert llm.engine.spec_decode_stats.num_proposed > 0
