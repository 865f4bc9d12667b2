"""`switchboard draft distill` on a tiny checkpoint: a normal HF checkpoint comes out, the
engine accepts it as a draft, and greedy output stays the target's own."""

from __future__ import annotations

import json
import math

import pytest
import torch

from factories import add_byte_level_tokenizer, make_checkpoint
from training.distill_prompts import TEMPLATES, TOPICS
from training.draft_distill import (
    TEACHER_TOP,
    Corpus,
    corpus_requests,
    distill,
    generate_corpus,
    recorded_kl,
    teacher_targets,
)
from worker import LLM, SamplingParams


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
    import training.draft_distill as distill_module

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
    assert generated == [4]
    for name in ("tokens", "teacher_ids", "teacher_logprobs"):
        assert torch.equal(getattr(again, name), getattr(first, name))
    distill_module.cached_corpus(target, num_prompts=5, max_tokens=8, seed=0)
    assert generated == [4, 5]
    (target / "config.json").write_text((target / "config.json").read_text() + "\n")
    distill_module.cached_corpus(target, num_prompts=4, max_tokens=8, seed=0)
    assert generated == [4, 5, 4]  # the target's files changed: not the same corpus


def test_the_recorded_teacher_is_the_targets_distribution_over_the_next_token(tmp_path):
    """Each answer position holds the target's own log-probabilities for the token after it
    (checked with transformers on every prompt + answer); instructions and the EOS that
    ends each answer hold none."""
    from transformers import AutoModelForCausalLM

    target = make_checkpoint(tmp_path / "target", vocab_size=400, num_layers=2, eos_token_id=0)
    add_byte_level_tokenizer(target)
    corpus = generate_corpus(target, num_prompts=4, max_tokens=12, seed=3, dtype="float32")
    assert corpus.teacher_ids.shape == corpus.teacher_logprobs.shape == (len(corpus), TEACHER_TOP)
    scored = (corpus.teacher_ids >= 0).all(-1)
    assert torch.equal(scored, (corpus.teacher_ids >= 0).any(-1))  # a whole row or nothing
    # A request is its unscored instruction, then a scored run (the instruction's last
    # token and the answer), then the answer's closing EOS (id 0), after its last token
    # when the answer ran to max_tokens (that token has no next one to predict).
    run_ends = [i + 1 for i in range(len(corpus) - 1) if scored[i] and not scored[i + 1]]
    ends = [end + 1 if corpus.tokens[end] == 0 else end + 2 for end in run_ends]
    assert len(ends) == 4 and ends[-1] == len(corpus)
    assert all(corpus.tokens[end - 1] == 0 for end in ends)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    begin, worst, shifted = 0, 0.0, 0.0
    for end in ends:
        with torch.no_grad():
            logits = model(corpus.tokens[begin:end].long()[None]).logits[0]
        reference = torch.log_softmax(logits, dim=-1)
        rows = torch.nonzero(scored[begin:end]).squeeze(1)
        ids = corpus.teacher_ids[begin:end][rows].long()
        recorded = corpus.teacher_logprobs[begin:end][rows]
        worst = max(worst, (reference[rows].gather(1, ids) - recorded).abs().max().item())
        shifted = max(shifted, (reference[rows - 1].gather(1, ids) - recorded).abs().max().item())
        begin = end
    assert worst < 1e-4
    assert shifted > 0.1  # one position off would not pass


def test_teacher_targets_are_the_recorded_distribution_over_the_drafts_columns():
    """Ids the draft's output layer lacks drop out and the rest are renormalized; a
    position with none of its tokens kept, or none recorded, scores nothing."""
    logprobs = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.6, 0.4, 0.0], [0.0, 0.0, 0.0]]))
    corpus = Corpus(
        tokens=torch.tensor([1, 2, 3], dtype=torch.int32),
        teacher_ids=torch.tensor([[7, 3, 5], [4, 6, 0], [-1, -1, -1]], dtype=torch.int32),
        teacher_logprobs=logprobs,
    )
    keep = torch.tensor([3, 5, 7])  # columns 0, 1, 2
    targets = teacher_targets(corpus, keep, vocab_size=10)
    assert targets.columns[0].tolist() == [2, 0, 1]
    assert torch.allclose(targets.probs[0], torch.tensor([0.5, 0.3, 0.2]))
    assert targets.probs[1].tolist() == [0.0, 0.0, 0.0]  # 4, 6 and 0 are not kept
    assert targets.probs[2].tolist() == [0.0, 0.0, 0.0]
    expected = 0.5 * math.log(0.5) + 0.3 * math.log(0.3) + 0.2 * math.log(0.2)
    assert targets.neg_entropy[0].item() == pytest.approx(expected)
    assert targets.neg_entropy[1:].tolist() == [0.0, 0.0]
    keep_two = teacher_targets(corpus, torch.tensor([3, 7]), vocab_size=10)
    assert torch.allclose(keep_two.probs[0], torch.tensor([0.5, 0.3, 0.0]) / 0.8)
    everything = teacher_targets(corpus, None, vocab_size=10)
    assert everything.columns[1].tolist() == [4, 6, 0]
    assert torch.allclose(everything.probs[1], torch.tensor([0.6, 0.4, 0.0]))


def test_the_loss_is_torchs_kl_divergence_from_the_recorded_distribution():
    """recorded_kl against F.kl_div with the target's recorded tokens scattered into a dense
    distribution over the draft's columns (renormalized), averaged over scored positions."""
    torch.manual_seed(0)
    vocab, kept = 30, 12
    keep = torch.randperm(vocab)[:kept].sort().values
    full = torch.log_softmax(torch.randn(5, vocab) * 2, dim=-1)
    top = full.topk(TEACHER_TOP, dim=-1)  # 20 of 30 tokens: most, not all, of the mass
    ids = top.indices.to(torch.int32)
    ids[3] = -1  # an instruction position: nothing recorded
    corpus = Corpus(torch.zeros(5, dtype=torch.int32), ids, top.values)
    targets = teacher_targets(corpus, keep, vocab)
    draft_logp = torch.log_softmax(torch.randn(5, kept), dim=-1)
    dense = torch.zeros(5, kept)
    for row in (0, 1, 2, 4):
        for token, logprob in zip(ids[row].tolist(), top.values[row].tolist(), strict=True):
            if token in keep.tolist():
                dense[row, keep.tolist().index(token)] = math.exp(logprob)
        dense[row] /= dense[row].sum()
    expected = torch.nn.functional.kl_div(draft_logp, dense, reduction="sum") / 4
    loss = recorded_kl(draft_logp, targets.columns, targets.probs, targets.neg_entropy)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
