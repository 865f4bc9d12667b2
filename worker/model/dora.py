"""DoRA's per-output-feature factor of each adapted projection, from the base weight.

PEFT (``peft.tuners.lora.dora.DoraLinearLayer``) computes a DoRA projection at inference as
``g ⊙ (W x + s · B A x)`` plus the bias, with ``g = magnitude / ‖W + s · B A‖₂`` over each
output feature's row of the adapted weight. ``g`` depends only on the adapter and ``W``, so it is
computed here once per adapter load, from the base weight as the model holds it (the
checkpoint's tensor cast to the model's dtype), in fp32 (PEFT computes it in the model's dtype:
the same numbers in fp32, a closer ``g`` in bf16). The batched LoRA path applies it
(``switchboard_kernels/lora_dora.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from adapters.errors import InvalidAdapterError
from adapters.lora import LoraAdapter, LoraWeights
from adapters.peft_names import canonical_module_key
from worker.model.quantize_on_load import OnLoad
from worker.model.quantized_checkpoints import Reader

DoraFactors = dict[tuple[int, str], torch.Tensor]  # (layer, module) -> g [out] float32


class BaseWeights:
    """The base checkpoint's projection weights, read one at a time on demand (memory-mapped)."""

    def __init__(
        self, model_path: str | Path, dtype: torch.dtype, on_load: OnLoad | None = None
    ) -> None:
        """``on_load``: the base is quantized as it loads; its weights are then the dequantized
        ones (as PEFT dequantizes a quantized layer's weight for DoRA's norm)."""
        self.path = Path(model_path)
        self.dtype = dtype
        self.on_load = on_load
        self._files: dict[str, Path] | None = None  # tensor name -> shard, on first use
        self._quantization: Reader | bool | None = False  # False: not read yet

    def projection(self, layer: int, module: str) -> torch.Tensor:  # [out, in] float32
        """The weight of ``module`` in ``layer`` as the model multiplies by it, widened to fp32
        (a published quantized checkpoint's: dequantized, as PEFT does for DoRA)."""
        prefix = canonical_module_key(layer, module)
        name = f"{prefix}.weight"
        files = self._index()
        if name in files:
            with safe_open(files[name], framework="pt") as f:
                weight = f.get_tensor(name).to(self.dtype)
            if self.on_load is not None:  # each output feature's groups are its own: as fused
                return self.on_load(name, weight).dequantize(torch.float32)
            return weight.float()
        reader = self._reader()
        if reader is not None:
            parts = [f"{prefix}.{n}" for n in reader.tensor_names if f"{prefix}.{n}" in files]
            if parts:
                tensors = {}
                for part in parts:
                    with safe_open(files[part], framework="pt") as f:
                        tensors[part.rsplit(".", 1)[-1]] = f.get_tensor(part)
                return reader.read(prefix, tensors).dequantize(torch.float32)
        raise InvalidAdapterError(f"the base checkpoint has no {name} for DoRA")

    def _reader(self) -> Reader | None:
        """The checkpoint's quantized format's reader, if it has one."""
        if self._quantization is False:
            from worker.model.model_config import ModelConfig

            self._quantization = ModelConfig.from_pretrained(self.path).quantization
        return self._quantization

    def _index(self) -> dict[str, Path]:
        if self._files is None:
            index = self.path / "model.safetensors.index.json"
            if index.is_file():
                weight_map = json.loads(index.read_text())["weight_map"]
                self._files = {name: self.path / file for name, file in weight_map.items()}
            else:
                self._files = {}
                for file in sorted(self.path.glob("*.safetensors")):
                    with safe_open(file, framework="pt") as f:
                        self._files.update(dict.fromkeys(f.keys(), file))
        return self._files


def dora_factors(adapter: LoraAdapter, base: BaseWeights) -> DoraFactors:
    """``g`` of every DoRA module of ``adapter`` (empty for plain LoRA)."""
    factors = {}
    for (layer, module), w in adapter.weights.items():
        if w.magnitude is not None:
            where = canonical_module_key(layer, module)
            factors[(layer, module)] = dora_factor(base.projection(layer, module), w, where)
    return factors


def dora_factor(weight: torch.Tensor, w: LoraWeights, where: str = "") -> torch.Tensor:
    """``magnitude / ‖W + s · B A‖`` per output row; ``weight`` [out, in] fp32 -> [out] fp32.
    An adapted row of norm zero (or a factor past fp32) is refused: PEFT would output NaN."""
    assert w.magnitude is not None
    delta = torch.tensor(w.b) @ torch.tensor(w.a)  # [out, in]: the arrays are read-only
    norm = torch.linalg.vector_norm(weight + w.scaling * delta, dim=1)
    factor = torch.tensor(w.magnitude) / norm
    if not bool(torch.isfinite(factor).all()):
        row = int((~torch.isfinite(factor)).nonzero()[0])
        raise InvalidAdapterError(
            f"DoRA on {where}: the adapted weight's row {row} has norm {float(norm[row])}, "
            "so its magnitude cannot be applied",
            field="lora_magnitude_vector",
        )
    return factor
