"""PEFT's tensor names ↔ (layer, projection, A, B or DoRA's magnitude).

PEFT saves `base_model.model.<module name>.lora_A.weight` ([r, in]) and `...lora_B.weight`
([out, r]), and for DoRA `...lora_magnitude_vector` ([out]), where `<module name>` is the name
in the model PEFT wrapped: for a `LlamaForCausalLM`, `model.layers.3.self_attn.q_proj`.
Anything else in the file is either a feature we refuse by name (modules_to_save,
embedding/lm_head LoRA, biases) or not a LoRA adapter at all.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from adapters.base_model import ALL_PROJECTIONS, MODULE_PARENTS
from adapters.errors import (
    IncompatibleAdapterError,
    InvalidAdapterError,
    UnsupportedAdapterFeatureError,
)

WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."

Side = Literal["A", "B", "M"]  # M: DoRA's magnitude vector

_LORA_WEIGHT = re.compile(r"(?P<key>.+)\.(?:lora_(?P<side>[AB])\.weight|lora_magnitude_vector)")
# Module names of a Llama-family decoder projection, wrapped as a CausalLM or as the bare model.
_PROJECTION_KEY = re.compile(
    r"(?:model\.)?layers\.(?P<layer>\d+)\.(?P<parent>[A-Za-z0-9_]+)\.(?P<module>[A-Za-z0-9_]+)"
)


@dataclass(frozen=True, slots=True)
class LoraTensorName:
    """One LoRA tensor's place: `key` is the module name PEFT matched its config against."""

    key: str  # e.g. "model.layers.3.self_attn.q_proj"
    layer: int
    module: str  # a key of ALL_PROJECTIONS
    side: Side  # A, B, or M for DoRA's lora_magnitude_vector


def parse_tensor_name(name: str) -> LoraTensorName:
    """Map a PEFT tensor name to its projection, or raise naming the tensor and why."""
    if not name.startswith(PEFT_PREFIX):
        raise InvalidAdapterError(
            f"tensor {name!r} does not start with {PEFT_PREFIX!r}: not a PEFT adapter state dict",
            field=name,
        )
    rest = name.removeprefix(PEFT_PREFIX)
    segments = rest.split(".")
    _refuse_unsupported_tensor(name, rest, segments)
    match = _LORA_WEIGHT.fullmatch(rest)
    if match is None:
        raise InvalidAdapterError(
            f"tensor {name!r} is not a LoRA weight (expected "
            f"{PEFT_PREFIX}model.layers.<i>.<self_attn|mlp>.<proj>.lora_<A|B>.weight)",
            field=name,
        )
    key = match.group("key")
    projection = _PROJECTION_KEY.fullmatch(key)
    if projection is None or ALL_PROJECTIONS.get(projection.group("module")) != projection.group(
        "parent"
    ):
        expected = ", ".join(f"{parent}.{module}" for module, parent in ALL_PROJECTIONS.items())
        raise IncompatibleAdapterError(
            f"tensor {name!r} is for module {key!r}, which no served base model "
            f"has (LoRA is served on model.layers.<i>.{{{expected}}})",
            field=name,
        )
    found = match.group("side")  # None: the magnitude vector
    side: Side = "M" if found is None else "A" if found == "A" else "B"
    return LoraTensorName(key, int(projection.group("layer")), projection.group("module"), side)


def canonical_module_key(layer: int, module: str) -> str:
    """The module's name in a `LlamaForCausalLM`, as stored adapters spell it (for an expert
    tensor, the parameter's name: `model.layers.0.mlp.experts.gate_up_proj`)."""
    return f"model.layers.{layer}.{MODULE_PARENTS[module]}.{module}"


def canonical_tensor_name(layer: int, module: str, side: Side) -> str:
    if side == "M":
        return f"{PEFT_PREFIX}{canonical_module_key(layer, module)}.lora_magnitude_vector"
    return f"{PEFT_PREFIX}{canonical_module_key(layer, module)}.lora_{side}.weight"


def _refuse_unsupported_tensor(name: str, rest: str, segments: list[str]) -> None:
    def refuse(what: str, field: str) -> UnsupportedAdapterFeatureError:
        return UnsupportedAdapterFeatureError(f"tensor {name!r}: {what} is not served", field=field)

    if "modules_to_save" in segments or "original_module" in segments:
        raise refuse("a fully trained module copy (modules_to_save)", "modules_to_save")
    if (
        "embed_tokens" in segments
        or "lm_head" in segments
        or "lora_embedding_A" in segments
        or ("lora_embedding_B" in segments)
    ):
        raise refuse("LoRA on the embedding or lm_head", "target_modules")
    if rest.endswith((".lora_A.bias", ".lora_B.bias")):
        raise refuse("a LoRA bias (lora_bias)", "lora_bias")
    if rest.endswith(".bias"):
        raise refuse("a trained base-layer bias (bias != 'none')", "bias")
