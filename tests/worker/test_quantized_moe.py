"""A MoE checkpoint published quantized (GPTQ, per expert, as GPTQModel stores Qwen3-MoE's
experts): its experts fused gate/up per expert and served through the per-expert path, the greedy
tokens those of transformers (+ peft, LoRA on the experts) over the same weights. The weights are
snapped to the 4-bit grid first (a power-of-two scale per group), so the plain checkpoint the
reference reads holds exactly the weights the packed one encodes."""

from __future__ import annotations

import json

import pytest
import torch
from moe_factories import EXPERT_PARAMETERS, make_expert_adapter, make_moe_checkpoint
from peft import PeftModel
from safetensors.torch import load_file, save_file
from transformers import GenerationConfig

from factories import load_hf_model, random_prompts
from switchboard_kernels.quantized_weight import QuantizedWeight
from switchboard_kernels.wq_native import native_wq
from worker import LLM, SamplingParams
from worker.model.quantized_checkpoints.gptq import GptqReader
from worker.model.quantized_checkpoints.packing import pack_int32

GROUP = 32
GPTQ_V2 = {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "sym": True,
           "desc_act": False, "checkpoint_format": "gptq_v2"}  # fmt: skip
MAX_NEW = 8


def snapped(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(w on the grid [out, in], levels [out, in], scales [out, groups]): symmetric 4 bits, a
    power-of-two scale per group of ``GROUP`` inputs."""
    out_features, in_features = w.shape
    g = w.float().view(out_features, -1, GROUP)
    scales = torch.exp2(torch.ceil(torch.log2(g.abs().amax(-1).clamp(min=1e-6) / 7)))
    q = torch.round(g / scales[..., None]).clamp(-7, 7)
    levels = (q + 8).to(torch.uint8).view(out_features, in_features)
    return (q * scales[..., None]).view(out_features, in_features), levels, scales


def gptq_tensors(levels: torch.Tensor, scales: torch.Tensor) -> dict[str, torch.Tensor]:
    """GPTQ v2's tensors for ``levels`` [out, in] with zero 8."""
    out_features, in_features = levels.shape
    zeros = torch.full((scales.shape[1], out_features), 8, dtype=torch.uint8)
    return {
        "qweight": pack_int32(levels.t().contiguous(), 4, 0),  # [in / 8, out]
        "qzeros": pack_int32(zeros, 4, 1),  # [groups, out / 8]
        "scales": scales.t().contiguous().half(),  # [groups, out]
        "g_idx": (torch.arange(in_features) // GROUP).to(torch.int32),
    }


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized-moe")
    source = make_moe_checkpoint(root / "source", "qwen3_moe", seed=3)
    weights = load_file(source / "model.safetensors")
    plain, packed = {}, {}
    for name, w in weights.items():
        if name.endswith("_proj.weight"):
            w, levels, scales = snapped(w)
            module = name.removesuffix(".weight")
            packed |= {f"{module}.{k}": v for k, v in gptq_tensors(levels, scales).items()}
        else:
            packed[name] = w
        plain[name] = w
    config = json.loads((source / "config.json").read_text())
    for name, tensors, extra in (("plain", plain, {}), ("gptq", packed, GPTQ_V2)):
        (root / name).mkdir()
        (root / name / "config.json").write_text(
            json.dumps(config | {"quantization_config": extra} if extra else config)
        )
        save_file(tensors, root / name / "model.safetensors", metadata={"format": "pt"})
    adapter = make_expert_adapter(
        root / "plain", root / "experts", rank=4, targets=["q_proj"], parameters=EXPERT_PARAMETERS
    )
    return root, adapter


def hf_greedy(root, adapter, prompts, assignment) -> list[list[int]]:
    model = PeftModel.from_pretrained(load_hf_model(root / "plain"), adapter, adapter_name="e")
    model.eval()
    config = GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0)
    model.generation_config.eos_token_id = None
    out = []
    for prompt, name in zip(prompts, assignment, strict=True):
        ids = torch.tensor([prompt])
        if name is None:
            with model.disable_adapter():
                tokens = model.generate(input_ids=ids, generation_config=config)
        else:
            tokens = model.generate(input_ids=ids, generation_config=config)
        out.append(tokens[0, len(prompt) :].tolist())
    return out


def test_quantized_experts_with_expert_lora_match_transformers(case):
    root, adapter = case
    prompts = random_prompts(4, min_len=6, max_len=16, seed=4)
    assignment = [None, "e", "e", None]
    llm = LLM(root / "gptq", dtype="float32", max_loras=1)
    llm.load_adapter("e", adapter)
    moe = llm.engine.runner.model.layers[0].moe
    assert moe is not None and moe.native is None
    kernel = "WqLinear" if native_wq() is not None else "QuantizedReference"
    assert type(moe.gate_up[0].small).__name__ == kernel  # the packed levels, per expert
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outputs = llm.generate(prompts, params, adapters=assignment)
    assert [o.token_ids for o in outputs] == hf_greedy(root, adapter, prompts, assignment)


def test_snapped_weights_are_what_the_reader_reads():
    w = torch.randn(16, 64)
    grid, levels, scales = snapped(w)
    q = GptqReader(bits=4, group_size=GROUP, v2=True).read("m", gptq_tensors(levels, scales))
    assert isinstance(q, QuantizedWeight) and torch.equal(q.dequantize(), grid)
