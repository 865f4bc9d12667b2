"""Tiny random Mixtral and Qwen3-MoE checkpoints (``worker.model.tiny_families``: eight experts,
two per token, a router whose choices vary from token to token, Qwen3-MoE with a dense MLP layer
between sparse ones), and PEFT adapters on their experts."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from worker.model.tiny_families import MOE_FAMILIES, NUM_EXPERTS, TOP_K, make_moe_checkpoint

__all__ = [
    "EXPERT_PARAMETERS",
    "MOE_FAMILIES",
    "NUM_EXPERTS",
    "TOP_K",
    "make_expert_adapter",
    "make_moe_checkpoint",
    "write_fused_experts",
]

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
