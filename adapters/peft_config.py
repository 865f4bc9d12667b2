"""`adapter_config.json`: the PEFT LoraConfig fields that decide what an adapter computes.

Fields that only matter for training (dropout, init, task_type, ...) are ignored; fields that
change the forward pass in a way we do not serve are refused, each by name. Missing fields
take PeftConfig's defaults (r=8, lora_alpha=8), as `LoraConfig.from_pretrained` would.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from adapters.errors import InvalidAdapterError, UnsupportedAdapterFeatureError
from adapters.linear_regex import PatternError, compile_linear
from adapters.peft_patterns import lookup_pattern, target_selected
from adapters.saved_modules import saved_module_names
from adapters.trainable_tokens import trainable_token_ids

T = TypeVar("T")

CONFIG_FILE = "adapter_config.json"
MAX_CONFIG_BYTES = 1 << 20  # a real one is ~1.5 KB; refuse before parsing anything huge
# Bounds on the numbers and lists, so nothing downstream is sized or looped by a hostile value.
# Ranks past 2^16 fit no device slot anyway (max_lora_rank refuses far smaller ones); with
# |alpha| <= 1e4 and r >= 1, every scaling (alpha / r or alpha / sqrt(r)) is finite and
# within +-1e4 (real adapters use alpha of a few r: scalings of 0.5 to 4).
MAX_RANK = 1 << 16
MAX_ABS_ALPHA = 1e4
MAX_LIST_ITEMS = 4096  # target_modules, exclude_modules, layers_to_transform, patterns
MAX_LAYER_INDEX = 1 << 20

# Fields that, when truthy, make the adapter something other than plain LoRA on Linear layers.
_UNSUPPORTED_FIELDS: dict[str, str] = {
    "fan_in_fan_out": "fan_in_fan_out marks transposed Conv1D (GPT-2 style) layers",
    "lora_bias": "a trainable bias on lora_B is not served",
    "use_qalora": "QALoRA pools the input before lora_A",
    "alora_invocation_tokens": "Activated LoRA applies only after invocation tokens",
    "layer_replication": "layer replication changes the base model's layer stack",
    "velora_config": "the VeLoRA variant is not served",
    "monteclora_config": "the MonteCLoRA variant is not served",
    "use_bdlora": "the block-diagonal LoRA variant is not served",
    "arrow_config": "Arrow routing across adapters is not served",
    "kasa_config": "the KaSA variant is not served",
}
# init_lora_weights values whose adapters expect a modified base model (residual or
# quantized) unless PEFT converted them back on save, which resets the field to true.
_BASE_MODIFYING_INITS = ("pissa", "corda", "olora", "loftq", "lora_ga")


@dataclass(frozen=True, slots=True)
class AdapterConfig:
    """What `adapter_config.json` says about ranks, alphas and targets, PEFT's way."""

    r: int
    lora_alpha: float
    use_rslora: bool
    # DoRA: each adapted projection's output rescaled per output feature by its magnitude
    # vector over the norm of the adapted weight (PEFT's `lora_magnitude_vector`).
    use_dora: bool
    # Trained full copies of these modules ("embed_tokens", "lm_head"), in canonical order
    # (``adapters/saved_modules.py``); ensure_weight_tying ties the pair on a tied base.
    modules_to_save: tuple[str, ...]
    ensure_weight_tying: bool
    # trainable_token_indices: ids whose input-embedding rows the adapter replaces, in the
    # file's order (``adapters/trainable_tokens.py``).
    trainable_tokens: tuple[int, ...]
    target_modules: str | tuple[str, ...]  # a str is a full-match regex (or "all-linear")
    exclude_modules: str | tuple[str, ...] | None
    layers_to_transform: int | tuple[int, ...] | None
    layers_pattern: str | tuple[str, ...] | None
    rank_pattern: Mapping[str, int]  # file order matters: PEFT takes the first match
    alpha_pattern: Mapping[str, float]
    base_model_name_or_path: str | None  # informational; never part of the identity
    # LoRA on nn.Parameters: a MoE base's expert tensors (``adapters.peft_experts``).
    target_parameters: tuple[str, ...] = ()

    def selects(self, key: str) -> bool:
        """Whether PEFT would put LoRA on module `key` (e.g. `model.layers.0.mlp.up_proj`)."""
        return target_selected(
            key,
            target_modules=self.target_modules,
            exclude_modules=self.exclude_modules,
            layers_to_transform=self.layers_to_transform,
            layers_pattern=self.layers_pattern,
        )

    def selects_parameter(self, key: str) -> bool:
        """Whether PEFT would wrap parameter `key` (`model.layers.0.mlp.experts.down_proj`):
        its full name or a suffix after a dot (``BaseTuner._inject_parameters``)."""
        targets = self.target_parameters
        return key in targets or any(key.endswith(f".{t}") for t in targets)

    def rank_for(self, key: str) -> int:
        return lookup_pattern(self.rank_pattern, key, self.r)

    def alpha_for(self, key: str) -> float:
        return lookup_pattern(self.alpha_pattern, key, self.lora_alpha)


