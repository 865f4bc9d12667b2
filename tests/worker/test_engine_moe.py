"""Mixtral and Qwen3-MoE against transformers + peft (fp32): routing that varies across
tokens, a mixed batch of base rows, an attention adapter and expert adapters (PEFT's
target_parameters) under preemption, prefix hits, speculative decoding, and prefill logits."""

from __future__ import annotations

import pytest
import torch
from moe_factories import (
    EXPERT_PARAMETERS,
    MOE_FAMILIES,
    NUM_EXPERTS,
    make_expert_adapter,
    make_moe_checkpoint,
)
from peft import PeftModel
from transformers import GenerationConfig

from factories import load_hf_model, make_peft_adapter, random_prompts
from switchboard_kernels.moe_native import grouped_kernel
from worker import LLM, SamplingParams
from worker.core.batch import ScheduledSequence
from worker.core.block_manager import BlockManager
from worker.core.sequence import Sequence
from worker.model.llama import LlamaModel
from worker.model.model_runner import ModelRunner
from worker.model.moe import route

MAX_NEW = 10
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
# A pool too small for the batch at once (recompute preemption), 4-token blocks.
PRESSURE = {"block_size": 4, "num_kv_blocks": 24, "max_num_batched_tokens": 48}


@pytest.fixture(scope="module", params=sorted(MOE_FAMILIES))
def family(request, tmp_path_factory):
    name = request.param
    root = tmp_path_factory.mktemp(name)
    base = make_moe_checkpoint(root / "base", name, seed=3)
    adapters = {
        "attn": make_peft_adapter(base, root / "attn", rank=4, targets=ATTENTION),
        # Both expert tensors and two attention projections, rank 4.
        "experts": make_expert_adapter(
            base, root / "experts", rank=4, targets=["q_proj", "v_proj"],
            parameters=EXPERT_PARAMETERS, seed=1,
        ),
        # The experts' down_proj alone (no nesting), rank 2.
        "down": make_expert_adapter(
            base, root / "down", rank=2, targets=[], parameters=["mlp.experts.down_proj"], seed=2
        ),
    }  # fmt: skip
    return name, base, adapters


@pytest.fixture(scope="module")
def reference(family):
    """Prompts, their adapters, and peft's greedy tokens for each (one adapter per model: peft
    refuses two adapters with different target_parameters on one model)."""
    _, base, adapters = family
    prompts = random_prompts(6, min_len=12, max_len=36, seed=5)
    assignment = [None, "attn", "experts", "down", None, "experts"]
    config = GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0)
    models = {None: load_hf_model(base)}
    for name, path in adapters.items():
        models[name] = PeftModel.from_pretrained(load_hf_model(base), path).eval()
    for model in models.values():
        model.generation_config.eos_token_id = None
    expected = []
    for prompt, adapter in zip(prompts, assignment, strict=True):
        out = models[adapter].generate(input_ids=torch.tensor([prompt]), generation_config=config)
        expected.append(out[0, len(prompt) :].tolist())
    return prompts, assignment, expected


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def test_routing_varies_across_tokens(family, reference):
    """Every expert of the first sparse layer gets some of the prompts' tokens, and tokens
    differ in their pairs of experts: a test that routes every token alike proves little."""
    _, base, _ = family
    prompts, _, _ = reference
    model = LlamaModel.from_pretrained(base, dtype=torch.float32)
    layer = next(y for y in model.layers if y.moe is not None)
    x = model.embed[torch.tensor([t for p in prompts for t in p])]
    routing = route(x, layer.moe)
    assert len(routing.counts) == NUM_EXPERTS and min(routing.counts) > 0


def test_mixed_batch_preempted_and_prefix_hit_match_peft(family, reference):
    name, base, adapters = family
    prompts, assignment, expected = reference
    llm = LLM(base, dtype="float32", max_loras=2, **PRESSURE)
    for adapter, path in adapters.items():
        llm.load_adapter(adapter, path)
    outputs = llm.generate(prompts, greedy(), adapters=assignment)
    assert [o.token_ids for o in outputs] == expected, name
    assert llm.engine.scheduler.num_preemptions > 0
    # Each adapter changes its row's output (else this test could not fail).
    for i in (1, 2, 3):
        assert expected[i] != llm.generate(prompts[i], greedy())[0].token_ids, assignment[i]
    assert len({t for tokens in expected for t in tokens}) > MAX_NEW
    for i in (0, 2):
        llm.generate(prompts[i], greedy(), adapters=[assignment[i]])
        again = llm.generate(prompts[i], greedy(), adapters=[assignment[i]])[0]
        assert again.num_cached_tokens >= 8
        assert again.token_ids == expected[i]


@pytest.mark.skipif(
    grouped_kernel(torch.float32) is None, reason="no native grouped-experts kernel here"
)
def test_the_native_grouped_kernel_keeps_the_tokens(family, reference):
    """The projections in the native panels (``batch_invariant``: the panels for every row
    count, on any CPU), so every sparse layer's step runs the grouped kernel, the rows with
    expert LoRA beside it through the per-expert path: peft's tokens still."""
    name, base, adapters = family
    prompts, assignment, expected = reference
    llm = LLM(base, dtype="float32", max_loras=2, batch_invariant=True, **PRESSURE)
    model = llm.engine.model
    assert all(y.moe.native is not None for y in model.layers if y.moe is not None)
    for adapter, path in adapters.items():
        llm.load_adapter(adapter, path)
    outputs = llm.generate(prompts, greedy(), adapters=assignment)
    assert [o.token_ids for o in outputs] == expected, name
    assert llm.generate(prompts[0], greedy())[0].token_ids == expected[0]


def test_prefill_logits_match_transformers(family, reference):
    name, base, _ = family
    prompts, _, _ = reference
    model = LlamaModel.from_pretrained(base, dtype=torch.float32)
    pool = BlockManager(num_blocks=64, block_size=16)
    runner = ModelRunner(model, num_blocks=64, block_size=16)
    seqs = [Sequence(f"r{i}", p, None, i) for i, p in enumerate(prompts[:3])]
    for seq in seqs:
        pool.allocate(seq.block_table, seq.num_tokens)
    _, logits = runner.execute([ScheduledSequence(s, 0, s.num_tokens) for s in seqs])
    hf = load_hf_model(base)
    for seq, row in zip(seqs, logits, strict=True):
        with torch.no_grad():
            expected = hf(torch.tensor([seq.tokens])).logits[0, -1]
        torch.testing.assert_close(row, expected, rtol=1e-4, atol=1e-4, msg=name)


@pytest.mark.parametrize("proposer", ["draft-of-the-family", "ngram"])
def test_speculative_decoding_keeps_the_tokens(family, reference, proposer):
    """Verification rows through the experts: a same-family draft with alternatives (the
    target itself) or n-gram lookup, in the mixed batch."""
    _, base, adapters = family
    prompts, assignment, expected = reference
    llm = LLM(
        base,
        dtype="float32",
        max_loras=2,
        speculative_model=str(base) if proposer != "ngram" else "ngram",
        num_speculative_tokens=3,
        speculative_alternatives=2 if proposer != "ngram" else 0,
        speculative_position_cost=0.0,
        speculative_draft_cost=0.0,
        speculative_draft_quantization="none",
    )
    for adapter, path in adapters.items():
        llm.load_adapter(adapter, path)
    outputs = llm.generate(prompts, greedy(), adapters=assignment)
    assert [o.token_ids for o in outputs] == expected
    assert llm.engine.spec_decode_stats.num_verifications > 0
