"""LoRA on a MoE base's experts, as PEFT saves it (``LoraConfig(target_parameters=[...])``).

PEFT wraps each targeted expert tensor (transformers 5's fused ``mlp.experts.gate_up_proj``
[E, 2I, H] and ``down_proj`` [E, H, I]) in a ``lora.ParamWrapper``; a second target on the
same module wraps the first wrapper, so a layer's tensors are saved as
``…mlp.experts.lora_A.weight`` and ``…mlp.experts.base_layer.lora_A.weight`` (``.base_layer``
once per level of nesting). Which tensor a level adapts follows from its shapes, never
ambiguously: gate_up's A is [r·E, H] and B [2I, r·E], down's A [r·E, I] and B [H, r·E].
Expert e's update is ``scaling · B_e @ A_e`` with A_e = A[e·r : (e+1)·r] and B_e the columns
``j·E + e`` of B (``ParamWrapper.get_delta_weight``); ``scaling`` is alpha / r of the
parameter's key (``model.layers.0.mlp.experts.gate_up_proj``), as PEFT looks it up.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from adapters.base_model import EXPERT_PROJECTIONS, BaseModelSpec
from adapters.errors import IncompatibleAdapterError, InvalidAdapterError
from adapters.peft_config import CONFIG_FILE, AdapterConfig
from adapters.peft_names import PEFT_PREFIX
from adapters.safetensors_io import TensorInfo
from adapters.validation import ModuleTensors

_EXPERT_TENSOR = re.compile(
    r"(?P<prefix>(?:model\.)?)layers\.(?P<layer>\d+)\.mlp\.experts(?P<nest>(?:\.base_layer)*)"
    r"\.lora_(?P<side>[AB])\.weight"
)


def split_expert_tensors(
    tensors: Mapping[str, TensorInfo],
) -> tuple[dict[str, TensorInfo], dict[str, TensorInfo]]:
    """The header's tensors as (projection tensors, expert tensors)."""
    plain, experts = {}, {}
    for name, info in tensors.items():
        is_expert = _EXPERT_TENSOR.fullmatch(name.removeprefix(PEFT_PREFIX))
        (experts if is_expert and name.startswith(PEFT_PREFIX) else plain)[name] = info
    return plain, experts


def expert_modules(
    tensors: Mapping[str, TensorInfo], base: BaseModelSpec, config: AdapterConfig
) -> dict[tuple[int, str], ModuleTensors]:
    """The expert tensors paired per (layer, "experts.gate_up_proj" | "experts.down_proj"),
    each checked against the base's shapes and the config's targets and ranks."""
    levels: dict[tuple[int, str], dict[str, TensorInfo]] = {}
    prefixes = set()
    for name, info in tensors.items():
        match = _EXPERT_TENSOR.fullmatch(name.removeprefix(PEFT_PREFIX))
        assert match is not None
        prefixes.add(match.group("prefix"))
        levels.setdefault((int(match.group("layer")), match.group("nest")), {})[
            match.group("side")
        ] = info
    modules: dict[tuple[int, str], ModuleTensors] = {}
    for (layer, _nest), sides in sorted(levels.items()):
        if set(sides) != {"A", "B"}:
            info = next(iter(sides.values()))
            raise InvalidAdapterError(
                f"tensor {info.name!r} has no matching lora_{'B' if 'A' in sides else 'A'}",
                field=info.name,
            )
        a, b = sides["A"], sides["B"]
        module = _which(layer, a, b, base)
        if (layer, module) in modules:
            raise InvalidAdapterError(
                f"tensors {a.name!r} and {modules[(layer, module)].a.name!r} both adapt "
                f"layer {layer}'s {module}",
                field=a.name,
            )
        key = f"{next(iter(prefixes))}layers.{layer}.mlp.{module}"
        m = ModuleTensors(key, layer, module, a, b, experts=base.num_experts)
        if not config.selects_parameter(key):
            raise InvalidAdapterError(
                f"tensor {a.name!r} adapts {key!r}, which {CONFIG_FILE}'s target_parameters "
                f"{sorted(config.target_parameters)!r} does not name",
                field=a.name,
            )
        if config.rank_for(key) != m.rank:
            raise InvalidAdapterError(
                f"{CONFIG_FILE} gives {key!r} rank {config.rank_for(key)} (r / rank_pattern) "
                f"but tensor {a.name!r} has rank {m.rank} per expert",
                field="rank_pattern" if config.rank_pattern else "r",
            )
        modules[(layer, module)] = m
    if len(prefixes) > 1:
        raise InvalidAdapterError(
            "expert tensor names mix 'model.layers.' and bare 'layers.'", field="tensors"
        )
    _check_all_present(modules, base, config, next(iter(prefixes), "model."))
    return modules


def _which(layer: int, a: TensorInfo, b: TensorInfo, base: BaseModelSpec) -> str:
    """The expert tensor that A [r·E, in] and B [out, r·E] adapt, by their shapes."""
    if layer >= len(base.sparse_layers) or not base.sparse_layers[layer]:
        raise IncompatibleAdapterError(
            f"tensor {a.name!r} adapts the experts of layer {layer}, which this "
            f"{base.model_type} base does not have (no sparse MLP there)",
            field=a.name,
        )
    e = base.num_experts
    for module in EXPERT_PROJECTIONS:
        in_features, out_features = base.projection_shape(module)
        rows = a.shape[0] if len(a.shape) == 2 else 0
        if (
            len(a.shape) == len(b.shape) == 2
            and rows > 0
            and rows % e == 0
            and tuple(a.shape) == (rows, in_features)
            and tuple(b.shape) == (out_features, rows)
        ):
            return module
    raise IncompatibleAdapterError(
        f"tensors {a.name!r} {list(a.shape)} and {b.name!r} {list(b.shape)} fit neither "
        f"expert tensor of this base ({e} experts: gate_up_proj A [r*{e}, "
        f"{base.hidden_size}] B [{2 * base.expert_intermediate_size}, r*{e}]; down_proj A "
        f"[r*{e}, {base.expert_intermediate_size}] B [{base.hidden_size}, r*{e}])",
        field=a.name,
    )


def _check_all_present(
    modules: Mapping[tuple[int, str], ModuleTensors],
    base: BaseModelSpec,
    config: AdapterConfig,
    prefix: str,
) -> None:
    """Every expert tensor the config targets on a sparse layer has its A and B."""
    if not config.target_parameters:
        return
    for layer, sparse in enumerate(base.sparse_layers):
        for module in EXPERT_PROJECTIONS:
            key = f"{prefix}layers.{layer}.mlp.{module}"
            if sparse and (layer, module) not in modules and config.selects_parameter(key):
                raise InvalidAdapterError(
                    f"{CONFIG_FILE}'s target_parameters name {key!r} but "
                    "adapter_model.safetensors has no LoRA tensors for it",
                    field="target_parameters",
                )
