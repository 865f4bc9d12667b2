"""The published quantized formats' readers, against each format's own library: every served
option's weight equals the library's dequantization of the same bytes exactly (the fixtures in
``quantized_fixtures/`` were packed and dequantized by GPTQModel, AutoAWQ and compressed-tensors),
each option not served is refused by name, and a malformed checkpoint is refused precisely."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from switchboard_kernels.quantized_weight import quantize
from worker.errors import ModelLoadError, TensorParallelConfigError
from worker.model.model_config import ModelConfig
from worker.model.quantized_checkpoints import read_quantized, shard_quantized
from worker.model.quantized_checkpoints.awq import AwqReader
from worker.model.quantized_checkpoints.compressed_tensors import CompressedTensorsReader
from worker.model.quantized_checkpoints.gptq import GptqReader
from worker.model.quantized_checkpoints.packing import pack_int32, unpack_int32

FIXTURES = Path(__file__).parent / "quantized_fixtures"
GPTQ_LAYERS = json.loads((FIXTURES / "gptq_layers.json").read_text())
AWQ = {"quant_method": "awq", "bits": 4, "version": "gemm", "zero_point": True}
CT_CONFIG = json.loads((FIXTURES / "ct_layers_config.json").read_text())["quantization_config"]
CT_LAYERS = sorted(g["targets"][0] for g in CT_CONFIG["config_groups"].values())


def module_tensors(path: Path, module: str) -> dict[str, torch.Tensor]:
    return {k.split(".", 1)[1]: v for k, v in load_file(path).items() if k.startswith(module + ".")}


def gptq_reader(bits, group_size, act_order, sym, fmt) -> GptqReader:
    config = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "sym": sym}
    return GptqReader.from_config(config | {"desc_act": act_order, "checkpoint_format": fmt})


@pytest.mark.parametrize("layer", sorted(GPTQ_LAYERS))
def test_gptq_weight_is_gptqmodels_dequantization(layer):
    spec = GPTQ_LAYERS[layer]
    q = gptq_reader(*spec).read(layer, module_tensors(FIXTURES / "gptq_layers.safetensors", layer))
    reference = load_file(FIXTURES / "gptq_layers_reference.safetensors")[layer]
    assert torch.equal(q.dequantize(), reference)
    assert q.bits == spec[0] and (q.input_order is not None) == spec[2]


@pytest.mark.parametrize("group_size", [16, 32, 64])
def test_awq_weight_is_autoawqs_dequantization(group_size):
    name = f"group{group_size}"
    reader = AwqReader.from_config(AWQ | {"group_size": group_size})
    q = reader.read(name, module_tensors(FIXTURES / "awq_layers.safetensors", name))
    assert torch.equal(
        q.dequantize(), load_file(FIXTURES / "awq_layers_reference.safetensors")[name]
    )


@pytest.mark.parametrize("layer", CT_LAYERS)
def test_compressed_tensors_weight_is_its_decompressors(layer):
    q = CompressedTensorsReader.from_config(CT_CONFIG).read(
        layer, module_tensors(FIXTURES / "ct_layers.safetensors", layer)
    )
    reference = load_file(FIXTURES / "ct_layers_reference.safetensors")[f"{layer}.weight"]
    # The library computes in the scales' dtype (bf16): the exact product rounded once.
    assert torch.equal(q.dequantize().to(reference.dtype), reference)
    assert q.bits == int(layer[3]) and q.group_size == (
        q.shape[1] if "channel" in layer else q.group_size
    )


def test_pack_int32_round_trips_and_matches_the_libraries_word_layout():
    levels = torch.randint(0, 16, (6, 16), dtype=torch.uint8)
    words = pack_int32(levels, 4, 1)
    assert words.dtype == torch.int32 and words.shape == (6, 2)
    assert torch.equal(unpack_int32(words, 4, 1), levels)
    assert int(words[0, 0]) & 0xF == int(levels[0, 0])  # the first level in the lowest bits
    assert torch.equal(unpack_int32(pack_int32(levels.t(), 8, 0), 8, 0), levels.t())


# -- refusals by name ---------------------------------------------------------------------------

LLAMA = {
    "model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
    "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "hidden_act": "silu",
}  # fmt: skip
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True}
CT_GROUP = {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": True,
            "strategy": "group", "group_size": 32}}  # fmt: skip
CT = {"quant_method": "compressed-tensors", "format": "pack-quantized",
      "quantization_status": "compressed", "config_groups": {"group_0": CT_GROUP}}  # fmt: skip


def ct_with(**weights) -> dict:
    return CT | {"config_groups": {"g": CT_GROUP | {"weights": CT_GROUP["weights"] | weights}}}


@pytest.mark.parametrize(
    ("quantization", "named"),
    [
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
        ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "'fp8'"),
        ({"quant_method": "hqq"}, "'hqq'"),
        ({"bits": 4}, "'unknown'"),
        (GPTQ | {"bits": 3}, "GPTQ with bits=3"),
        (GPTQ | {"bits": 2}, "GPTQ with bits=2"),
        (GPTQ | {"checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
        (GPTQ | {"is_marlin_format": True}, "'marlin'"),
        (GPTQ | {"checkpoint_format": "bitblas"}, "'bitblas'"),
        (GPTQ | {"lm_head": True}, "quantized lm_head"),
        (GPTQ | {"dynamic": {"-:.*down": {}}}, "dynamic"),
        (GPTQ | {"pack_dtype": "int16"}, "pack_dtype"),
        (GPTQ | {"group_size": 0}, "group_size 0"),
        (AWQ | {"version": "gemv"}, "version 'gemv'"),
        (AWQ | {"version": "gemv_fast"}, "version 'gemv_fast'"),
        (AWQ | {"version": "marlin"}, "version 'marlin'"),
        (AWQ | {"version": "exllama"}, "version 'exllama'"),
        (AWQ | {"backend": "llm-awq"}, "backend 'llm-awq'"),
        (AWQ | {"zero_point": False}, "zero_point"),
        (AWQ | {"bits": 8}, "AWQ with bits=8"),
        (CT | {"format": "float-quantized"}, "format 'float-quantized'"),
        (CT | {"format": "int-quantized"}, "format 'int-quantized'"),
        (CT | {"format": "nvfp4-pack-quantized"}, "format 'nvfp4-pack-quantized'"),
        (CT | {"kv_cache_scheme": {"num_bits": 8, "type": "float"}}, "kv_cache_scheme"),
        (CT | {"quantization_status": "frozen"}, "quantization_status 'frozen'"),
        (CT | {"sparsity_config": {"format": "sparse-24-bitmask"}}, "sparsity"),
        (CT | {"transform_config": {"config_groups": {"u": {}}}}, "transform"),
        (ct_with(type="float", num_bits=8), "float weights"),
        (ct_with(num_bits=2), "num_bits=2"),
        (ct_with(strategy="tensor"), "strategy 'tensor'"),
        (ct_with(strategy="block"), "strategy 'block'"),
        (ct_with(dynamic=True), "dynamic"),
        (ct_with(actorder="group"), "actorder 'group'"),
        (
            CT | {"config_groups": {"g": CT_GROUP | {"input_activations": {"num_bits": 8}}}},
            "input_activations quantization",
        ),
    ],
)
def test_a_quantization_not_served_is_refused_by_name(tmp_path, quantization, named):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA | {"quantization_config": quantization}))
    with pytest.raises(ModelLoadError, match=named):
        ModelConfig.from_pretrained(tmp_path)


def test_a_served_quantization_is_read_into_the_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA | {"quantization_config": GPTQ}))
    reader = ModelConfig.from_pretrained(tmp_path).quantization
    assert reader == GptqReader(bits=4, group_size=32, v2=False)


# -- malformed checkpoints ----------------------------------------------------------------------

GOOD = "b4_g32_v1_sym_act"


def gptq_tensors() -> dict[str, torch.Tensor]:
    return module_tensors(FIXTURES / "gptq_layers.safetensors", GOOD)


def test_a_missing_tensor_is_named():
    tensors = gptq_tensors()
    del tensors["scales"]
    with pytest.raises(ModelLoadError, match=f"no {GOOD}.scales"):
        gptq_reader(*GPTQ_LAYERS[GOOD]).read(GOOD, tensors)


@pytest.mark.parametrize(
    ("name", "bad", "named"),
    [
        ("scales", lambda t: t[:, :16], r"scales is float16 \[2, 16\], expected"),
        ("qzeros", lambda t: t.to(torch.int64), "qzeros is int64"),
        ("qweight", lambda t: t[:4], r"qzeros is int32 \[2, 4\], expected int32 \[1, 4\]"),
        ("scales", lambda t: -t, "negative scales"),
        ("scales", lambda t: t * float("inf"), "non-finite"),
        ("g_idx", lambda t: t + 5, "g_idx names groups outside 0..1"),
        ("g_idx", lambda t: torch.zeros_like(t), "g_idx groups are not all of 32"),
    ],
)
def test_malformed_gptq_tensors_are_refused_precisely(name, bad, named):
    tensors = gptq_tensors()
    tensors[name] = bad(tensors[name])
    with pytest.raises(ModelLoadError, match=named):
        gptq_reader(*GPTQ_LAYERS[GOOD]).read(GOOD, tensors)


def test_malformed_compressed_tensors_are_refused_precisely():
    layer = "int4_group_asym"
    reader = CompressedTensorsReader.from_config(CT_CONFIG)
    tensors = module_tensors(FIXTURES / "ct_layers.safetensors", layer)
    with pytest.raises(ModelLoadError, match="weight_shape must be two positive integers"):
        reader.read(layer, tensors | {"weight_shape": torch.tensor([20, -64])})
    with pytest.raises(
        ModelLoadError, match=r"packed is int32 \[20, 8\], expected int32 \[20, 12\]"
    ):
        reader.read(layer, tensors | {"weight_shape": torch.tensor([20, 96])})
    missing = {k: v for k, v in tensors.items() if k != "weight_zero_point"}
    with pytest.raises(ModelLoadError, match=f"no {layer}.weight_zero_point"):
        reader.read(layer, missing)


def test_an_unquantized_part_beside_quantized_ones_and_a_quantized_embedding_are_refused():
    reader = gptq_reader(*GPTQ_LAYERS["b4_g32_v1_asym"])
    tensors = gptq_tensors()
    both = {f"lm_head.{k}": v for k, v in tensors.items()}
    with pytest.raises(ModelLoadError, match="quantized lm_head is not served"):
        read_quantized(both, reader)
    twice = {f"m.{k}": v for k, v in tensors.items()} | {"m.weight": torch.zeros(32, 64)}
    with pytest.raises(ModelLoadError, match="m has both a weight and gptq tensors"):
        read_quantized(twice, reader)


def test_a_per_channel_weight_splits_by_any_input_columns():
    q = quantize(torch.randn(8, 48), bits=4, group_size=48, symmetric=False)
    part = shard_quantized(q, "m.weight", 1, slice(24, 48))
    assert torch.equal(part.dequantize(), q.dequantize()[:, 24:48])
    grouped = quantize(torch.randn(8, 48), bits=4, group_size=16, symmetric=True)
    with pytest.raises(TensorParallelConfigError, match="split a group of 16"):
        shard_quantized(grouped, "m.weight", 1, slice(0, 24))
