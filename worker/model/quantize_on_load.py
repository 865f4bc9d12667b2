"""Quantizing a bf16/fp32 base on load (``--quantization int4|int8``): each projection's weight
rounded to nearest into a ``QuantizedWeight`` as the model is built, which the native kernels
stream (``switchboard_kernels/wq_cpu.c``).

Weight-only: activations stay unrounded and sums fp32, so outputs are exact up to the weights'
rounding (as transformers and PEFT compute over a dequantized layer), unlike a draft model's
approximate copies (``Linear``'s ``quantization``, which also round the activations).

Defaults (docs/quantization.md, measured there): int4 asymmetric in groups of 32 input
features, each group's levels from its minimum to its maximum (a float zero): 16 levels cannot
follow a whole row's outliers, 32 divides every hidden size of the served families (128 does not
divide SmolLM2's 576), and it is llama.cpp's block, so a checkpoint dequantized from a 4-bit
GGUF (the default model) comes back exactly; int8 symmetric per output channel (255 levels hold
a row's range, no zero to store per group). The output layer stays unquantized unless asked
(``lm_head``: "int8" or "int4", with that method's defaults): its logits carry the sampler's
decisions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from switchboard_kernels.quantized_weight import QuantizedWeight, quantize
from worker.errors import InvalidRequestError, ModelLoadError

if TYPE_CHECKING:
    from worker.core.config import EngineConfig

METHODS = {"int4": 4, "int8": 8}
DEFAULT_GROUP_SIZE = {"int4": 32, "int8": None}  # None: per output channel
SYMMETRIC = {"int4": False, "int8": True}
PER_CHANNEL = -1  # a group size meaning one group per output channel (GPTQ's convention)


@dataclass(frozen=True, slots=True)
class OnLoad:
    """How a base's projections are quantized as they load."""

    method: str  # "int4" or "int8"
    group_size: int | None  # input features per scale and zero; None: per output channel
    lm_head: str | None = None  # the output layer's method ("int8", "int4"), None: as loaded

    @classmethod
    def of(
        cls, method: str | None, group_size: int | None = None, *, lm_head: str | None = None
    ) -> OnLoad | None:
        """The engine options' spec (None: no quantization); bad values refused by name."""
        if method is None:
            if group_size is not None or lm_head:
                raise ValueError(
                    "quantization_group_size and quantization_lm_head need "
                    "quantization (int4 or int8)"
                )
            return None
        for name, value in (("quantization", method), ("quantization_lm_head", lm_head)):
            if value is not None and value not in METHODS:
                raise ValueError(f"{name} must be one of {sorted(METHODS)}, got {value!r}")
        if group_size is None:
            group_size = DEFAULT_GROUP_SIZE[method]
        elif group_size == PER_CHANNEL:
            group_size = None
        elif isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ValueError(
                f"quantization_group_size must be a positive number of input features or "
                f"{PER_CHANNEL} (per channel), got {group_size!r}"
            )
        return cls(method, group_size, lm_head)

    @property
    def bits(self) -> int:
        return METHODS[self.method]

    def __call__(self, name: str, weight: torch.Tensor | QuantizedWeight) -> QuantizedWeight:
        """``weight`` [out, in] rounded to nearest (``name``: the tensor, for errors)."""
        if isinstance(weight, QuantizedWeight):
            raise ModelLoadError(
                f"{name} is quantized in the checkpoint already: --quantization applies to "
                f"bf16/fp32 checkpoints"
            )
        in_features = weight.shape[1]
        group = in_features if self.group_size is None else self.group_size
        if in_features % group:
            raise ModelLoadError(
                f"{name}: {in_features} input features are not whole groups of {group}; "
                f"choose a quantization_group_size that divides them (or {PER_CHANNEL}: per "
                f"channel)"
            )
        # asymmetric: each group's own min to max (a float zero); symmetric: zero 2**(bits - 1)
        return quantize(
            weight,
            bits=self.bits,
            group_size=group,
            symmetric=SYMMETRIC[self.method],
            integer_zero=False,
            fp16_params=True,  # 2-byte scales and zeros in the kernel: a sixth fewer bytes at int4
        )


def output_layer(
    on_load: OnLoad | None, name: str, weight: torch.Tensor
) -> torch.Tensor | QuantizedWeight:
    """The output layer's weight as the model multiplies by it: quantized by ``on_load.lm_head``'s
    method with its defaults where set, else as loaded."""
    if on_load is None or on_load.lm_head is None:
        return weight
    head = OnLoad.of(on_load.lm_head)
    assert head is not None
    return head(name, weight)


def quantized(
    on_load: OnLoad | None, name: str, weight: torch.Tensor
) -> torch.Tensor | QuantizedWeight:
    """``weight`` as the model multiplies by it: quantized where ``on_load`` says so."""
    return weight if on_load is None else on_load(name, weight)


def base_on_load(config: EngineConfig) -> OnLoad | None:
    """The engine config's quantization on load, or None; refused with ``batch_invariant``
    (the kernels' sums follow their row tiles)."""
    on_load = OnLoad.of(
        config.quantization, config.quantization_group_size, lm_head=config.quantization_lm_head
    )
    if on_load is None:
        return None
    if config.batch_invariant:
        raise InvalidRequestError("quantization is not served with batch_invariant")
    return on_load
