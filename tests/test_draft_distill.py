"""`switchboard draft distill` on a tiny checkpoint: a normal HF checkpoint comes out, the
engine accepts it as a draft, and greedy output stays the target's own."""

from __future__ import annotations

import json

import pytest

from factories import add_byte_level_tokenizer, make_checkpoint
from worker import LLM, SamplingParams
from worker.spec_decode.distill import corpus_requests, distill
from worker.spec_decode.distill_prompts import TEMPLATES, TOPICS


@pytest.mark.parametrize("output_vocab", [0, 64])
def test_distilled_draft_is_a_checkpoint_the_engine_speculates_with(
    tmp_path, output_vocab, monkeypatch
):
    monkeypatch.setenv("SWITCHBOARD_HOME", str(tmp_path / "home"))  # the corpus cache
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


def test_the_corpus_answers_each_instruction_greedily_once_and_samples_the_rest():
    first_round = 2 * len(TEMPLATES) * len(TOPICS)
    requests = corpus_requests(first_round + 100, max_tokens=16, seed=5)
    greedy = [m for m, p in requests if p.temperature == 0.0]
    assert len(greedy) == len(set(greedy)) == len(TEMPLATES) * len(TOPICS)  # each once
    assert all(p.temperature == 0.8 for _, p in requests[first_round:])
    assert [m for m, _ in requests[first_round:]] == [m for m, _ in requests[:100]]  # again
    assert len({p.seed for _, p in requests}) == len(requests)  # each sample its own draw


def test_a_second_distillation_reads_the_generated_corpus_back(tmp_path, monkeypatch):
    """Generating is most of a distillation: the same target and settings read the stream
    from the cache; other settings, or a changed target, generate again."""
    import worker.spec_decode.distill as distill_module

    monkeypatch.setenv("SWITCHBOARD_HOME", str(tmp_path / "home"))
    target = make_checkpoint(tmp_path / "target", vocab_size=400, num_layers=1, eos_token_id=0)
    add_byte_level_tokenizer(target)
    generated = []
    generate = distill_module.generate_corpus

    def counting(*args, **kwargs):
        generated.append(kwargs["num_prompts"])
        return generate(*args, **kwargs)

    monkeypatch.setattr(distill_module, "generate_corpus", counting)
    first = distill_module.cached_corpus(target, num_prompts=4, max_tokens=8, seed=0)
    again = distill_module.cached_corpus(target, num_prompts=4, max_tokens=8, seed=0)
    assert again == first and generated == [4]
    distill_module.cached_corpus(target, num_prompts=5, max_tokens=8, seed=0)
    assert generated == [4, 5]
    (target / "config.json").write_text((target / "config.json").read_text() + "\n")
    distill_module.cached_corpus(target, num_prompts=4, max_tokens=8, seed=0)
    assert generated == [4, 5, 4]  # the target's files changed: not the same corpus
