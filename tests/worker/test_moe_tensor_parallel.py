"""Mixtral and Qwen3-MoE split over two ranks (issue 45): each expert's gate/up by output rows and
down by input columns, the router replicated, expert LoRA split to need no exchange of its own.

In one process: the two ranks' shards of a sparse layer (both checkpoint layouts), with a mixed
batch's expert LoRA, add up to the whole layer. Over gloo: two ranks' greedy tokens equal one
rank's and transformers + peft's in fp32, for a batch mixing base rows, an attention-only adapter
and expert adapters (target_parameters) of two ranks, with chunked prefill and slots refilled; then
with prefix hits, with recompute preemption and with n-gram speculation.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from moe_factories import (
    EXPERT_PARAMETERS,
    MOE_FAMILIES,
    make_expert_adapter,
    make_moe_checkpoint,
    write_fused_experts,
)
from peft import PeftModel
from transformers import GenerationConfig

from factories import load_hf_model, make_peft_adapter, random_prompts
from worker import LLM, SamplingParams
from worker.errors import TensorParallelConfigError
from worker.model.checkpoint_files import load_safetensors
from worker.model.layers import load_layer
from worker.model.lora_manager import LoraManager
from worker.model.model_config import ModelConfig
from worker.model.moe import moe_mlp
from worker.model.sharding import Shard, check_divisible, weight_slicer

MAX_NEW = 8
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
# Each token's slot: an expert adapter of rank 4 (0), one of rank 2 on down_proj alone (1), an
# attention-only adapter (2), base rows (-1).
TOKEN_SLOTS = [0, -1, 1, 2, 0, 0, -1, 1, 2, 1, 0, -1, 1, 0, 2, -1, 0]
# Chunked prefill (prompts up to 36 tokens, 32 a step), three adapters over two slots.
ENGINE = {
    "dtype": "float32",
    "block_size": 4,
    "num_kv_blocks": 96,
    "max_num_batched_tokens": 32,
    "max_loras": 2,
    "max_lora_rank": 8,
}


@pytest.fixture(scope="module", params=sorted(MOE_FAMILIES))
def family(request, tmp_path_factory):
    name = request.param
    root = tmp_path_factory.mktemp(name)
    base = make_moe_checkpoint(root / "base", name, seed=3)
    adapters = {
        "experts": make_expert_adapter(
            base, root / "experts", rank=4, targets=["q_proj", "v_proj"],
            parameters=EXPERT_PARAMETERS, seed=1,
        ),
        "down": make_expert_adapter(
            base, root / "down", rank=2, targets=[], parameters=["mlp.experts.down_proj"], seed=2
        ),
        "attn": make_peft_adapter(base, root / "attn", rank=4, targets=ATTENTION),
    }  # fmt: skip
    return name, root, base, adapters


def sparse_layer(path, shard: Shard | None, dtype=torch.float32) -> tuple[int, object]:
    """The first sparse layer's index and weights, whole or as ``shard``'s rank loads them."""
    config = ModelConfig.from_pretrained(path)
    select = None if shard is None else weight_slicer(config, shard)
    w = load_safetensors(path, dtype, select=select)
    i = config.block.experts.sparse_layers.index(True)
    size = 1 if shard is None else shard.size
    return i, load_layer(w, i, config, quantization=None, plan=None, shards=size).moe


def expert_lora(path, adapters, shard: Shard | None, layer: int, dtype=torch.float32):
    """The layer's expert LoRA for TOKEN_SLOTS, with the slots filled as ``shard``'s rank
    fills them."""
    manager = LoraManager(path, dtype=dtype, max_loras=3, max_lora_rank=8, shard=shard)
    for slot, (name, adapter) in enumerate(adapters.items()):
        manager.fill(slot, manager.load(name, adapter), adapter)
    return manager.batch(TOKEN_SLOTS, all_decode=False).expert_lora(layer)


@pytest.mark.parametrize("layout", ["per-expert", "fused"])
def test_the_ranks_experts_add_up_to_the_whole_layer(family, layout):
    """Partial sums of every rank (the all-reduce played by hand) equal the unsplit layer, LoRA
    on each row as its slot says; the rank-2 adapter's slot padded to the max rank of 8."""
    name, root, base, adapters = family
    path = base if layout == "per-expert" else root / "fused"
    if layout == "fused" and not path.exists():
        write_fused_experts(base, path, name)
    layer, whole = sparse_layer(path, None)
    x = torch.randn(
        len(TOKEN_SLOTS), whole.router.shape[1], generator=torch.Generator().manual_seed(0)
    )
    expected = moe_mlp(x, whole, F.silu, expert_lora(base, adapters, None, layer))
    without = moe_mlp(x, whole, F.silu)
    assert not torch.allclose(expected, without, atol=1e-3)  # the LoRA matters
    total = torch.zeros_like(expected)
    for rank in range(2):
        shard = Shard(rank, 2)
        _, moe = sparse_layer(path, shard)
        assert moe.gate_up[0].out_features == whole.gate_up[0].out_features // 2
        torch.testing.assert_close(moe.router, whole.router, rtol=0, atol=0)
        total += moe_mlp(x, moe, F.silu, expert_lora(base, adapters, shard, layer))
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("with_lora", [False, True])
def test_the_ranks_native_grouped_experts_add_up_in_bf16(family, with_lora):
    """In bf16 each rank's slices go through the native grouped kernel where the whole layer
    does (``switchboard_kernels.moe_native``; rows with expert LoRA beside it through the
    per-expert path); the ranks' partial sums, each rounded to bf16, within bf16's rounding of
    the fp32 layer."""
    _, _, base, adapters = family
    layer, whole = sparse_layer(base, None)
    _, whole_bf16 = sparse_layer(base, None, torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(len(TOKEN_SLOTS), whole.router.shape[1], generator=g)
    lora = expert_lora(base, adapters, None, layer) if with_lora else None
    expected = moe_mlp(x, whole, F.silu, lora)
    total = torch.zeros_like(expected)
    for rank in range(2):
        shard = Shard(rank, 2)
        _, moe = sparse_layer(base, shard, torch.bfloat16)
        assert (moe.native is None) == (whole_bf16.native is None)
        lora = expert_lora(base, adapters, shard, layer, torch.bfloat16) if with_lora else None
        total += moe_mlp(x.bfloat16(), moe, F.silu, lora).float()
    error = (total - expected).norm() / expected.norm()
    assert error < 2e-2, float(error)


def test_an_expert_size_the_group_does_not_divide_is_refused(tmp_path):
    base = make_moe_checkpoint(tmp_path / "odd", "qwen3_moe", moe_intermediate_size=33)
    check_divisible(ModelConfig.from_pretrained(base), 1)
    with pytest.raises(TensorParallelConfigError, match="expert intermediate size=33"):
        check_divisible(ModelConfig.from_pretrained(base), 2)


def peft_greedy(base, adapters, prompts, assignment) -> list[list[int]]:
    """transformers + peft, one adapter per model, greedy."""
    config = GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0)
    models = {None: load_hf_model(base)}
    for name in set(assignment) - {None}:
        models[name] = PeftModel.from_pretrained(load_hf_model(base), adapters[name]).eval()
    expected = []
    for prompt, adapter in zip(prompts, assignment, strict=True):
        model = models[adapter]
        model.generation_config.eos_token_id = None
        out = model.generate(input_ids=torch.tensor([prompt]), generation_config=config)
        expected.append(out[0, len(prompt) :].tolist())
    return expected


