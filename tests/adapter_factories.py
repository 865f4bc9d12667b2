"""Test factories for adapters/: real PEFT LoRA adapters on tiny random Llama-family models.

PEFT is the independent reference: `peft_reference` reads A, B and scaling back out of the
live `PeftModel`, never out of the files our reader parses.
"""

from __future__ import annotations

import json
import shutil
import struct
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from adapters import BaseModelSpec

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TINY = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
LIMITS = {"max_lora_rank": 64, "max_bytes": 8 << 20}

Reference = dict[tuple[int, str], tuple[np.ndarray, np.ndarray, float]]


def tiny_config(arch: str = "llama") -> Any:
    from transformers import LlamaConfig, Qwen2Config

    return {"llama": LlamaConfig, "qwen2": Qwen2Config}[arch](**TINY)


def tiny_spec(arch: str = "llama", **overrides: Any) -> BaseModelSpec:
    """The spec of the tiny base, read the way the worker will: from its config dict."""
    return BaseModelSpec.from_config_dict({**tiny_config(arch).to_dict(), **overrides})


def make_peft_model(*, arch: str = "llama", seed: int = 0, **lora: Any) -> Any:
    """A fresh tiny base with a LoRA adapter whose B is random (PEFT starts B at zero)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM

    torch.manual_seed(seed)
    model_cls = {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM}[arch]
    model = get_peft_model(model_cls(tiny_config(arch)), LoraConfig(task_type="CAUSAL_LM", **lora))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.5)
            elif "modules_to_save" in name or "trainable_tokens_delta" in name:
                param.add_(torch.randn_like(param))  # trained: not the base's values
    return model


def save_adapter(path: Path, *, arch: str = "llama", seed: int = 0, **lora: Any) -> Any:
    """Save a random adapter with `save_pretrained`; returns the PeftModel as the reference."""
    with warnings.catch_warnings():
        # Deliberately odd adapters (lora_bias, lm_head targets) make PEFT warn; that's expected.
        warnings.simplefilter("ignore")
        model = make_peft_model(arch=arch, seed=seed, **lora)
        model.save_pretrained(path)
    return model


def reload_peft(path: Path, *, arch: str = "llama") -> Any:
    """The adapter as `PeftModel.from_pretrained` serves it from its saved files."""
    from peft import PeftModel
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM

    model_cls = {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM}[arch]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers' own deprecations
        return PeftModel.from_pretrained(model_cls(tiny_config(arch)), path)


def peft_reference(model: Any) -> Reference:
    """(layer, projection) → (A, B, scaling) as the live PeftModel holds them."""
    from peft.tuners.lora import LoraLayer

    reference = {}
    for name, module in model.base_model.model.named_modules():
        if isinstance(module, LoraLayer) and "default" in module.lora_A:
            parts = name.split(".")  # model.layers.<i>.<self_attn|mlp>.<proj>
            reference[(int(parts[2]), parts[4])] = (
                module.lora_A["default"].weight.detach().numpy().copy(),
                module.lora_B["default"].weight.detach().numpy().copy(),
                module.scaling["default"],
            )
    return reference


def peft_magnitudes(model: Any) -> dict[tuple[int, str], np.ndarray]:
    """(layer, projection) → DoRA's magnitude vector as the live PeftModel holds it."""
    from peft.tuners.lora import LoraLayer

    found = {}
    for name, module in model.base_model.model.named_modules():
        if isinstance(module, LoraLayer) and "default" in module.lora_magnitude_vector:
            parts = name.split(".")
            vector = module.lora_magnitude_vector["default"].weight
            found[(int(parts[2]), parts[4])] = vector.detach().numpy().copy()
    return found


def peft_saved(model: Any) -> dict[str, np.ndarray]:
    """modules_to_save name ("embed_tokens", "lm_head") → the trained copy the PeftModel uses."""
    from peft.utils import ModulesToSaveWrapper

    found = {}
    for name, module in model.base_model.model.named_modules():
        if isinstance(module, ModulesToSaveWrapper):
            weight = module.modules_to_save["default"].weight
            found[name.split(".")[-1]] = weight.detach().numpy().copy()
    return found


def peft_tokens(model: Any) -> dict[int, np.ndarray]:
    """Trainable token id → the embedding row the PeftModel uses for it."""
    layer = model.base_model.model.model.embed_tokens.token_adapter
    rows = layer.trainable_tokens_delta["default"].detach().numpy()
    return {int(i): rows[k].copy() for k, i in enumerate(layer.token_indices["default"])}


def copy_adapter(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_config(path: Path, **changes: Any) -> None:
    file = path / "adapter_config.json"
    config = json.loads(file.read_text())
    config.update(changes)
    file.write_text(json.dumps(config))


def read_tensors(path: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(path / "adapter_model.safetensors"))


def write_tensors(path: Path, tensors: dict[str, np.ndarray], *, dtype: str = "F32") -> None:
    """Rewrite the weights file, in the given key order, as F32, F16 or BF16."""
    entries = [(name, dtype, array.shape, _encode(array, dtype)) for name, array in tensors.items()]
    write_raw_safetensors(path / "adapter_model.safetensors", entries)


def write_raw_safetensors(
    file: Path, entries: list[tuple[str, str, tuple[int, ...], bytes]]
) -> None:
    """A safetensors file whose buffer holds tensors in exactly the order given."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape, data in entries:
        header[name] = {
            "dtype": dtype,
            "shape": list(shape),
            "data_offsets": [offset, offset + len(data)],
        }
        offset += len(data)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    file.write_bytes(struct.pack("<Q", len(encoded)) + encoded + b"".join(e[3] for e in entries))


def to_bf16_values(array: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 and back, computed by torch (the reference)."""
    return torch.from_numpy(np.ascontiguousarray(array)).bfloat16().float().numpy()


def _encode(array: np.ndarray, dtype: str) -> bytes:
    if dtype == "F32":
        return np.ascontiguousarray(array, dtype="<f4").tobytes()
    if dtype == "F16":
        return np.ascontiguousarray(array, dtype="<f2").tobytes()
    assert dtype == "BF16"
    return (
        torch.from_numpy(np.ascontiguousarray(array)).bfloat16().view(torch.int16).numpy().tobytes()
    )
