"""Published quantized checkpoints served end to end: the engine reading each format's packed
bytes (GPTQ with act-order, v1 zeros; AWQ GEMM; compressed-tensors pack-quantized) gives the
greedy tokens of transformers + peft running the same model with its projections as the format's
own library dequantized them (``quantized_fixtures/``), in fp32, for a mixed batch of base rows,
plain LoRA, DoRA (its norm over the dequantized base weight, as PEFT takes it) and a trained
lm_head copy (modules_to_save)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file
from transformers import GenerationConfig

from factories import load_hf_model, make_peft_adapter, random_prompts
from switchboard_kernels.quantized_weight import QuantizedWeight
from switchboard_kernels.wq_native import native_wq
from worker import LLM, SamplingParams
from worker.errors import InvalidRequestError, ModelLoadError, TensorParallelConfigError
from worker.model.checkpoint_files import load_safetensors
from worker.model.model_config import ModelConfig
from worker.model.sharding import Shard, weight_slicer

FIXTURES = Path(__file__).parent / "quantized_fixtures"
FORMATS = ["gptq", "awq", "ct"]
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {
    "plain": {"rank": 4, "targets": ALL},
    "dora": {"rank": 4, "targets": ["q_proj", "v_proj", "down_proj"], "use_dora": True},
    "head": {"rank": 2, "targets": ["o_proj"], "modules_to_save": ["lm_head"]},
}
ASSIGNMENT = [None, "plain", "dora", "head", None, "dora", "plain", "head"]
MAX_NEW = 10
VOCAB = 96


def reference_checkpoint(fmt: str, out: Path) -> Path:
    """The fixture's model as a plain fp32 checkpoint: its unquantized tensors, and each
    projection as the format's library dequantized it."""
    packed = load_file(FIXTURES / f"{fmt}_llama" / "model.safetensors")
    plain = {k: v.float() for k, v in packed.items() if v.is_floating_point() and "proj" not in k}
    plain |= load_file(FIXTURES / f"{fmt}_llama_reference.safetensors")
    out.mkdir(parents=True)
    config = json.loads((FIXTURES / f"{fmt}_llama" / "config.json").read_text())
    config.pop("quantization_config")
    (out / "config.json").write_text(json.dumps(config))
    save_file(plain, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module", params=FORMATS)
def case(request, tmp_path_factory):
    fmt = request.param
    root = tmp_path_factory.mktemp(f"quantized-{fmt}")
    reference = reference_checkpoint(fmt, root / "reference")
    dirs = {
        name: make_peft_adapter(reference, root / name, seed=60 + i, **spec)
        for i, (name, spec) in enumerate(ADAPTERS.items())
    }
    prompts = random_prompts(len(ASSIGNMENT), min_len=4, max_len=14, vocab=VOCAB, seed=9)
    return FIXTURES / f"{fmt}_llama", dirs, prompts, peft_greedy(reference, dirs, prompts)


def peft_greedy(reference: Path, dirs: dict[str, Path], prompts) -> list[list[int]]:
    """Each prompt's greedy tokens from peft over the reference, its adapter alone."""
    hf = load_hf_model(reference)
    hf.generation_config.eos_token_id = None
    config = GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0)
    names = list(dirs)
    model = PeftModel.from_pretrained(hf, dirs[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(dirs[name], adapter_name=name)
    model.eval()

    def run(prompt, adapter):
        ids = torch.tensor([prompt])
        if adapter is None:
            with model.disable_adapter():
                out = model.generate(input_ids=ids, generation_config=config)
        else:
            model.set_adapter(adapter)
            out = model.generate(input_ids=ids, generation_config=config)
        return out[0, len(prompt) :].tolist()

    return [run(p, a) for p, a in zip(prompts, ASSIGNMENT, strict=True)]


def test_mixed_adapter_batch_on_a_published_quantized_base_matches_peft(case):
    checkpoint, dirs, prompts, expected = case
    llm = LLM(checkpoint, dtype="float32", max_loras=len(ADAPTERS))
    for name, path in dirs.items():
        llm.load_adapter(name, path)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outputs = llm.generate(prompts, params, adapters=ASSIGNMENT)
    assert [o.token_ids for o in outputs] == expected
    layer = llm.engine.runner.model.layers[0]
    # the packed levels served (the native kernel where it builds), never a dequantized copy
    assert type(layer.qkv.small).__name__ in ("WqLinear", "QuantizedReference")
    assert (type(layer.qkv.small).__name__ == "WqLinear") == (native_wq() is not None)
    # The adapters matter: base rows differ from adapted rows of the same prompt.
    base = llm.generate(prompts[1:3], params)
    assert [o.token_ids for o in base] != expected[1:3]


def test_the_bf16_engine_runs_a_quantized_base(case):
    checkpoint, dirs, prompts, _ = case
    llm = LLM(checkpoint, dtype="bfloat16", max_loras=1)
    llm.load_adapter("plain", dirs["plain"])
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outputs = llm.generate(prompts[:2], params, adapters=[None, "plain"])
    assert all(len(o.token_ids) == 4 for o in outputs)


@pytest.mark.parametrize("fmt", ["awq", "ct"])
def test_tensor_parallel_shards_are_the_slices_of_the_whole_weight(fmt):
    path = FIXTURES / f"{fmt}_llama"
    config = ModelConfig.from_pretrained(path)
    whole = load_safetensors(path, torch.float32, quantization=config.quantization)
    for rank in range(2):
        shard = Shard(rank, 2)
        select = weight_slicer(config, shard)
        part = load_safetensors(
            path, torch.float32, select=select, quantization=config.quantization
        )
        for name, w in whole.items():
            if not isinstance(w, QuantizedWeight):
                continue
            assert isinstance(part[name], QuantizedWeight)
            dim, span = select(name)
            assert dim in (0, 1)
            full = w.dequantize()
            expected = full[span] if dim == 0 else full[:, span]
            assert torch.equal(part[name].dequantize(), expected), name


def test_tensor_parallelism_refuses_splitting_act_order_inputs():
    path = FIXTURES / "gptq_llama"
    config = ModelConfig.from_pretrained(path)
    select = weight_slicer(config, Shard(0, 2))
    with pytest.raises(
        TensorParallelConfigError, match=r"proj\.weight cannot be split by input features"
    ):
        load_safetensors(path, torch.float32, select=select, quantization=config.quantization)


def test_a_truncated_quantized_checkpoint_is_refused_by_the_missing_tensor(tmp_path):
    shutil.copytree(FIXTURES / "awq_llama", tmp_path / "m")
    weights = load_file(tmp_path / "m" / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.scales"]
    save_file(weights, tmp_path / "m" / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"no model\.layers\.1\.mlp\.up_proj\.scales"):
        LLM(tmp_path / "m", dtype="float32", max_loras=0)


def test_batch_invariance_is_refused_over_a_quantized_checkpoint():
    with pytest.raises(
        InvalidRequestError, match=r"batch_invariant .* published quantized \(awq\)"
    ):
        LLM(FIXTURES / "awq_llama", dtype="float32", max_loras=0, batch_invariant=True)


def test_a_published_checkpoint_is_not_quantized_again_on_load():
    with pytest.raises(ModelLoadError, match=r"published quantized .*drop --quantization"):
        LLM(FIXTURES / "gptq_llama", dtype="float32", quantization="int4")
