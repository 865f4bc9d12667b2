"""Checks that decide whether an adapter's tensors can be served on this base model.

All of them run on the safetensors header alone (names, dtypes, shapes), before any tensor is
read, except `check_finite`, which needs the values. Each error names the tensor or field and,
for shapes, what was expected against what was found.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from adapters.base_model import BaseModelSpec
from adapters.errors import (
    AdapterTooLargeError,
    IncompatibleAdapterError,
    InvalidAdapterError,
    UnsupportedAdapterFeatureError,
)
from adapters.peft_config import CONFIG_FILE, AdapterConfig
from adapters.peft_names import PEFT_PREFIX, LoraTensorName, parse_tensor_name
from adapters.safetensors_io import TensorInfo


@dataclass(frozen=True, slots=True)
class ModuleTensors:
    """The lora_A / lora_B pair of one projection (and DoRA's magnitude), still unread."""

    key: str  # module name as PEFT saw it, e.g. "model.layers.0.self_attn.q_proj"
    layer: int
    module: str
    a: TensorInfo  # [r, in_features] ([experts * r, in] on MoE experts)
    b: TensorInfo  # [out_features, r] ([out, r * experts] on MoE experts)
    magnitude: TensorInfo | None = None  # [out_features]: DoRA's lora_magnitude_vector
    experts: int = 1  # LoRA on a MoE layer's experts (``adapters.peft_experts``)

    @property
    def rank(self) -> int:
        """Each expert's rank (the projection's, for a plain projection)."""
        return self.a.shape[0] // self.experts


def check_weight_file_size(num_bytes: int, *, max_bytes: int, what: str) -> None:
    if num_bytes > max_bytes:
        raise AdapterTooLargeError(f"{what} is {num_bytes} bytes, over the limit of {max_bytes}")


def pair_tensors(tensors: Mapping[str, TensorInfo]) -> dict[tuple[int, str], ModuleTensors]:
    """Group tensors into A/B pairs per (layer, module); every A needs its B and vice versa."""
    if not tensors:
        raise InvalidAdapterError("adapter_model.safetensors holds no LoRA tensors")
    found: dict[tuple[int, str], dict[str, tuple[LoraTensorName, TensorInfo]]] = {}
    prefixes: set[bool] = set()
    for name, info in tensors.items():
        parsed = parse_tensor_name(name)
        prefixes.add(parsed.key.startswith("model."))
        sides = found.setdefault((parsed.layer, parsed.module), {})
        if parsed.side in sides:
            raise InvalidAdapterError(
                f"tensors {sides[parsed.side][1].name!r} and {name!r} are both lora_{parsed.side} "
                f"of layer {parsed.layer} {parsed.module}",
                field=name,
            )
        sides[parsed.side] = (parsed, info)
    if len(prefixes) > 1:
        raise InvalidAdapterError(
            "tensor names mix 'model.layers.' and bare 'layers.' module names", field="tensors"
        )
    pairs = {}
    for (layer, module), sides in found.items():
        if "A" not in sides and "B" not in sides:
            parsed, info = sides["M"]
            raise InvalidAdapterError(
                f"tensor {info.name!r} is a DoRA magnitude without its LoRA weights "
                f"({PEFT_PREFIX}{parsed.key}.lora_A.weight / lora_B.weight are missing)",
                field=info.name,
            )
        for have, missing in (("A", "B"), ("B", "A")):
            if have in sides and missing not in sides:
                parsed, info = sides[have]
                raise InvalidAdapterError(
                    f"tensor {info.name!r} has no matching lora_{missing} "
                    f"({PEFT_PREFIX}{parsed.key}.lora_{missing}.weight is missing)",
                    field=info.name,
                )
        (parsed, a), (_, b) = sides["A"], sides["B"]
        magnitude = sides["M"][1] if "M" in sides else None
        pairs[(layer, module)] = ModuleTensors(parsed.key, layer, module, a, b, magnitude)
    return pairs


def check_against_base(
    modules: Mapping[tuple[int, str], ModuleTensors], base: BaseModelSpec
) -> None:
    """A module the base has (Phi-3's are fused: qkv_proj, gate_up_proj); layer in range; A is
    [r, in] and B is [out, r] with one r; in/out as the base has them."""
    for m in modules.values():
        if m.module not in base.projections:
            raise IncompatibleAdapterError(
                f"tensor {m.a.name!r} is for module {m.module!r}, which this {base.model_type} "
                f"base model does not have (its projections: {', '.join(base.projections)})",
                field=m.a.name,
            )
        if m.layer >= base.num_layers:
            raise IncompatibleAdapterError(
                f"tensor {m.a.name!r} is for layer {m.layer}, but the base model has "
                f"{base.num_layers} layers (0..{base.num_layers - 1})",
                field=m.a.name,
            )
        if not base.has_module(m.layer, m.module):
            raise IncompatibleAdapterError(
                f"tensor {m.a.name!r} is for module {m.module!r} of layer {m.layer}, a sparse "
                f"(mixture-of-experts) layer of this {base.model_type} base, which has no "
                "dense MLP (LoRA on its experts: target_parameters)",
                field=m.a.name,
            )
        for info in (m.a, m.b):
            if len(info.shape) != 2:
                raise InvalidAdapterError(
                    f"tensor {info.name!r} has shape {list(info.shape)}; LoRA weights are 2-D",
                    field=info.name,
                )
        if m.rank == 0 or m.a.shape[0] != m.b.shape[1]:
            raise InvalidAdapterError(
                f"{m.key}: lora_A {list(m.a.shape)} has rank {m.a.shape[0]} but lora_B "
                f"{list(m.b.shape)} has rank {m.b.shape[1]} (they must be equal and positive)",
                field=m.b.name,
            )
        in_features, out_features = base.projection_shape(m.module)
        expected_shapes = [(m.a, (m.rank, in_features)), (m.b, (out_features, m.rank))]
        if m.magnitude is not None:
            expected_shapes.append((m.magnitude, (out_features,)))
        for info, expected in expected_shapes:
            if info.shape != expected:
                raise IncompatibleAdapterError(
                    f"tensor {info.name!r} has shape {list(info.shape)}, expected "
                    f"{list(expected)} for {m.module} of this base model "
                    f"({base.model_type}, hidden {base.hidden_size})",
                    field=info.name,
                )


def check_no_head_targets(config: AdapterConfig) -> None:
    """Refuse, by the config field, targets on the embedding or lm_head (either name form)."""
    for head in ("model.embed_tokens", "embed_tokens", "lm_head"):
        if config.selects(head):
            raise UnsupportedAdapterFeatureError(
                f"{CONFIG_FILE}: target_modules {_show(config.target_modules)} selects {head!r}; "
                "LoRA on the embedding or lm_head is not served",
                field="target_modules",
            )


def check_against_config(
    modules: Mapping[tuple[int, str], ModuleTensors], config: AdapterConfig, base: BaseModelSpec
) -> None:
    """The tensors are exactly the modules the config targets, with the ranks it gives them,
    and each with a DoRA magnitude exactly when the config says `use_dora`."""
    prefix = "model." if next(iter(modules.values())).key.startswith("model.") else ""
    for m in modules.values():
        if config.use_dora and m.magnitude is None:
            raise InvalidAdapterError(
                f"{CONFIG_FILE} sets use_dora but {m.key!r} has no "
                f"{PEFT_PREFIX}{m.key}.lora_magnitude_vector",
                field="use_dora",
            )
        if not config.use_dora and m.magnitude is not None:
            raise InvalidAdapterError(
                f"tensor {m.magnitude.name!r} is a DoRA magnitude but {CONFIG_FILE} does not "
                "set use_dora",
                field=m.magnitude.name,
            )
        if not config.selects(m.key):
            raise InvalidAdapterError(
                f"tensor {m.a.name!r} is for {m.key!r}, which {CONFIG_FILE} does not target "
                f"(target_modules {_show(config.target_modules)}, layers_to_transform "
                f"{config.layers_to_transform!r})",
                field=m.a.name,
            )
        if config.rank_for(m.key) != m.rank:
            raise InvalidAdapterError(
                f"{CONFIG_FILE} gives {m.key!r} rank {config.rank_for(m.key)} (r / rank_pattern) "
                f"but tensor {m.a.name!r} has rank {m.rank}",
                field="rank_pattern" if config.rank_pattern else "r",
            )
    for layer in range(base.num_layers):
        for module, parent in base.projections.items():
            key = f"{prefix}layers.{layer}.{parent}.{module}"
            if (
                (layer, module) not in modules
                and base.has_module(layer, module)
                and config.selects(key)
            ):
                raise InvalidAdapterError(
                    f"{CONFIG_FILE} targets {key!r} but adapter_model.safetensors has no "
                    f"{PEFT_PREFIX}{key}.lora_A.weight / lora_B.weight",
                    field="target_modules",
                )


def check_limits(
    modules: Mapping[tuple[int, str], ModuleTensors],
    *,
    max_lora_rank: int,
    max_bytes: int,
    saved: Mapping[str, TensorInfo] | None = None,
) -> None:
    """Deployment limits: every rank fits the device slots; float32 weights, saved module copies
    (modules_to_save) included, fit the byte bound."""
    for m in modules.values():
        if m.rank > max_lora_rank:
            raise AdapterTooLargeError(
                f"{m.key!r} has rank {m.rank}, over max_lora_rank={max_lora_rank}",
                field=m.a.name,
            )
    float32_bytes = 4 * sum(
        m.a.num_elements + m.b.num_elements + (m.magnitude.num_elements if m.magnitude else 0)
        for m in modules.values()
    )
    saved_bytes = 4 * sum(info.num_elements for info in (saved or {}).values())
    if float32_bytes + saved_bytes > max_bytes:
        copies = f" ({saved_bytes} of them module copies or token rows)" if saved_bytes else ""
        raise AdapterTooLargeError(
            f"adapter weights take {float32_bytes + saved_bytes} bytes as float32{copies}, "
            f"over the limit of {max_bytes}",
            field="modules_to_save" if saved_bytes else None,
        )


def check_finite(name: str, array: np.ndarray) -> None:
    bad = ~np.isfinite(array)
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise InvalidAdapterError(
            f"tensor {name!r} holds {int(bad.sum())} non-finite values "
            f"(first: {float(array[where])} at index {list(where)})",
            field=name,
        )


def _show(targets: str | tuple[str, ...]) -> str:
    return repr(targets) if isinstance(targets, str) else repr(sorted(targets))