def lora_scaling(*, rank: int, alpha: float, use_rslora: bool) -> float:
    """PEFT's `LoraLayer.update_layer`: alpha / r, or alpha / sqrt(r) for rank-stabilized LoRA."""
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


def parse_adapter_config(data: bytes | str) -> AdapterConfig:
    """Parse `adapter_config.json`, refusing unsupported features by field name."""
    if len(data) > MAX_CONFIG_BYTES:
        raise InvalidAdapterError(f"{CONFIG_FILE}: {len(data)} bytes, over {MAX_CONFIG_BYTES}")
    try:
        raw = json.loads(data, parse_constant=_refuse_constant)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise InvalidAdapterError(f"{CONFIG_FILE}: not valid JSON ({exc})") from exc
    except RecursionError as exc:  # `[[[[...` a megabyte deep
        raise InvalidAdapterError(f"{CONFIG_FILE}: JSON nested too deeply") from exc
    if not isinstance(raw, dict):
        raise InvalidAdapterError(f"{CONFIG_FILE}: top level is not a JSON object")
    _refuse_unsupported(raw)
    parameters = _target_parameters(raw.get("target_parameters"))
    config = AdapterConfig(
        r=_rank(raw.get("r", 8), "r"),
        lora_alpha=_alpha(raw.get("lora_alpha", 8), "lora_alpha"),
        use_rslora=_bool(raw.get("use_rslora", False), "use_rslora"),
        use_dora=_bool(raw.get("use_dora") or False, "use_dora"),  # null as PEFT: off
        modules_to_save=saved_module_names(raw.get("modules_to_save"), config_file=CONFIG_FILE),
        ensure_weight_tying=_bool(raw.get("ensure_weight_tying") or False, "ensure_weight_tying"),
        trainable_tokens=trainable_token_ids(
            raw.get("trainable_token_indices"), config_file=CONFIG_FILE
        ),
        target_modules=_target_modules(raw.get("target_modules"), required=not parameters),
        exclude_modules=_names_or_regex(raw.get("exclude_modules"), "exclude_modules"),
        layers_to_transform=_layers_to_transform(raw.get("layers_to_transform")),
        layers_pattern=_names_or_regex(raw.get("layers_pattern"), "layers_pattern"),
        rank_pattern=_pattern_dict(raw.get("rank_pattern"), "rank_pattern", _rank),
        alpha_pattern=_pattern_dict(raw.get("alpha_pattern"), "alpha_pattern", _alpha),
        base_model_name_or_path=_optional_str(raw.get("base_model_name_or_path")),
        target_parameters=parameters,
    )
    _check_like_lora_config_post_init(config)
    return config


def _refuse_unsupported(raw: Mapping[str, Any]) -> None:
    peft_type = raw.get("peft_type")
    if peft_type != "LORA":
        raise UnsupportedAdapterFeatureError(
            f"{CONFIG_FILE}: peft_type is {peft_type!r}; only 'LORA' adapters are served",
            field="peft_type",
        )
    for field, why in _UNSUPPORTED_FIELDS.items():
        value = raw.get(field)
        if value:
            raise UnsupportedAdapterFeatureError(
                f"{CONFIG_FILE}: {field}={value!r} is not supported ({why})", field=field
            )
    bias = raw.get("bias", "none")
    if bias != "none":
        raise UnsupportedAdapterFeatureError(
            f"{CONFIG_FILE}: bias={bias!r} is not supported (trained biases change the base "
            "layers); only bias='none' is served",
            field="bias",
        )
    init = raw.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_BASE_MODIFYING_INITS):
        raise UnsupportedAdapterFeatureError(
            f"{CONFIG_FILE}: init_lora_weights={init!r} means the adapter expects a modified "
            "base model; save it with PEFT's path_initial_model_for_weight_conversion to get a "
            "plain LoRA",
            field="init_lora_weights",
        )


def _check_like_lora_config_post_init(config: AdapterConfig) -> None:
    """The consistency rules `LoraConfig.__post_init__` enforces, so PEFT could load it too."""
    if isinstance(config.target_modules, str):
        for field in ("layers_to_transform", "layers_pattern"):
            if getattr(config, field) is not None:
                raise InvalidAdapterError(
                    f"{CONFIG_FILE}: {field} cannot be used when target_modules is a regex string",
                    field=field,
                )
    if config.trainable_tokens and "embed_tokens" in config.modules_to_save:
        raise InvalidAdapterError(
            f"{CONFIG_FILE}: trainable_token_indices and modules_to_save both replace embed_tokens",
            field="trainable_token_indices",
        )
    if config.layers_pattern and config.layers_to_transform is None:
        raise InvalidAdapterError(
            f"{CONFIG_FILE}: layers_pattern is set but layers_to_transform is not",
            field="layers_pattern",
        )


