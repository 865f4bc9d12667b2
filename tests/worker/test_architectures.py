"""The architecture registry: what each family reads from its config, what it refuses by name."""

from __future__ import annotations

import json

import pytest
from family_factories import WINDOW

from adapters.base_model import SUPPORTED_MODEL_TYPES as ADAPTER_MODEL_TYPES
from worker.errors import ModelLoadError
from worker.model.architectures import ARCHITECTURES, Activation, NormPlacement, QKNorm
from worker.model.model_config import ModelConfig

LLAMA = {
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
}


def read(tmp_path, **fields) -> ModelConfig:
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, **fields}))
    return ModelConfig.from_pretrained(tmp_path)


def test_adapters_accept_the_bases_the_registry_serves():
    assert set(ADAPTER_MODEL_TYPES) == set(ARCHITECTURES)


def test_llama_reads_as_the_plain_llama_block(tmp_path):
    block = read(tmp_path).block
    assert block.is_llama and block.layer_windows == (None, None)


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"attn_logit_softcapping": 30.0}, "attn_logit_softcapping"),
        ({"residual_multiplier": 0.5}, "residual_multiplier"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"num_local_experts": 8}, "num_local_experts"),
        ({"hidden_act": "gelu"}, "'gelu'"),
        ({"model_type": "gpt2"}, "'gpt2'"),
        ({"model_type": "qwen3", "partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"quantization_config": {"quant_method": "gptq", "bits": 3}}, "GPTQ with bits=3"),
        ({"quantization_config": {"quant_method": "awq", "bits": 4, "version": "gemv"}}, "'gemv'"),
        ({"quantization_config": {"quant_method": "compressed-tensors"}}, "config_groups"),
        ({"quantization_config": {"quant_method": "bitsandbytes"}}, "'bitsandbytes'"),
        ({"quantization_config": {"bits": 4}}, "method 'unknown'"),
    ],
)
def test_a_math_field_the_family_does_not_read_is_refused_by_name(tmp_path, fields, named):
    with pytest.raises(ModelLoadError, match=named):
        read(tmp_path, **fields)


def test_gemma3_reads_windows_norms_and_two_ropes(tmp_path):
    fields = {
        "model_type": "gemma3_text",
        "head_dim": 16,
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 32,
        "sliding_window": WINDOW,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    }
    config = read(tmp_path, **fields)
    block = config.block
    assert block.layer_windows == (WINDOW, None)
    assert block.layer_ropes == (1, 0)
    assert block.ropes[0]["factor"] == 8.0 and block.ropes[1]["rope_theta"] == 1e4
    assert block.qk_norm is QKNorm.PER_HEAD and block.norm_placement is NormPlacement.SANDWICH
    assert block.norm_offset == 1.0 and block.activation is Activation.GELU_TANH
    assert block.attention_scale == 32**-0.5 and block.embedding_scale == 8.0
    # The window is a mask: the context is the checkpoint's, not the window.
    assert config.max_position_embeddings == 1024


def test_mistral_window_is_a_mask_not_a_context_cap(tmp_path):
    config = read(tmp_path, model_type="mistral", sliding_window=WINDOW)
    assert config.block.layer_windows == (WINDOW, WINDOW)
    assert config.max_position_embeddings == 1024
    assert not config.block.is_llama
