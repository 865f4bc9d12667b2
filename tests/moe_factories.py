"""Tiny random Mixtral and Qwen3-MoE checkpoints, built by transformers.

Eight experts, two per token, a router with weights large enough that routing varies from
token to token (every expert gets tokens in a prompt of a few dozen); Qwen3-MoE with a dense
MLP layer between sparse ones (``mlp_only_layers``) and its top-k renormalized.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from factories import TINY_VOCAB

NUM_EXPERTS = 8
TOP_K = 2

_COMMON = {
    "vocab_size": TINY_VOCAB,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 1024,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "initializer_range": 0.15,
    "num_experts_per_tok": TOP_K,
}

# family -> (config class name, model class name, config fields)
MOE_FAMILIES: dict[str, tuple[str, str, dict]] = {
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {"num_hidden_layers": 2, "intermediate_size": 48, "num_local_experts": NUM_EXPERTS},
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            "num_hidden_layers": 3,
            "intermediate_size": 96,  # the dense layer's
            "moe_intermediate_size": 32,
            "num_experts": NUM_EXPERTS,
            "mlp_only_layers": [1],
            "norm_topk_prob": True,
        },
    ),
}


def make_moe_checkpoint(path: Path, family: str, *, seed: int = 0, **overrides) -> Path:
    """Write a tiny random MoE checkpoint of ``family`` (as ``save_pretrained`` writes it:
    one tensor per expert projection)."""
    import transformers

    config_name, model_name, fields = MOE_FAMILIES[family]
    config = getattr(transformers, config_name)(**{**_COMMON, **fields, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.8, 1.2)
            elif name.endswith("gate.weight"):  # the router: decisive, varied choices
                param.normal_(0.0, 0.5)
    model.save_pretrained(path, safe_serialization=True)
    return path


EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def make_expert_adapter(
    base_path: Path,
    out: Path,
    *,
    rank: int,
    targets: list[str],
    parameters: list[str],
    seed: int = 0,
) -> Path:
    """A real PEFT adapter with LoRA on the experts (``target_parameters``) and on the modules
    ``targets`` names; A and B randomized so that it matters."""
    from peft import LoraConfig, get_peft_model

    from factories import load_hf_model

    config = LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=targets, target_parameters=parameters
    )
    model = get_peft_model(load_hf_model(base_path), config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.5 / param.shape[-1] ** 0.5)
    model.save_pretrained(out, safe_serialization=True)
    return out


def write_fused_experts(source: Path, out: Path, family: str) -> Path:
    """The checkpoint ``source`` with its experts as transformers 5 holds them in memory (fused
    gate_up_proj [E, 2I, H] and down_proj [E, H, I] per layer), written to ``out``."""
    out.mkdir()
    (out / "config.json").write_text((source / "config.json").read_text())
    w = load_file(source / "model.safetensors")
    n = json.loads((source / "config.json").read_text())["num_hidden_layers"]
    names = ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    moe = "block_sparse_moe" if family == "mixtral" else "mlp"
    for i in range(n):
        p = f"model.layers.{i}.{moe}."
        if p + "gate.weight" not in w:
            continue
        experts = sorted(
            {int(k[len(p) + 8 :].split(".")[0]) for k in w if k.startswith(p + "experts.")}
        )
        pick = {x: [w.pop(f"{p}experts.{e}.{x}.weight") for e in experts] for x in names}
        q = f"model.layers.{i}.mlp."
        w[q + "gate.weight"] = w.pop(p + "gate.weight")
        gate_up = [torch.cat([g, u]) for g, u in zip(pick[names[0]], pick[names[1]], strict=True)]
        w[q + "experts.gate_up_proj"] = torch.stack(gate_up)
        w[q + "experts.down_proj"] = torch.stack(pick[names[2]])
    save_file(w, out / "model.safetensors")
    return out
