"""PEFT's `modules_to_save`: trained full copies of the embedding and the output layer.

PEFT wraps each listed module in a `ModulesToSaveWrapper` and saves the trained copy under the
module's own name: `base_model.model.lm_head.weight` and `base_model.model.model.embed_tokens.
weight`, each [vocab, hidden]. At inference a row using the adapter gets its embeddings and
logits from the copies; nothing else changes. Only these two modules are served (a saved
`score`, `norm` or projection is refused by name). On a base with tied embeddings PEFT keeps
the two copies apart unless `ensure_weight_tying` ties them, and then saves both; a file with
one of them under that flag serves it for both, as PEFT ties them at load.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from adapters.base_model import BaseModelSpec
from adapters.errors import (
    IncompatibleAdapterError,
    InvalidAdapterError,
    UnsupportedAdapterFeatureError,
)
from adapters.peft_names import PEFT_PREFIX
from adapters.safetensors_io import TensorInfo

SAVED_MODULES = ("embed_tokens", "lm_head")  # the canonical order
# modules_to_save entries → the module they name (PEFT matches module names by suffix).
_CONFIG_NAMES = {"lm_head": "lm_head", "embed_tokens": "embed_tokens"}
_CONFIG_NAMES["model.embed_tokens"] = "embed_tokens"
# Tensor names after PEFT's prefix: under a CausalLM, or the bare model (no lm_head there).
_TENSOR_NAMES = {
    "lm_head.weight": "lm_head",
    "model.embed_tokens.weight": "embed_tokens",
    "embed_tokens.weight": "embed_tokens",
}


def saved_module_names(value: Any, *, config_file: str) -> tuple[str, ...]:
    """`modules_to_save` as the modules it names, in canonical order; others refused by name."""
    if value is None or value == []:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise InvalidAdapterError(
            f"{config_file}: modules_to_save must be a list of module names, got {value!r}",
            field="modules_to_save",
        )
    unknown = [v for v in value if v not in _CONFIG_NAMES]
    if unknown:
        raise UnsupportedAdapterFeatureError(
            f"{config_file}: modules_to_save={value!r}: a trained copy of {unknown[0][:100]!r} "
            "is not served (only lm_head and embed_tokens are)",
            field="modules_to_save",
        )
    named = {_CONFIG_NAMES[v] for v in value}
    return tuple(m for m in SAVED_MODULES if m in named)


def saved_tensor_name(module: str) -> str:
    """The canonical tensor name of a saved module's copy."""
    return f"{PEFT_PREFIX}{'lm_head' if module == 'lm_head' else 'model.embed_tokens'}.weight"


def split_saved_tensors(
    tensors: Mapping[str, TensorInfo],
    *,
    listed: tuple[str, ...],
    tied: bool,
    config_file: str,
    base: BaseModelSpec,
) -> tuple[dict[str, TensorInfo], dict[str, TensorInfo]]:
    """({module: its copy's tensor}, the other tensors). A copy is [vocab, hidden] of the base,
    and present exactly for the modules listed (``tied``: PEFT ties the pair, so either's
    listing admits both)."""
    saved: dict[str, TensorInfo] = {}
    rest: dict[str, TensorInfo] = {}
    for name, info in tensors.items():
        module = (
            _TENSOR_NAMES.get(name.removeprefix(PEFT_PREFIX))
            if name.startswith(PEFT_PREFIX)
            else None
        )
        if module is None:
            rest[name] = info
            continue
        if module in saved:
            raise InvalidAdapterError(
                f"tensors {saved[module].name!r} and {name!r} are both a copy of {module}",
                field=name,
            )
        if module not in listed and not (tied and listed):
            raise InvalidAdapterError(
                f"tensor {name!r} is a trained copy of {module}, but {config_file}'s "
                "modules_to_save does not list it",
                field=name,
            )
        expected = (base.vocab_size, base.hidden_size)
        if info.shape != expected:
            raise IncompatibleAdapterError(
                f"tensor {name!r} has shape {list(info.shape)}, expected {list(expected)} "
                f"(vocab, hidden) of this base model ({base.model_type})",
                field=name,
            )
        saved[module] = info
    for module in listed:
        if module not in saved and not (tied and saved):
            raise InvalidAdapterError(
                f"{config_file} lists {module} in modules_to_save but the weights have no "
                f"{saved_tensor_name(module)}",
                field="modules_to_save",
            )
    return saved, rest
