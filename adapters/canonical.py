"""The canonical on-disk form of a normalized adapter: a plain PEFT LoRA directory.

Stored adapters stay loadable by `PeftModel.from_pretrained` and by `load_adapter_dir`, and
re-reading one yields the same id: targets are exact full module names, per-module rank and
alpha are explicit `rank_pattern` / `alpha_pattern` entries (escaped, so each matches exactly
one module under PEFT's `get_pattern_key`), and tensors are float32 under CausalLM names.
The files are a deterministic function of the adapter, so equal ids give equal bytes, except
that two configs sharing a scaling (see identity.py) keep their own alpha / use_rslora.
"""

from __future__ import annotations

import json
import re
from typing import Any

from adapters.base_model import EXPERT_PROJECTIONS
from adapters.lora import LoraAdapter
from adapters.peft_config import CONFIG_FILE
from adapters.peft_names import (
    PEFT_PREFIX,
    WEIGHTS_FILE,
    Side,
    canonical_module_key,
    canonical_tensor_name,
)
from adapters.safetensors_io import write_float32
from adapters.saved_modules import saved_tensor_name
from adapters.trainable_tokens import TOKENS_TENSOR


def canonical_files(adapter: LoraAdapter) -> dict[str, bytes]:
    """{file name: contents} of the canonical adapter directory."""
    if not adapter.weights:
        raise ValueError("an adapter with no LoRA weights has no canonical form")
    tensors = {}
    for layer, module in adapter.weights:
        w = adapter.weights[(layer, module)]
        for side, array in (("A", w.a), ("B", w.b)):
            tensors[_tensor_name(adapter, layer, module, side)] = array
        if w.magnitude is not None:
            tensors[canonical_tensor_name(layer, module, "M")] = w.magnitude
    for module, table in adapter.saved.items():
        tensors[saved_tensor_name(module)] = table
    if adapter.tokens is not None:
        tensors[TOKENS_TENSOR] = adapter.tokens.rows
    config = json.dumps(canonical_config(adapter), indent=2) + "\n"
    return {CONFIG_FILE: config.encode(), WEIGHTS_FILE: write_float32(tensors)}


def canonical_config(adapter: LoraAdapter) -> dict[str, Any]:
    """A LoraConfig dict; r / lora_alpha are the first module's, the rest are overrides."""
    first = next(iter(adapter.weights.values()))
    rank_pattern: dict[str, int] = {}
    alpha_pattern: dict[str, float] = {}
    for (layer, module), w in adapter.weights.items():
        pattern = re.escape(canonical_module_key(layer, module))
        if w.rank != first.rank:
            rank_pattern[pattern] = w.rank
        if w.alpha != first.alpha:
            alpha_pattern[pattern] = w.alpha
    config: dict[str, Any] = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": first.rank,
        "lora_alpha": first.alpha,
        "use_rslora": adapter.config.use_rslora,
        "target_modules": [
            canonical_module_key(*key)
            for key in adapter.weights
            if key[1] not in EXPERT_PROJECTIONS
        ],
        "rank_pattern": rank_pattern,
        "alpha_pattern": alpha_pattern,
        "bias": "none",
        "lora_dropout": 0.0,
        "fan_in_fan_out": False,
        "use_dora": adapter.uses_dora,
        # Each copy saved under its own name: PEFT loads them untied, as they were read.
        "modules_to_save": list(adapter.saved) or None,
        "ensure_weight_tying": False,
        "trainable_token_indices": (
            None if adapter.tokens is None else adapter.tokens.ids.tolist()
        ),
        "init_lora_weights": True,
        "inference_mode": True,
        "base_model_name_or_path": None,
    }
    parameters = [canonical_module_key(*k) for k in adapter.weights if k[1] in EXPERT_PROJECTIONS]
    if parameters:  # LoRA on MoE experts
        config["target_parameters"] = parameters
    return config


def _tensor_name(adapter: LoraAdapter, layer: int, module: str, side: Side) -> str:
    """PEFT's name for the tensor; a layer's expert tensors nest as PEFT wraps them
    (``adapters.peft_experts``): gate_up_proj under down_proj's wrapper when both are there."""
    if module not in EXPERT_PROJECTIONS:
        return canonical_tensor_name(layer, module, side)
    inner = module == "experts.gate_up_proj" and (layer, "experts.down_proj") in adapter.weights
    nest = ".base_layer" if inner else ""
    return f"{PEFT_PREFIX}model.layers.{layer}.mlp.experts{nest}.lora_{side}.weight"
