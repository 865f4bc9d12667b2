"""The engine on a CUDA device: weights, KV cache and adapter slots on the GPU, LoRA through
the Triton kernels (BGMV for all-decode steps, SGMV otherwise), against the same references
as on CPU. Skipped without CUDA; the device checks at the end run everywhere."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from factories import (
    load_hf_model,
    make_checkpoint,
    make_peft_adapter,
    make_perturbed_checkpoint,
    random_prompts,
)
from worker import LLM, SamplingParams
from worker.errors import InvalidRequestError

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
MAX_NEW = 16
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("base"), seed=5)


def greedy(max_tokens: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def hf_greedy(model, prompts: list[list[int]]) -> list[list[int]]:
    model.generation_config.eos_token_id = None
    config = GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0)
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=model.device)
        outputs.append(model.generate(input_ids=ids, generation_config=config)[0, len(prompt) :])
    return [o.tolist() for o in outputs]


@needs_cuda
def test_greedy_tokens_match_transformers_on_the_gpu(base):
    prompts = random_prompts(6, min_len=1, max_len=40, seed=1)
    expected = hf_greedy(load_hf_model(base).cuda(), prompts)
    llm = LLM(base, dtype="float32", device="cuda")
    assert llm.engine.runner.kv_caches[0][0].is_cuda
    outputs = llm.generate(prompts, greedy())
    assert [o.token_ids for o in outputs] == expected


@needs_cuda
def test_mixed_adapter_batch_matches_peft_on_the_gpu(base, tmp_path):
    """Prefill (SGMV) and all-decode steps (BGMV) of a batch mixing the base model and
    three adapters of different ranks and targets, each against peft with that adapter."""
    from peft import PeftModel

    specs = {"r2-all": (2, ALL), "r8-qv": (8, ["q_proj", "v_proj"]), "r16-mlp": (16, ALL[4:])}
    dirs = {
        name: make_peft_adapter(base, tmp_path / name, rank=rank, targets=targets, seed=i)
        for i, (name, (rank, targets)) in enumerate(specs.items())
    }
    prompts = random_prompts(5, min_len=3, max_len=24, seed=4)
    assignment = [None, *dirs, None]
    model = PeftModel.from_pretrained(load_hf_model(base), dirs["r2-all"], adapter_name="r2-all")
    for name in list(dirs)[1:]:
        model.load_adapter(dirs[name], adapter_name=name)
    model = model.cuda().eval()
    expected = []
    for prompt, name in zip(prompts, assignment, strict=True):
        if name is None:
            with model.disable_adapter():
                expected += hf_greedy(model, [prompt])
        else:
            model.set_adapter(name)
            expected += hf_greedy(model, [prompt])
    llm = LLM(base, dtype="float32", device="cuda", max_loras=len(dirs))
    for name, path in dirs.items():
        llm.load_adapter(name, path)
    outputs = llm.generate(prompts, greedy(), adapters=assignment)
    assert [o.token_ids for o in outputs] == expected


@needs_cuda
def test_sampled_speculation_with_a_draft_on_the_gpu(base, tmp_path):
    """Rejection sampling with draft and target distributions on the device: runs, and
    greedy stays identical to plain decoding."""
    draft = make_perturbed_checkpoint(base, tmp_path / "draft", noise=0.1)
    prompts = random_prompts(4, min_len=3, max_len=12, seed=6)
    plain = LLM(base, dtype="float32", device="cuda").generate(prompts, greedy())
    spec = LLM(
        base,
        dtype="float32",
        device="cuda",
        speculative_model=str(draft),
        num_speculative_tokens=3,
        speculative_min_acceptance=0.0,
        speculative_position_cost=0.0,  # speculate whatever it costs: this is about exactness
        speculative_draft_cost=0.0,
    )
    assert [o.token_ids for o in spec.generate(prompts, greedy())] == [o.token_ids for o in plain]
    sampled = SamplingParams(temperature=1.0, top_k=5, max_tokens=MAX_NEW, seed=3)
    outputs = spec.generate(prompts, sampled)
    assert all(len(o.token_ids) == MAX_NEW for o in outputs)
    assert spec.engine.spec_decode_stats.num_proposed > 0


@needs_cuda
def test_cuda_graphs_give_the_eager_steps_tokens(base, tmp_path):
    """Decode steps replayed as CUDA graphs (buckets 8, 4, 2, 1 as requests finish; LoRA
    inside the graph over a static slot buffer) give the eager steps' greedy tokens."""
    adapters = {
        "r4-all": make_peft_adapter(base, tmp_path / "all", rank=4, targets=ALL, seed=1),
        "r8-qv": make_peft_adapter(base, tmp_path / "qv", rank=8, targets=ALL[::2], seed=2),
    }
    prompts = random_prompts(5, min_len=2, max_len=30, seed=9)
    names = [None, "r4-all", "r8-qv", None, "r4-all"]
    params = [greedy(n) for n in (2, 12, 6, 9, 3)]
    outputs = []
    for cuda_graphs in (False, True):
        llm = LLM(base, dtype="float32", device="cuda", max_loras=2, cuda_graphs=cuda_graphs)
        for name, path in adapters.items():
            llm.load_adapter(name, path)
        outputs.append([o.token_ids for o in llm.generate(prompts, params, adapters=names)])
        # and the base model alone (the graphs without LoRA)
        outputs[-1].append(llm.generate(prompts[:3], greedy(8))[2].token_ids)
    assert outputs[1] == outputs[0]
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.num_replays > 0
    assert {key[0] for key in graphs.graphs} >= {8, 4, 2, 1}


def test_unknown_or_unavailable_devices_are_refused_clearly(base):
    with pytest.raises(InvalidRequestError, match="device must be 'cpu' or 'cuda"):
        LLM(base, dtype="float32", device="tpu")
    if not CUDA:
        with pytest.raises(InvalidRequestError, match="needs CUDA"):
            LLM(base, dtype="float32", device="cuda")
    llm = LLM(base, dtype="float32", device="cpu")
    assert llm.engine.device == torch.device("cpu")
    assert llm.generate([[1, 2, 3]], greedy(2))[0].token_ids
