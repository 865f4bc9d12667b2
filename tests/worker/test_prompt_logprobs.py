"""Prompt logprobs from the prefill pass against transformers (+ peft for an adapter), fp32,
within 1e-4: base and adapter rows in one batch, chunked prefills, a prompt whose prefix is
cached (it must be computed again), n > 1, and max_tokens 0 (score only)."""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel

from factories import load_hf_model, make_checkpoint, make_peft_adapter, random_prompts
from worker import LLM, SamplingParams
from worker.errors import InvalidRequestError

TOL = 1e-4
TOP = 3


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("plp-base"), seed=5)


@pytest.fixture(scope="module")
def adapter(base, tmp_path_factory):
    out = tmp_path_factory.mktemp("plp-adapter") / "a"
    return make_peft_adapter(base, out, rank=4, targets=["q_proj", "v_proj", "down_proj"])


@pytest.fixture(scope="module")
def reference(base, adapter):
    """[P-1, vocab] logprobs of each prompt's tokens 1..P-1, by transformers / peft."""
    model = PeftModel.from_pretrained(load_hf_model(base), adapter, adapter_name="a").eval()

    def logprobs(prompt: list[int], with_adapter: bool) -> torch.Tensor:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            if with_adapter:
                logits = model(input_ids=ids).logits[0]
            else:
                with model.disable_adapter():
                    logits = model(input_ids=ids).logits[0]
        return torch.log_softmax(logits.float(), dim=-1)[:-1]

    return logprobs


def assert_matches(out, prompt, expected: torch.Tensor) -> None:
    got = out.prompt_logprobs
    assert len(got) == len(prompt) - 1
    for p, entry in enumerate(got):
        assert entry.token_id == prompt[p + 1]
        assert abs(entry.logprob - expected[p, prompt[p + 1]].item()) <= TOL
        top = torch.topk(expected[p], TOP)
        assert [t for t, _ in entry.top_logprobs] == top.indices.tolist()
        assert torch.allclose(
            torch.tensor([lp for _, lp in entry.top_logprobs]), top.values, atol=TOL
        )


def scoring(max_tokens: int = 0, **kwargs) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, prompt_logprobs=TOP, temperature=0.0, ignore_eos=True, **kwargs
    )


def test_base_and_adapter_rows_in_one_batch_chunked_match_the_reference(base, adapter, reference):
    # A 16-token budget splits the longer prompts into chunks across steps.
    llm = LLM(base, dtype="float32", max_loras=1, max_num_batched_tokens=16, block_size=4)
    llm.load_adapter("a", adapter)
    prompts = random_prompts(4, min_len=5, max_len=40, seed=9)
    adapters = ["a", None, "a", None]
    params = [scoring(0), scoring(3), scoring(2), scoring(0)]
    outs = llm.generate(prompts, params, adapters=adapters)
    for out, prompt, name in zip(outs, prompts, adapters, strict=True):
        assert_matches(out, prompt, reference(prompt, name is not None))
    assert [len(o.token_ids) for o in outs] == [0, 3, 2, 0]  # max_tokens 0: nothing generated
    assert outs[0].finish_reason == "length"


def test_a_cached_prefix_is_computed_again_for_its_logprobs(base, adapter, reference):
    llm = LLM(base, dtype="float32", max_loras=1, block_size=4)
    prompt = random_prompts(1, min_len=30, max_len=30, seed=3)[0]
    plain = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate([prompt], plain)  # fills the prefix cache with the prompt's blocks
    out = llm.generate([prompt], scoring())[0]
    assert_matches(out, prompt, reference(prompt, False))
    assert out.num_cached_tokens == 0
    again = llm.generate([prompt], plain)[0]  # and its blocks are cached for others
    assert again.num_cached_tokens > 0


def test_n_samples_share_one_scored_prompt(base, reference):
    llm = LLM(base, dtype="float32", block_size=4)
    engine = llm.engine
    prompt = random_prompts(1, min_len=12, max_len=12, seed=1)[0]
    params = [scoring(2, seed=i) for i in range(3)]
    engine.add_samples(["s0", "s1", "s2"], prompt, params)
    done = {}
    while engine.has_unfinished_requests or engine.has_pending_forks:
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    expected = reference(prompt, False)
    for out in done.values():
        assert_matches(out, prompt, expected)


def test_bounds():
    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(InvalidRequestError, match="max_tokens must be at least 1"):
        SamplingParams(max_tokens=0)
    assert SamplingParams(max_tokens=0, prompt_logprobs=0).max_tokens == 0


def test_async_output_scores_the_same(base, reference):
    """Rendering one step later (CUDA's default) changes neither the scores nor max_tokens 0."""
    llm = LLM(base, dtype="float32", async_output=True, block_size=4)
    prompts = random_prompts(2, min_len=6, max_len=20, seed=2)
    outs = llm.generate(prompts, [scoring(0), scoring(2)])
    for out, prompt in zip(outs, prompts, strict=True):
        assert_matches(out, prompt, reference(prompt, False))
    assert [len(o.token_ids) for o in outs] == [0, 2]
