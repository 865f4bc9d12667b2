"""Makes the AWQ fixtures with AutoAWQ itself (not a test; run by hand in a venv with
``torch==2.13.0 transformers accelerate`` and ``autoawq==0.2.9 --no-deps``, see README.md here).

AutoAWQ's own round-to-nearest (``AwqQuantizer.pseudo_quantize_tensor``, zero points) gives each
projection's scales and zeros, its ``WQLinear_GEMM.from_linear`` packs them (GEMM, the
interleaved nibble order), and its ``dequantize_gemm`` is the reference: ``awq_layers`` (layers of
several group sizes, fp16 scales as AutoAWQ stores them) beside ``awq_layers_reference`` (the
library's dequantization, the scales widened to fp32 exactly), and ``awq_llama/`` (the tiny Llama,
groups of 32) beside ``awq_llama_reference.safetensors`` (its projections as the library
dequantizes them). AutoAWQ's package imports ``datasets`` for calibration data, which
round-to-nearest does not use: a stand-in module satisfies the import.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.modules.setdefault("datasets", types.SimpleNamespace(load_dataset=None))
from awq.modules.linear.gemm import WQLinear_GEMM  # noqa: E402
from awq.quantize.quantizer import AwqQuantizer  # noqa: E402
from awq.utils.packing_utils import dequantize_gemm  # noqa: E402
from tiny import projections, save_reference, tiny_llama  # noqa: E402

CONFIG = {"quant_method": "awq", "bits": 4, "version": "gemm", "zero_point": True}


def pack(linear: torch.nn.Linear, group_size: int) -> dict[str, torch.Tensor]:
    """The library's qweight, qzeros and scales of ``linear`` (its weight pseudo-quantized first,
    as AutoAWQ's quantizer does before packing)."""
    quantizer = types.SimpleNamespace(group_size=group_size, zero_point=True, w_bit=4)
    w, scales, zeros = AwqQuantizer.pseudo_quantize_tensor(quantizer, linear.weight.data.float())
    linear.weight.data = w.to(linear.weight.dtype)
    q = WQLinear_GEMM.from_linear(linear, 4, group_size, False, scales.t(), zeros.t())
    return {"qweight": q.qweight, "qzeros": q.qzeros, "scales": q.scales}


def dequantized(t: dict[str, torch.Tensor], group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """The library's weight [out, in]: ``dequantize_gemm`` with the scales in ``dtype``."""
    w = dequantize_gemm(t["qweight"], t["qzeros"], t["scales"].to(dtype), 4, group_size)
    return w.t().contiguous()


def layers(out: Path) -> None:
    torch.manual_seed(1)
    packed, reference = {}, {}
    for group_size in (16, 32, 64):
        name = f"group{group_size}"
        t = pack(torch.nn.Linear(64, 32, bias=False), group_size)
        packed |= {f"{name}.{k}": v.contiguous() for k, v in t.items()}
        reference[name] = dequantized(t, group_size, torch.float32)
    save_file(packed, out / "awq_layers.safetensors")
    save_file(reference, out / "awq_layers_reference.safetensors")


def llama(out: Path) -> None:
    model = tiny_llama()
    group_size = 32
    packed, reference = {}, {}
    for name, linear in projections(model).items():
        t = pack(linear, group_size)
        packed |= {f"{name}.{k}": v.contiguous() for k, v in t.items()}
        reference[name] = dequantized(t, group_size, torch.float32)
    state = {
        k: v.contiguous()
        for k, v in model.state_dict().items()
        if k.rsplit(".", 1)[0] not in projections(model)
    }
    (out / "awq_llama").mkdir(exist_ok=True)
    model.config.save_pretrained(out / "awq_llama")
    config = json.loads((out / "awq_llama" / "config.json").read_text())
    config["quantization_config"] = CONFIG | {"group_size": group_size}
    (out / "awq_llama" / "config.json").write_text(json.dumps(config, indent=1))
    save_file(state | packed, out / "awq_llama" / "model.safetensors", metadata={"format": "pt"})
    save_reference(model, reference, out / "awq_llama_reference.safetensors")


if __name__ == "__main__":
    target = Path(sys.argv[1])
    layers(target)
    llama(target)