@pytest.fixture(scope="module")
def reference(family):
    """Prompts, their adapters, and peft's greedy tokens for each."""
    _, _, base, adapters = family
    prompts = random_prompts(6, min_len=12, max_len=36, seed=5)
    assignment = [None, "attn", "experts", "down", None, "experts"]
    return prompts, assignment, peft_greedy(base, adapters, prompts, assignment)


def generate(base, adapters, prompts, assignment, **options) -> tuple[list[list[int]], LLM]:
    llm = LLM(base, **{**ENGINE, **options})
    for adapter, path in adapters.items():
        llm.load_adapter(adapter, path)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts, params, adapters=assignment)], llm


def test_two_ranks_match_one_and_peft(family, reference):
    """Then the expert adapter's prompt again, from the prefix cache, on two ranks."""
    name, _, base, adapters = family
    prompts, assignment, expected = reference
    one, _ = generate(base, adapters, prompts, assignment)
    assert one == expected, name
    two, llm = generate(base, adapters, prompts, assignment, tensor_parallel_size=2)
    try:
        assert two == expected, name
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
        again = llm.generate(prompts[2], params, adapters=[assignment[2]])[0]
        assert again.num_cached_tokens >= 8 and again.token_ids == expected[2]
    finally:
        llm.shutdown()


def test_two_ranks_preempted_and_speculating_match_peft(family, reference):
    """A KV pool too small for the batch (recompute preemption) and n-gram speculation, whose
    verification rows go through the split experts. Verifying is priced at nothing, so drafts
    always run: measured on a loaded machine, verification rows can cost more than drafts
    are expected to add, and the back-off then proposes none."""
    name, _, base, adapters = family
    prompts, assignment, expected = reference
    tokens, llm = generate(
        base, adapters, prompts, assignment, tensor_parallel_size=2, num_kv_blocks=24,
        speculative_model="ngram", num_speculative_tokens=3, speculative_position_cost=0.0,
    )  # fmt: skip
    try:
        assert tokens == expected, name
        assert llm.engine.scheduler.num_preemptions > 0
        assert llm.engine.spec_decode_stats.num_verifications > 0
    finally:
        llm.shutdown()
