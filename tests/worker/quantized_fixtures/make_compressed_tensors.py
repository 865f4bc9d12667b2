"""Makes the compressed-tensors fixtures with compressed-tensors itself (not a test; run by hand
in a venv with ``torch==2.13.0 compressed-tensors==0.20.1 transformers``, see README.md here).

``ct_layers.safetensors``: Linear layers of every served scheme, compressed by the library
(``ModelCompressor.compress_model``, pack-quantized, bf16 scales), and ``ct_layers_reference``
each layer's weight as the library's decompressor (``PackedQuantizationCompressor.decompress``)
gives it back from the saved file. ``ct_llama/``: a tiny Llama compressed W4A16 (asymmetric,
groups of 32) and ``ct_llama_reference.safetensors`` its projections as the library decompresses
them (fp32). (transformers 5.25's own loader refuses asymmetric
pack-quantized checkpoints of compressed-tensors 0.20.1: it expects unpacked zero points.)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from compressed_tensors.compressors.model_compressors.model_compressor import ModelCompressor
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    apply_quantization_config,
)
from compressed_tensors.quantization.utils.helpers import calculate_qparams
from safetensors.torch import load_file, save_file
from tiny import PROJECTIONS, save_reference, tiny_llama

SCHEMES = {  # layer name -> (bits, symmetric, group size or None: per channel)
    "int4_group_asym": (4, False, 32),
    "int4_channel_sym": (4, True, None),
    "int8_group_sym": (8, True, 32),
    "int8_channel_asym": (8, False, None),
    "int4_group_sym": (4, True, 16),
}


def args(bits: int, symmetric: bool, group: int | None) -> QuantizationArgs:
    strategy = "group" if group else "channel"
    return QuantizationArgs(
        num_bits=bits, type="int", symmetric=symmetric, strategy=strategy, group_size=group
    )


def calibrate(model: torch.nn.Module) -> None:
    """Round-to-nearest qparams from each weight's range, computed by the library."""
    for module in model.modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None:
            continue
        a = scheme.weights
        w = module.weight.detach().float()
        group = a.group_size or w.shape[1]
        g = w.view(w.shape[0], -1, group)
        scale, zp = calculate_qparams(g.amin(-1), g.amax(-1), a)
        module.weight_scale.data.copy_(scale.to(module.weight_scale.dtype))
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zp.to(module.weight_zero_point.dtype))


def compress(model: torch.nn.Module, groups: dict, ignore: list[str]) -> ModelCompressor:
    config = QuantizationConfig(config_groups=groups, ignore=ignore)
    apply_quantization_config(model, config)
    calibrate(model)
    compressor = ModelCompressor.from_pretrained_model(model, "pack-quantized")
    compressor.compress_model(model)
    return compressor


def decompress_file(path: Path, compressor: ModelCompressor, schemes: dict) -> dict:
    """Every module of the saved file decompressed by the library: ``module.weight``."""
    state = load_file(path)
    modules = {k.rsplit(".", 1)[0] for k in state if k.endswith(".weight_packed")}
    out = {k: v for k, v in state.items() if k.rsplit(".", 1)[0] not in modules}
    for m in sorted(modules):
        part = {k.rsplit(".", 1)[1]: v for k, v in state.items() if k.rsplit(".", 1)[0] == m}
        scheme = schemes.get(m) or schemes["*"]
        out[f"{m}.weight"] = PackedQuantizationCompressor.decompress(part, scheme)["weight"]
    return out


def layers(out: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Module()
    for name in SCHEMES:
        model.add_module(name, torch.nn.Linear(64, 20, bias=False, dtype=torch.bfloat16))
    groups = {
        f"group_{i}": QuantizationScheme(targets=[name], weights=args(*scheme))
        for i, (name, scheme) in enumerate(SCHEMES.items())
    }
    compressor = compress(model, groups, [])
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, out / "ct_layers.safetensors")
    config = {"quantization_config": compressor.quantization_config.model_dump()}
    (out / "ct_layers_config.json").write_text(json.dumps(config, indent=1, default=str))
    schemes = {n: groups[f"group_{i}"] for i, n in enumerate(SCHEMES)}
    decompressed = decompress_file(out / "ct_layers.safetensors", compressor, schemes)
    reference = {f"{n}.weight": decompressed[f"{n}.weight"].contiguous() for n in SCHEMES}
    save_file(reference, out / "ct_layers_reference.safetensors")


def llama(out: Path) -> None:
    model = tiny_llama()
    groups = {"group_0": QuantizationScheme(targets=["Linear"], weights=args(4, False, 32))}
    compressor = compress(model, groups, ["lm_head"])
    model.save_pretrained(out / "ct_llama")
    compressor.update_config(out / "ct_llama")
    schemes = groups | {"*": groups["group_0"]}
    state = decompress_file(out / "ct_llama" / "model.safetensors", compressor, schemes)
    modules = {k.rsplit(".", 1)[0] for k in state if k.rsplit(".", 2)[-2] in PROJECTIONS}
    reference = {m: state[f"{m}.weight"] for m in modules}
    save_reference(model, reference, out / "ct_llama_reference.safetensors")


if __name__ == "__main__":
    target = Path(sys.argv[1])
    layers(target)
    llama(target)
