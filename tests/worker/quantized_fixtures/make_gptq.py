"""Makes the GPTQ fixtures with GPTQModel itself (not a test; run by hand in a venv with
``torch==2.13.0 transformers accelerate`` and ``gptqmodel==7.7.0 --no-deps`` plus its light
dependencies, see README.md here).

Each projection's scales, zeros and act-order ``g_idx`` come from round-to-nearest over its
groups (act-order: the input features ranked by their calibration activations' mean square, as
GPTQ ranks them, so q/k/v and gate/up share one order); GPTQModel's ``pack_original`` packs them
(its in-memory format is gptq_v2) and ``convert_gptq_v2_to_v1_format_module`` writes the v1 form.
The reference is the library's own reading back: a fresh ``TorchLinear`` loads the saved tensors,
converts v1 to v2 (``convert_gptq_v1_to_v2_format_module``) and ``dequantize_weight``s, with the
fp16 scales as stored widened to fp32 (exactly), so the reference is the exact product.
``gptq_layers`` covers 4 and 8 bits, groups of 32 and
per channel, act-order, symmetric or not, v1 and v2, and a v1 zero of 0 (whose stored minus one
borrows from the next field); ``gptq_llama/`` is the tiny Llama (4 bits, groups of 32, act-order,
asymmetric, v1) beside ``gptq_llama_reference.safetensors`` (its projections as the library
dequantizes them).
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import torch
from gptqmodel.nn_modules.qlinear.torch import TorchLinear
from gptqmodel.utils.model import (
    convert_gptq_v1_to_v2_format_module,
    convert_gptq_v2_to_v1_format_module,
)
from safetensors.torch import save_file
from tiny import projections, save_reference, tiny_llama

LAYERS = {  # name -> (bits, group size, act-order, symmetric, checkpoint format)
    "b4_g32_v1_asym": (4, 32, False, False, "gptq"),
    "b4_g32_v1_sym_act": (4, 32, True, True, "gptq"),
    "b4_ch_v2_asym": (4, -1, False, False, "gptq_v2"),
    "b4_g32_v2_asym_act": (4, 32, True, False, "gptq_v2"),
    "b8_g32_v1_asym_act": (8, 32, True, False, "gptq"),
    "b8_ch_v2_sym": (8, -1, False, True, "gptq_v2"),
    "b4_g32_v1_zero0": (4, 32, False, False, "gptq"),
}


def qparams(w: torch.Tensor, g_idx: torch.Tensor, groups: int, bits: int, sym: bool):
    """Round-to-nearest scales and zeros [out, groups] over each group's input features."""
    maxq = 2**bits - 1
    scales, zeros = [], []
    for g in range(groups):
        cols = w[:, g_idx == g]
        low, high = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
        if sym:
            high = torch.maximum(low.abs(), high)
            scale = (2 * high / maxq).clamp(min=1e-8)
            zero = torch.full_like(scale, (maxq + 1) / 2)
        else:
            scale = ((high - low) / maxq).clamp(min=1e-8)
            zero = torch.round(-low / scale)
        scales.append(scale)
        zeros.append(zero)
    return torch.stack(scales, 1), torch.stack(zeros, 1)


def pack(linear: torch.nn.Linear, spec, ranking: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The library's tensors for ``linear`` as a checkpoint of ``spec`` stores them."""
    bits, group_size, act_order, sym, fmt = spec
    out_features, in_features = linear.weight.shape
    size = in_features if group_size == -1 else group_size
    if act_order:
        perm = torch.argsort(ranking, descending=True, stable=True)
        g_idx = torch.empty(in_features, dtype=torch.int32)
        g_idx[perm] = (torch.arange(in_features) // size).to(torch.int32)
    else:
        g_idx = (torch.arange(in_features) // size).to(torch.int32)
    scales, zeros = qparams(linear.weight.data.float(), g_idx, in_features // size, bits, sym)
    scales = scales.half().float()  # stored in fp16: quantize against what is stored
    q = TorchLinear(bits, group_size, sym, act_order, in_features, out_features, bias=False)
    q.pack_original(linear, scales, zeros.to(torch.int32), g_idx)
    if fmt == "gptq":
        config = types.SimpleNamespace(bits=bits, pack_dtype=torch.int32)
        convert_gptq_v2_to_v1_format_module(q, config)
    return {"qweight": q.qweight, "qzeros": q.qzeros, "scales": q.scales, "g_idx": q.g_idx}


def dequantized(t: dict[str, torch.Tensor], spec, dtype: torch.dtype) -> torch.Tensor:
    """The library's weight [out, in] read back from the saved tensors (scales in ``dtype``)."""
    bits, group_size, act_order, sym, fmt = spec
    in_features, out_features = t["g_idx"].shape[0], t["scales"].shape[1]
    q = TorchLinear(bits, group_size, sym, act_order, in_features, out_features, bias=False)
    for name in ("qweight", "qzeros", "g_idx"):
        getattr(q, name).data = t[name].clone()
    q.scales.data = t["scales"].to(dtype)
    if fmt == "gptq":
        convert_gptq_v1_to_v2_format_module(q, bits, torch.int32)
    q.post_init()
    return q.dequantize_weight().t().contiguous()


def layers(out: Path) -> None:
    torch.manual_seed(2)
    packed, reference = {}, {}
    for name, spec in LAYERS.items():
        linear = torch.nn.Linear(64, 32, bias=False)
        if name.endswith("zero0"):  # a group of non-negative weights: zero 0
            linear.weight.data[:, :32] = linear.weight.data[:, :32].abs()
        t = pack(linear, spec, torch.rand(64))
        packed |= {f"{name}.{k}": v.contiguous() for k, v in t.items()}
        reference[name] = dequantized(t, spec, torch.float32)
    save_file(packed, out / "gptq_layers.safetensors")
    save_file(reference, out / "gptq_layers_reference.safetensors")
    (out / "gptq_layers.json").write_text(json.dumps(LAYERS, indent=1))


def llama(out: Path) -> None:
    model = tiny_llama()
    spec = (4, 32, True, False, "gptq")
    linears = projections(model)
    ranking: dict[str, torch.Tensor] = {}  # mean square of each projection's inputs

    def hook(name):
        def record(module, args, output):
            ranking[name] = args[0].float().square().mean((0, 1))

        return record

    handles = [m.register_forward_hook(hook(n)) for n, m in linears.items()]
    with torch.no_grad():
        model(torch.randint(3, 96, (4, 32)))
    for h in handles:
        h.remove()
    packed, reference = {}, {}
    for name, linear in linears.items():
        t = pack(linear, spec, ranking[name])
        packed |= {f"{name}.{k}": v.contiguous() for k, v in t.items()}
        reference[name] = dequantized(t, spec, torch.float32)
    state = {k: v for k, v in model.state_dict().items() if k.rsplit(".", 1)[0] not in linears}
    (out / "gptq_llama").mkdir(exist_ok=True)
    model.config.save_pretrained(out / "gptq_llama")
    config = json.loads((out / "gptq_llama" / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": False,
        "checkpoint_format": "gptq", "true_sequential": True, "static_groups": False,
    }  # fmt: skip
    (out / "gptq_llama" / "config.json").write_text(json.dumps(config, indent=1))
    save_file(
        {k: v.contiguous() for k, v in (state | packed).items()},
        out / "gptq_llama" / "model.safetensors",
        metadata={"format": "pt"},
    )
    save_reference(model, reference, out / "gptq_llama_reference.safetensors")


if __name__ == "__main__":
    target = Path(sys.argv[1])
    layers(target)
    llama(target)