def _target_modules(value: Any, *, required: bool) -> str | tuple[str, ...]:
    """PEFT's target_modules; it may be missing where target_parameters names targets."""
    result = None if value in (None, "", []) else _names_or_regex(value, "target_modules")
    if not result:
        if not required:
            return ()
        raise InvalidAdapterError(
            f"{CONFIG_FILE}: target_modules is missing", field="target_modules"
        )
    return result


# The parameters LoRA may target: a MoE layer's fused expert tensors, by a suffix of their name.
_EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")


def _target_parameters(value: Any) -> tuple[str, ...]:
    """target_parameters: names (or dotted suffixes) of MoE expert tensors only, e.g.
    ``mlp.experts.gate_up_proj``; anything else (a router, a 2-D weight) is refused by name."""
    if value in (None, []):
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise InvalidAdapterError(
            f"{CONFIG_FILE}: target_parameters must be a list of strings, got {value!r}",
            field="target_parameters",
        )
    _check_length(value, "target_parameters")
    for name in value:
        parts = name.split(".")
        if parts[-1] not in _EXPERT_PARAMETERS or (len(parts) > 1 and parts[-2] != "experts"):
            raise UnsupportedAdapterFeatureError(
                f"{CONFIG_FILE}: target_parameters entry {name[:200]!r} is not served (LoRA on "
                "parameters is served on MoE experts: mlp.experts.gate_up_proj, "
                "mlp.experts.down_proj)",
                field="target_parameters",
            )
    return tuple(value)


def _names_or_regex(value: Any, field: str) -> str | tuple[str, ...] | None:
    """A regex string (checked to compile) or a list of names, as PEFT allows."""
    if value is None:
        return None
    if isinstance(value, str):
        _check_regex(value, field, what=f"{field} {value[:200]!r}")
        return value
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        _check_length(value, field)
        return tuple(value)
    raise InvalidAdapterError(
        f"{CONFIG_FILE}: {field} must be a string or a list of strings, got {value!r}",
        field=field,
    )


def _layers_to_transform(value: Any) -> int | tuple[int, ...] | None:
    if value is None:
        return None
    if isinstance(value, list):
        _check_length(value, "layers_to_transform")
        return tuple(_non_negative_int(v, "layers_to_transform") for v in value)
    return _non_negative_int(value, "layers_to_transform")


def _pattern_dict(value: Any, field: str, parse_value: Callable[[Any, str], T]) -> dict[str, T]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidAdapterError(f"{CONFIG_FILE}: {field} must be an object", field=field)
    _check_length(value, field)
    for pattern in value:
        # PEFT wraps each key as `(.*\.)?(key)$`; the wrapped form must compile too.
        _check_regex(rf"(.*\.)?({pattern})$", field, what=f"{field} key {pattern[:200]!r}")
    return {k: parse_value(v, f"{field}[{k!r}]") for k, v in value.items()}


def _check_regex(pattern: str, field: str, *, what: str) -> None:
    try:
        compile_linear(pattern)
    except PatternError as exc:
        raise InvalidAdapterError(
            f"{CONFIG_FILE}: {what} is not a valid regex ({exc})", field=field
        ) from exc


def _check_length(items: list | dict, field: str) -> None:
    if len(items) > MAX_LIST_ITEMS:
        raise InvalidAdapterError(
            f"{CONFIG_FILE}: {field} has {len(items)} entries, over {MAX_LIST_ITEMS}", field=field
        )


def _rank(value: Any, field: str) -> int:
    rank = _positive_int(value, field)
    if rank > MAX_RANK:
        raise InvalidAdapterError(f"{CONFIG_FILE}: {field}={rank} is over {MAX_RANK}", field=field)
    return rank


def _alpha(value: Any, field: str) -> float:
    alpha = _finite_number(value, field)
    if abs(alpha) > MAX_ABS_ALPHA:
        raise InvalidAdapterError(
            f"{CONFIG_FILE}: {field}={alpha!r} is outside +-{MAX_ABS_ALPHA:g}", field=field
        )
    return alpha


def _positive_int(value: Any, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidAdapterError(
            f"{CONFIG_FILE}: {field} must be a positive integer, got {value!r}", field=field
        )
    return value


def _non_negative_int(value: Any, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LAYER_INDEX:
        raise InvalidAdapterError(
            f"{CONFIG_FILE}: {field} must hold integers from 0 to {MAX_LAYER_INDEX}, got {value!r}",
            field=field,
        )
    return value


def _finite_number(value: Any, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidAdapterError(
            f"{CONFIG_FILE}: {field} must be a finite number, got {value!r}", field=field
        )
    return value  # an int stays an int: PEFT divides the JSON value as loaded


def _bool(value: Any, field: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidAdapterError(f"{CONFIG_FILE}: {field} must be true or false", field=field)
    return value


def _optional_str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")
