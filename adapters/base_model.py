"""The few facts about the base model that decide whether a LoRA adapter fits it.

Read straight from an HF `config.json` dict, without transformers, so the gateway can
validate uploads without importing torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# The LoRA-targetable projections of a Llama-family decoder layer → the submodule holding
# them (`model.layers.{i}.self_attn.q_proj`, `model.layers.{i}.mlp.down_proj`). The order is
# the canonical order used for identity and serialization.
PROJECTIONS: dict[str, str] = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
# Phi-3 stores q/k/v and gate/up fused, and PEFT targets the fused modules.
FUSED_PROJECTIONS: dict[str, str] = {
    "qkv_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_up_proj": "mlp",
    "down_proj": "mlp",
}
# Every projection name of every family, in the canonical order (Llama's first).
ALL_PROJECTIONS: dict[str, str] = {**PROJECTIONS, **FUSED_PROJECTIONS}
# LoRA on a MoE base's experts (PEFT's target_parameters on the fused expert tensors
# mlp.experts.gate_up_proj [E, 2I, H] and down_proj [E, H, I]), named as modules here.
EXPERT_PROJECTIONS: dict[str, str] = {"experts.gate_up_proj": "mlp", "experts.down_proj": "mlp"}
# Every module an adapter's weights may be keyed by, in the canonical order.
MODULE_PARENTS: dict[str, str] = {**ALL_PROJECTIONS, **EXPERT_PROJECTIONS}
# The MLP projections, which a MoE base has only on its dense layers (Qwen3-MoE's
# mlp_only_layers; none on Mixtral).
MLP_PROJECTIONS = frozenset({"gate_proj", "up_proj", "down_proj", "gate_up_proj"})

# The families the worker's architecture registry serves (worker/model/architectures.py; a test
# holds the two lists together), all with Llama's projection names.
_FUSED_MODEL_TYPES = frozenset({"phi3"})
_MOE_MODEL_TYPES = frozenset({"mixtral", "qwen3_moe"})
SUPPORTED_MODEL_TYPES = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "olmo2", "granite", "gemma2", "gemma3_text"}
    | _FUSED_MODEL_TYPES
    | _MOE_MODEL_TYPES
)

# Families whose transformers config class ties the embeddings by default.
_TIED_BY_DEFAULT = frozenset({"gemma2", "gemma3_text"})


@dataclass(frozen=True, slots=True)
class BaseModelSpec:
    """Shapes of a base model (Llama, Mistral, Qwen2/3, OLMo 2, Granite, Gemma 2/3, Phi-3, and
    the MoE families Mixtral and Qwen3-MoE)."""

    model_type: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    # MoE bases: experts per sparse layer, each expert's intermediate size, and per layer
    # whether its MLP is sparse (0, 0, () for a dense base).
    num_experts: int = 0
    expert_intermediate_size: int = 0
    sparse_layers: tuple[bool, ...] = ()
    # The output layer is the embedding (PEFT then ties saved copies under ensure_weight_tying
    # and trainable token rows); a config.json leaves it out when it is the class default.
    tie_word_embeddings: bool = False

    @classmethod
    def from_config_dict(cls, config: Mapping[str, Any]) -> BaseModelSpec:
        """Read an HF `config.json` dict; head_dim and num_key_value_heads take HF defaults."""
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"base model_type {model_type!r} is not one of {sorted(SUPPORTED_MODEL_TYPES)}"
            )

        def positive_int(name: str, value: Any) -> int:
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(
                    f"base config.json: {name} must be a positive integer, got {value!r}"
                )
            return value

        hidden = positive_int("hidden_size", config.get("hidden_size"))
        heads = positive_int("num_attention_heads", config.get("num_attention_heads"))
        kv_heads = config.get("num_key_value_heads")
        head_dim = config.get("head_dim")  # Mistral writes an explicit null
        num_layers = positive_int("num_hidden_layers", config.get("num_hidden_layers"))
        moe = _experts(config, model_type, num_layers, positive_int)
        return cls(
            model_type=model_type,
            num_layers=num_layers,
            hidden_size=hidden,
            intermediate_size=positive_int("intermediate_size", config.get("intermediate_size")),
            num_heads=heads,
            num_kv_heads=positive_int(
                "num_key_value_heads", heads if kv_heads is None else kv_heads
            ),
            head_dim=positive_int("head_dim", hidden // heads if head_dim is None else head_dim),
            vocab_size=positive_int("vocab_size", config.get("vocab_size")),
            tie_word_embeddings=bool(
                config.get("tie_word_embeddings", model_type in _TIED_BY_DEFAULT)
            ),
            **moe,
        )

    @property
    def projections(self) -> dict[str, str]:
        """This base's LoRA-targetable projections → their submodule, in canonical order."""
        if self.model_type in _FUSED_MODEL_TYPES:
            return FUSED_PROJECTIONS
        if self.sparse_layers and all(self.sparse_layers):  # no dense MLP anywhere (Mixtral)
            return {m: p for m, p in PROJECTIONS.items() if m not in MLP_PROJECTIONS}
        return PROJECTIONS

    def has_module(self, layer: int, module: str) -> bool:
        """Whether layer ``layer`` has projection ``module`` (a MoE base's sparse layers have
        no dense MLP)."""
        if module not in self.projections:
            return False
        return not (module in MLP_PROJECTIONS and self.sparse_layers and self.sparse_layers[layer])

    def projection_shape(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of one projection (one expert's for EXPERT_PROJECTIONS);
        `module` is a key of MODULE_PARENTS."""
        q_out = self.num_heads * self.head_dim
        kv_out = self.num_kv_heads * self.head_dim
        shapes = {
            "q_proj": (self.hidden_size, q_out),
            "k_proj": (self.hidden_size, kv_out),
            "v_proj": (self.hidden_size, kv_out),
            "o_proj": (q_out, self.hidden_size),
            "gate_proj": (self.hidden_size, self.intermediate_size),
            "up_proj": (self.hidden_size, self.intermediate_size),
            "down_proj": (self.intermediate_size, self.hidden_size),
            "qkv_proj": (self.hidden_size, q_out + 2 * kv_out),
            "gate_up_proj": (self.hidden_size, 2 * self.intermediate_size),
            # one expert's
            "experts.gate_up_proj": (self.hidden_size, 2 * self.expert_intermediate_size),
            "experts.down_proj": (self.expert_intermediate_size, self.hidden_size),
        }
        return shapes[module]


def _experts(
    config: Mapping[str, Any], model_type: str, num_layers: int, positive_int: Any
) -> dict[str, Any]:
    """A MoE base's expert count, expert size and sparse layers, as transformers reads them
    (Qwen3-MoE: layer i is sparse unless in mlp_only_layers, where (i + 1) % step == 0)."""
    # Either name (transformers maps one to the other; Qwen3-MoE's hub configs say num_experts).
    count = config.get("num_local_experts", config.get("num_experts"))
    if model_type == "mixtral":
        return {
            "num_experts": positive_int("num_local_experts", 8 if count is None else count),
            "expert_intermediate_size": positive_int(
                "intermediate_size", config.get("intermediate_size")
            ),
            "sparse_layers": (True,) * num_layers,
        }
    if model_type == "qwen3_moe":
        dense = config.get("mlp_only_layers") or []
        if not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
            raise ValueError(f"base config.json: mlp_only_layers must be a list, got {dense!r}")
        step = positive_int("decoder_sparse_step", config.get("decoder_sparse_step", 1))
        experts = positive_int("num_experts", 128 if count is None else count)
        return {
            "num_experts": experts,
            "expert_intermediate_size": positive_int(
                "moe_intermediate_size", config.get("moe_intermediate_size", 768)
            ),
            "sparse_layers": tuple(
                i not in dense and (i + 1) % step == 0 for i in range(num_layers)
            ),
        }
    return {}
