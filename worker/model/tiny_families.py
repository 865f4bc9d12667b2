"""Tiny random checkpoints of the families beyond Llama, dense and mixture-of-experts, built by
transformers: for the tests that hold each family against transformers, and to try a family end to
end where no real checkpoint can be downloaded (``switchboard model tiny FAMILY DIR``, then
``make run MODEL=DIR``).

Each family is configured so that what sets it apart from Llama actually bites: windows shorter
than the test prompts, soft-caps small enough to bend the scores, Granite's multipliers away from
1, Gemma 3's scaled global RoPE, a LongRoPE switch within the prompts' lengths (on Phi-4-mini's
partial rotary); the MoE families with eight experts, two per token, and a router decisive enough
that routing varies from token to token (Qwen3-MoE with a dense MLP layer between sparse ones).
"""

from __future__ import annotations

from pathlib import Path

WINDOW = 8  # shorter than every test prompt
# LongRoPE's switch: test prompts of 17-40 tokens start short (and cross it while decoding) or long.
LONG_ROPE_AT = 24
TINY_VOCAB = 256

_COMMON = {
    "vocab_size": TINY_VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 1024,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "initializer_range": 0.15,
}
_LAYER_TYPES = ["sliding_attention", "full_attention"]

# family -> (config class name, model class name, config overrides)
FAMILIES: dict[str, tuple[str, str, dict]] = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "granite": (
        "GraniteConfig",
        "GraniteForCausalLM",
        {
            "embedding_multiplier": 3.0,
            "attention_multiplier": 0.2,
            "residual_multiplier": 0.6,
            "logits_scaling": 2.5,
        },
    ),
    "mistral-window": ("MistralConfig", "MistralForCausalLM", {"sliding_window": WINDOW}),
    "mistral-wide": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 4096}),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {
            "query_pre_attn_scalar": 16,
            "sliding_window": WINDOW,
            "layer_types": _LAYER_TYPES,
            "attn_logit_softcapping": 3.0,
            "final_logit_softcapping": 4.0,
        },
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            "query_pre_attn_scalar": 16,
            "sliding_window": WINDOW,
            "layer_types": _LAYER_TYPES,
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        },
    ),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "phi3-longrope": (
        "Phi3Config",
        "Phi3ForCausalLM",
        {
            "max_position_embeddings": 4 * LONG_ROPE_AT,
            "original_max_position_embeddings": LONG_ROPE_AT,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "original_max_position_embeddings": LONG_ROPE_AT,
                # Phi-4-mini's shape: RoPE on the first 3/4 of each head (12 of 16 features).
                "partial_rotary_factor": 0.75,
                "short_factor": [1.0 + 0.1 * i for i in range(6)],
                "long_factor": [1.0 + 0.9 * i for i in range(6)],
            },
        },
    ),
}


NUM_EXPERTS = 8
TOP_K = 2

# MoE family -> (config class name, model class name, config overrides)
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


def make_family_checkpoint(path: Path, family: str, *, seed: int = 0, **overrides) -> Path:
    """Write a tiny random checkpoint of ``family``; weights scaled so greedy choices are clear
    (Gemma's norms are stored as w - 1, so they get small values around 0, and its
    embeddings, scaled by sqrt(hidden) and tied to the output, a small std)."""
    import torch
    import transformers

    config_name, model_name, extra = FAMILIES[family]
    config = getattr(transformers, config_name)(**{**_COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).eval()
    gemma = family.startswith("gemma")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(-0.2, 0.2) if gemma else param.uniform_(0.8, 1.2)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.1)
            elif gemma and "embed" in name:
                param.normal_(0.0, 0.01)
    model.save_pretrained(path, safe_serialization=True)
    return path


def make_moe_checkpoint(path: Path, family: str, *, seed: int = 0, **overrides) -> Path:
    """Write a tiny random checkpoint of a MoE ``family`` (as ``save_pretrained`` writes it: one
    tensor per expert projection); the router's weights large enough that every expert gets
    some of a few dozen tokens."""
    import torch
    import transformers

    config_name, model_name, extra = MOE_FAMILIES[family]
    fields = {**_COMMON, "num_experts_per_tok": TOP_K, **extra, **overrides}
    config = getattr(transformers, config_name)(**fields)
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


def write_byte_level_tokenizer(path: Path, *, vocab_size: int = 400) -> Path:
    """Train a small byte-level BPE (GPT-2 / Llama 3 style) with a plain chat template and save
    it beside a checkpoint, whose vocabulary must be at least ``vocab_size``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [
        "héllo 世界 🙂 hello world",
        "the quick brown fox jumps over the lazy dog",
        "naïve café über straße déjà vu, again and again.",
    ] * 20
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"],
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>")
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    fast.save_pretrained(path)
    return path


def make_servable_checkpoint(path: Path, family: str, *, seed: int = 0) -> Path:
    """A tiny ``family`` checkpoint with a tokenizer and a chat template: what ``switchboard up``
    needs to serve it through the OpenAI API (its tokens are random, its plumbing real)."""
    make = make_moe_checkpoint if family in MOE_FAMILIES else make_family_checkpoint
    make(path, family, seed=seed, vocab_size=512)
    return write_byte_level_tokenizer(path)
