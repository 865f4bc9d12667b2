"""The tiny random Llama every quantized fixture starts from (used by the make_*.py scripts)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama() -> LlamaForCausalLM:
    """fp32, weights spread wider than the default init so greedy tokens vary."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    model = LlamaForCausalLM(config).float()
    for name, p in model.named_parameters():
        if "norm" in name:
            p.data.fill_(1.0)
        else:
            p.data.normal_(0, 0.15)
    return model


def save_reference(model: LlamaForCausalLM, weights: dict[str, torch.Tensor], path) -> None:
    """The projections as the format's library dequantized them, [out, in] fp32 by module."""
    from safetensors.torch import save_file

    save_file({f"{n}.weight": w.float().contiguous() for n, w in weights.items()}, path)


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def projections(model: LlamaForCausalLM) -> dict[str, torch.nn.Linear]:
    """Every decoder projection by module name (``model.layers.0.self_attn.q_proj``)."""
    return {
        name: m
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in PROJECTIONS
    }
