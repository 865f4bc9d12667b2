"""Every dense family of the architecture registry against transformers + peft (fp32).

Per family, one mixed batch of base rows and two adapters of different ranks and targets, with
prompts longer than the sliding window, under a KV pool small enough to preempt, then a prefix
hit: every request's greedy tokens equal peft's with that adapter alone (or the base model's).
"""

from __future__ import annotations

import json

import pytest
import torch
from family_factories import FAMILIES, WINDOW, make_family_checkpoint
from peft import PeftModel
from transformers import GenerationConfig

from adapters.errors import IncompatibleAdapterError
from adapters.peft_names import WEIGHTS_FILE as WEIGHTS
from factories import load_hf_model, make_peft_adapter, random_prompts
from worker import LLM, SamplingParams
from worker.core.batch import ScheduledSequence
from worker.core.block_manager import BlockManager
from worker.core.sequence import Sequence
from worker.engine.long_rope import LongRopeSwitch
from worker.model.llama import LlamaModel
from worker.model.lora_manager import LoraManager
from worker.model.model_runner import ModelRunner

MAX_NEW = 10
# Two adapters of different ranks and targets (Phi-3's projections are stored fused).
ADAPTERS = {
    "attn": {"rank": 4, "targets": ["q_proj", "k_proj", "v_proj", "o_proj"]},
    "mlp": {"rank": 8, "targets": ["gate_proj", "up_proj", "down_proj"]},
}
FUSED_ADAPTERS = {
    "attn": {"rank": 4, "targets": ["qkv_proj", "o_proj"]},
    "mlp": {"rank": 8, "targets": ["gate_up_proj", "down_proj"]},
}
# A pool too small for the batch at once (recompute preemption), 4-token blocks.
PRESSURE = {"block_size": 4, "num_kv_blocks": 24, "max_num_batched_tokens": 48}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    name = request.param
    root = tmp_path_factory.mktemp(name)
    base = make_family_checkpoint(root / "base", name, seed=3)
    specs = FUSED_ADAPTERS if name.startswith("phi3") else ADAPTERS
    adapters = {
        a: make_peft_adapter(base, root / a, seed=i, **spec)
        for i, (a, spec) in enumerate(specs.items())
    }
    return name, base, adapters


@pytest.fixture(scope="module")
def reference(family):
    """Prompts longer than the window, their adapters, and peft's greedy tokens for each."""
    _, base, adapters = family
    prompts = random_prompts(5, min_len=2 * WINDOW + 1, max_len=5 * WINDOW, seed=5)
    assignment = [None, "attn", "mlp", None, "attn"]
    hf = load_hf_model(base)
    hf.generation_config.eos_token_id = None
    config = GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0)
    model = PeftModel.from_pretrained(hf, adapters["attn"], adapter_name="attn")
    model.load_adapter(adapters["mlp"], adapter_name="mlp")
    model.eval()
    expected = []
    for prompt, adapter in zip(prompts, assignment, strict=True):
        ids = torch.tensor([prompt])
        if adapter is None:
            with model.disable_adapter():
                out = model.generate(input_ids=ids, generation_config=config)
        else:
            model.set_adapter(adapter)
            out = model.generate(input_ids=ids, generation_config=config)
        expected.append(out[0, len(prompt) :].tolist())
    return prompts, assignment, expected


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def test_mixed_batch_preempted_and_prefix_hit_match_peft(family, reference):
    name, base, adapters = family
    prompts, assignment, expected = reference
    llm = LLM(base, dtype="float32", max_loras=2, **PRESSURE)
    for adapter, path in adapters.items():
        llm.load_adapter(adapter, path)
    outputs = llm.generate(prompts, greedy(), adapters=assignment)
    assert [o.token_ids for o in outputs] == expected, name
    assert llm.engine.scheduler.num_preemptions > 0
    # The adapters change the output (else this test could not fail), and tokens vary.
    assert expected[1] != llm.generate(prompts[1], greedy())[0].token_ids
    assert len({t for tokens in expected for t in tokens}) > MAX_NEW
    # The same prompt again, alone: its blocks come from the prefix cache.
    for i in (0, 2):
        again = llm.generate(prompts[i], greedy(), adapters=[assignment[i]])[0]
        again = llm.generate(prompts[i], greedy(), adapters=[assignment[i]])[0]
        assert again.num_cached_tokens >= WINDOW
        assert again.token_ids == expected[i]


def test_prefill_logits_match_transformers(family, reference):
    """Logits, not only their argmax: Gemma 2's final soft-cap and Granite's logits scale
    change no greedy token."""
    name, base, _ = family
    prompts, _, _ = reference
    model = LlamaModel.from_pretrained(base, dtype=torch.float32)
    pool = BlockManager(num_blocks=64, block_size=16)
    runner = ModelRunner(model, num_blocks=64, block_size=16)
    seqs = [Sequence(f"r{i}", p, None, i) for i, p in enumerate(prompts[:3])]
    for seq in seqs:
        pool.allocate(seq.block_table, seq.num_tokens)
        if model.long_rope is not None:  # a prompt past the switch rotates long
            LongRopeSwitch(model.long_rope).admit(seq)
    _, logits = runner.execute([ScheduledSequence(s, 0, s.num_tokens) for s in seqs])
    hf = load_hf_model(base)
    for seq, row in zip(seqs, logits, strict=True):
        with torch.no_grad():
            expected = hf(torch.tensor([seq.tokens])).logits[0, -1]
        torch.testing.assert_close(row, expected, rtol=1e-4, atol=1e-4, msg=name)


def test_an_adapter_for_modules_the_base_lacks_is_refused_by_name(family, tmp_path):
    """Phi-3 has no q_proj, the others no qkv_proj: refused at load, naming the module."""
    from safetensors.torch import load_file, save_file

    name, base, adapters = family
    source = adapters["attn"]
    theirs, ours = ("qkv_proj", "q_proj") if name.startswith("phi3") else ("q_proj", "qkv_proj")
    tensors = {k.replace(theirs, ours): v for k, v in load_file(source / WEIGHTS).items()}
    save_file(tensors, tmp_path / WEIGHTS)
    config = json.loads((source / "adapter_config.json").read_text())
    config["target_modules"] = [ours if t == theirs else t for t in config["target_modules"]]
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(IncompatibleAdapterError, match=f"module '{ours}'"):
        LoraManager(base, dtype=torch.float32).read(tmp_path)


@pytest.mark.parametrize("proposer", ["draft-of-the-family", "ngram"])
def test_speculative_decoding_keeps_the_windowed_tokens(family, reference, proposer):
    """Verification rows (chains and alternatives off them) under windows and soft-caps:
    a draft of the same family (the target itself, always right) or n-gram lookup."""
    name, base, adapters = family
    if name not in ("gemma2", "mistral-window", "phi3", "phi3-longrope"):
        pytest.skip("the other families' attention is covered by these three")
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
