"""The engine against Hugging Face transformers on tiny random checkpoints (fp32)."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from factories import load_hf_model, make_checkpoint, random_prompts
from worker import LLM, SamplingParams
from worker.core.batch import ScheduledSequence
from worker.core.block_manager import BlockManager
from worker.core.sequence import Sequence
from worker.model.llama import LlamaModel
from worker.model.model_runner import ModelRunner

CHECKPOINTS = {
    "llama-gqa": {"arch": "llama", "num_heads": 4, "num_kv_heads": 2},
    "qwen2-bias": {"arch": "qwen2", "num_heads": 4, "num_kv_heads": 2},
    "llama-untied": {"arch": "llama", "tie_word_embeddings": False, "num_kv_heads": 4},
    "llama3-rope": {
        "arch": "llama",
        "num_kv_heads": 1,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
}
MAX_NEW = 24


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    make_checkpoint(path, **CHECKPOINTS[request.param])
    return path


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    return load_hf_model(checkpoint)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(6, min_len=1, max_len=40, seed=1)


@pytest.fixture(scope="module")
def hf_greedy(hf_model, prompts):
    """HF ``generate`` one prompt at a time (no padding to blur the comparison), EOS ignored."""
    # generate() falls back to the model's own generation config for a None eos id.
    hf_model.generation_config.eos_token_id = None
    config = GenerationConfig(
        max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    results = []
    for prompt in prompts:
        out = hf_model.generate(torch.tensor([prompt]), generation_config=config)
        results.append(out[0, len(prompt) :].tolist())
    return results


def test_prefill_logits_match_transformers(checkpoint, hf_model, prompts):
    model = LlamaModel.from_pretrained(checkpoint, dtype=torch.float32)
    pool = BlockManager(num_blocks=64, block_size=16)
    runner = ModelRunner(model, num_blocks=64, block_size=16)
    seqs = [Sequence(f"r{i}", p, None, i) for i, p in enumerate(prompts)]
    for seq in seqs:
        pool.allocate(seq.block_table, seq.num_tokens)
    _, logits = runner.execute([ScheduledSequence(s, 0, s.num_tokens) for s in seqs])
    for seq, row in zip(seqs, logits, strict=True):
        with torch.no_grad():
            expected = hf_model(torch.tensor([seq.tokens])).logits[0, -1]
        torch.testing.assert_close(row, expected, rtol=1e-4, atol=1e-4)


ENGINE_VARIANTS = {
    "default": {},
    "chunked-prefill": {"max_num_batched_tokens": 7},
    "block-size-1": {"block_size": 1},
    "block-size-32": {"block_size": 32},
    "preemption": {"block_size": 4, "num_kv_blocks": 24},
    "one-seq-at-a-time": {"max_num_seqs": 1},
}


@pytest.mark.parametrize("variant", sorted(ENGINE_VARIANTS))
def test_greedy_generation_matches_transformers_generate(checkpoint, prompts, hf_greedy, variant):
    llm = LLM(checkpoint, dtype="float32", **ENGINE_VARIANTS[variant])
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    assert [o.token_ids for o in outputs] == hf_greedy
    assert all(o.finish_reason == "length" for o in outputs)
    engine = llm.engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    if variant == "preemption":
        assert engine.scheduler.num_preemptions > 0


def test_eos_stops_generation_like_transformers(tmp_path):
    prompts = random_prompts(8, min_len=2, max_len=12, seed=5)
    # First find a token greedy decoding really produces, then make it the EOS token
    # (same seed, same weights), so the scenario is sure to exercise stopping.
    probe = load_hf_model(make_checkpoint(tmp_path / "probe", seed=3))
    probe.generation_config.eos_token_id = None
    config = GenerationConfig(max_new_tokens=30, do_sample=False, pad_token_id=0)
    first = probe.generate(torch.tensor([prompts[0]]), generation_config=config)
    eos = first[0, len(prompts[0]) + 10].item()
    path = make_checkpoint(tmp_path / "m", seed=3, eos_token_id=eos)
    hf = load_hf_model(path)
    llm = LLM(path, dtype="float32")
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=30))
    stopped = 0
    for prompt, out in zip(prompts, outputs, strict=True):
        expected = hf.generate(torch.tensor([prompt]), generation_config=config)[0, len(prompt) :]
        assert out.token_ids == expected.tolist()
        if out.finish_reason == "stop":
            stopped += 1
            assert out.token_ids[-1] == eos and eos not in out.token_ids[:-1]
        else:
            assert out.finish_reason == "length" and len(out.token_ids) == 30
    assert stopped > 0
