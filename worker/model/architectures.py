"""The architecture registry: how each supported ``model_type``'s decoder differs from Llama's.

One decoder (``worker.model.llama``) serves every dense family; each family is an entry here that
reads, from its Hugging Face config, a ``Block``: the few facts in which its math departs from the
Llama block (RMSNorm before attention and MLP, RoPE, SiLU-gated MLP, ``head_dim ** -0.5``). vLLM's
``models/gemma2.py``, ``gemma3.py``, ``phi3.py``, ``olmo2.py``, ``granite.py`` map the differences;
here each is data, read once at load. A config field that changes the math and that the entry does
not read is refused by name (``MATH_FIELDS``), never ignored. A new family is one more entry: its
reader and the fields it handles. The sparse MoE families (Mixtral, Qwen3-MoE) are the same block
with ``Experts`` in place of the dense MLP on their sparse layers (``worker.model.moe``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from worker.errors import ModelLoadError


class NormPlacement(Enum):
    PRE = "pre"  # Llama: x + f(norm(x))
    POST = "post"  # OLMo 2: x + norm(f(x))
    SANDWICH = "sandwich"  # Gemma 2/3: x + norm(f(norm(x)))


class QKNorm(Enum):
    NONE = "none"
    PER_HEAD = "per_head"  # Qwen3, Gemma 3: RMSNorm over each head's head_dim, before RoPE
    ACROSS_HEADS = "across_heads"  # OLMo 2: RMSNorm over the whole q (k) projection, before RoPE


class Activation(Enum):
    SILU = "silu"
    GELU_TANH = "gelu_tanh"


@dataclass(frozen=True, slots=True)
class Experts:
    """A sparse mixture-of-experts MLP: each token's MLP output is the weighted sum of the
    outputs of the ``top_k`` experts (of ``num_experts``) its router ranks highest."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's (Qwen3-MoE: moe_intermediate_size)
    # Divide the top-k probabilities by their sum (Mixtral always; Qwen3-MoE's norm_topk_prob).
    normalize: bool
    # Qwen3-MoE rounds the routing weights to the model's dtype before scaling the experts'
    # outputs; Mixtral scales by the fp32 weights and rounds the product.
    weights_in_model_dtype: bool
    # Per layer: True where the MLP is sparse, False for a dense MLP (Qwen3-MoE's
    # ``mlp_only_layers`` and ``decoder_sparse_step``).
    sparse_layers: tuple[bool, ...]


@dataclass(frozen=True, slots=True)
class Block:
    """How one checkpoint's decoder departs from the Llama block (the defaults are Llama's)."""

    qk_norm: QKNorm = QKNorm.NONE
    norm_placement: NormPlacement = NormPlacement.PRE
    # Gemma stores RMSNorm weights as w - 1 (``x * (1 + w)``): added back at load.
    norm_offset: float = 0.0
    activation: Activation = Activation.SILU
    embedding_scale: float = 1.0  # Gemma: sqrt(hidden); Granite: embedding_multiplier
    attention_scale: float | None = None  # None: head_dim ** -0.5
    residual_multiplier: float = 1.0  # Granite: x + m * f(x)
    logits_scale: float = 1.0  # Granite: logits / logits_scaling
    attention_softcap: float | None = None  # Gemma 2: cap * tanh(scores / cap)
    final_softcap: float | None = None  # Gemma 2: the same on the logits
    # Per layer: None (full attention) or the window W (a query at p sees keys p - W < j <= p).
    layer_windows: tuple[int | None, ...] = ()
    # Per layer: the index into ``ropes`` of its RoPE parameters (Gemma 3: local and global).
    layer_ropes: tuple[int, ...] = ()
    ropes: tuple[dict, ...] = field(default_factory=tuple)
    # Phi-3: q/k/v and gate/up are stored fused (``qkv_proj``, ``gate_up_proj``).
    fused_checkpoint: bool = False
    # Mixtral, Qwen3-MoE: the sparse MLP of the layers ``experts.sparse_layers`` names.
    experts: Experts | None = None

    @property
    def is_llama(self) -> bool:
        """The Llama block exactly (whatever the checkpoint's tensor names and RoPE scaling)."""
        return (
            self.qk_norm is QKNorm.NONE
            and self.norm_placement is NormPlacement.PRE
            and not self.norm_offset
            and self.activation is Activation.SILU
            and self.embedding_scale == 1.0
            and self.attention_scale is None
            and self.residual_multiplier == 1.0
            and self.logits_scale == 1.0
            and self.plain_attention
            and self.final_softcap is None
            and len(self.ropes) <= 1
            and self.experts is None
        )

    @property
    def windowed(self) -> bool:
        return any(w is not None for w in self.layer_windows)

    @property
    def plain_attention(self) -> bool:
        """Every layer's attention is Llama's (no window, no soft-cap): any kernel serves it."""
        return not self.windowed and self.attention_softcap is None


@dataclass(frozen=True, slots=True)
class Architecture:
    """A registry entry: how to read a ``Block`` from the config, and the math fields it reads."""

    read: Callable[[Any, int], Block]  # (hf config, num_layers) -> Block
    handles: frozenset[str]
    activations: frozenset[str] = frozenset({"silu"})


# Config fields that change the math, with the value that leaves it Llama's. A field present with
# another value, on a model_type whose entry does not handle it, is refused by name.
MATH_FIELDS: dict[str, Callable[[Any], bool]] = {
    "sliding_window": lambda v: v is None,
    "use_sliding_window": lambda v: not v,
    "attn_logit_softcapping": lambda v: v is None,
    "final_logit_softcapping": lambda v: v is None,
    "query_pre_attn_scalar": lambda v: v is None,
    "embedding_multiplier": lambda v: v is None or v == 1.0,
    "residual_multiplier": lambda v: v is None or v == 1.0,
    "attention_multiplier": lambda v: v is None,
    "logits_scaling": lambda v: v is None or v == 1.0,
    "partial_rotary_factor": lambda v: v is None or v == 1.0,
    "mlp_bias": lambda v: not v,
    "clip_qkv": lambda v: v is None,
    "use_qk_norm": lambda v: not v,
    "qk_layernorm": lambda v: not v,
    "use_bidirectional_attention": lambda v: not v,
    "use_parallel_residual": lambda v: not v,
    "no_rope_layers": lambda v: not v or all(v),
    "num_experts": lambda v: not v,
    "num_local_experts": lambda v: not v,
    "n_routed_experts": lambda v: not v,
    "shared_expert_intermediate_size": lambda v: not v,
    "n_shared_experts": lambda v: not v,
    "altup_num_inputs": lambda v: v is None,
    "pretraining_tp": lambda v: v is None or v == 1,
}


def _layer_windows(hf: Any, num_layers: int) -> tuple[int | None, ...]:
    """Each layer's window: ``layer_types`` names them (Gemma 2/3, Qwen2/3), else a
    ``sliding_window`` covers every layer (Mistral, Phi-3)."""
    window = getattr(hf, "sliding_window", None)
    types = getattr(hf, "layer_types", None)
    if types is not None:
        if len(types) != num_layers:
            raise ModelLoadError(f"layer_types has {len(types)} entries for {num_layers} layers")
        unknown = sorted({t for t in types} - {"full_attention", "sliding_attention"})
        if unknown:
            raise ModelLoadError(f"layer_types: {', '.join(unknown)} attention is not supported")
        if "sliding_attention" in types and not window:
            raise ModelLoadError("layer_types names sliding_attention but sliding_window is unset")
        return tuple(window if t == "sliding_attention" else None for t in types)
    return (window or None,) * num_layers


def _rope(hf: Any) -> dict:
    rope = getattr(hf, "rope_parameters", None)
    if rope:
        return dict(rope)
    rope = dict(getattr(hf, "rope_scaling", None) or {})
    rope.setdefault("rope_theta", getattr(hf, "rope_theta", 10000.0))
    return rope


def _one_rope(hf: Any, num_layers: int, *, partial: bool = False) -> dict[str, Any]:
    """One RoPE for every layer; ``partial``: it may rotate only the first
    ``partial_rotary_factor`` of each head (Phi-4-mini), else that is refused."""
    rope = _rope(hf)
    factor = rope.get("partial_rotary_factor", 1.0)
    if factor not in (None, 1.0) and not partial:
        raise ModelLoadError(f"partial_rotary_factor={factor} is not supported")
    return {"ropes": (rope,), "layer_ropes": (0,) * num_layers}


def _llama(hf: Any, n: int) -> Block:
    return Block(layer_windows=_layer_windows(hf, n), **_one_rope(hf, n))


def _qwen3(hf: Any, n: int) -> Block:
    return Block(qk_norm=QKNorm.PER_HEAD, layer_windows=_layer_windows(hf, n), **_one_rope(hf, n))


def _olmo2(hf: Any, n: int) -> Block:
    return Block(
        qk_norm=QKNorm.ACROSS_HEADS,
        norm_placement=NormPlacement.POST,
        layer_windows=_layer_windows(hf, n),
        **_one_rope(hf, n),
    )


def _granite(hf: Any, n: int) -> Block:
    return Block(
        embedding_scale=float(hf.embedding_multiplier),
        attention_scale=float(hf.attention_multiplier),
        residual_multiplier=float(hf.residual_multiplier),
        logits_scale=1.0 / float(hf.logits_scaling),
        layer_windows=_layer_windows(hf, n),
        **_one_rope(hf, n),
    )


def _gemma_common(hf: Any) -> dict[str, Any]:
    return {
        "norm_placement": NormPlacement.SANDWICH,
        "norm_offset": 1.0,
        "activation": Activation.GELU_TANH,
        "embedding_scale": math.sqrt(hf.hidden_size),
        "attention_scale": float(hf.query_pre_attn_scalar) ** -0.5,
        "attention_softcap": getattr(hf, "attn_logit_softcapping", None),
        "final_softcap": getattr(hf, "final_logit_softcapping", None),
    }


def _gemma2(hf: Any, n: int) -> Block:
    return Block(layer_windows=_layer_windows(hf, n), **_one_rope(hf, n), **_gemma_common(hf))


def _gemma3(hf: Any, n: int) -> Block:
    """Gemma 3: Gemma 2's block with q/k norms; sliding layers rotate with a local RoPE base,
    full layers with the (maybe scaled) global one."""
    rope = _rope(hf)
    if set(rope) != {"full_attention", "sliding_attention"}:
        raise ModelLoadError(f"gemma3_text rope_parameters {rope!r}: expected one per layer type")
    windows = _layer_windows(hf, n)
    return Block(
        qk_norm=QKNorm.PER_HEAD,
        layer_windows=windows,
        ropes=(dict(rope["full_attention"]), dict(rope["sliding_attention"])),
        layer_ropes=tuple(0 if w is None else 1 for w in windows),
        **_gemma_common(hf),
    )


def _phi3(hf: Any, n: int) -> Block:
    return Block(
        fused_checkpoint=True, layer_windows=_layer_windows(hf, n), **_one_rope(hf, n, partial=True)
    )


def _mixtral(hf: Any, n: int) -> Block:
    experts = Experts(
        num_experts=int(hf.num_local_experts),
        top_k=int(hf.num_experts_per_tok),
        intermediate_size=int(hf.intermediate_size),
        normalize=True,
        weights_in_model_dtype=False,
        sparse_layers=(True,) * n,
    )
    return Block(experts=experts, layer_windows=_layer_windows(hf, n), **_one_rope(hf, n))


def _qwen3_moe(hf: Any, n: int) -> Block:
    """Qwen3's block; layer i's MLP is sparse unless listed in ``mlp_only_layers``, where
    ``(i + 1) % decoder_sparse_step == 0`` (what transformers' decoder layer tests)."""
    dense = set(getattr(hf, "mlp_only_layers", None) or ())
    step = int(getattr(hf, "decoder_sparse_step", 1) or 1)
    num_experts = int(hf.num_experts)
    sparse = tuple(i not in dense and num_experts > 0 and (i + 1) % step == 0 for i in range(n))
    experts = Experts(
        num_experts=num_experts,
        top_k=int(hf.num_experts_per_tok),
        intermediate_size=int(hf.moe_intermediate_size),
        normalize=bool(getattr(hf, "norm_topk_prob", False)),
        weights_in_model_dtype=True,
        sparse_layers=sparse,
    )
    return Block(
        qk_norm=QKNorm.PER_HEAD,
        experts=experts if any(sparse) else None,
        layer_windows=_layer_windows(hf, n),
        **_one_rope(hf, n),
    )


_WINDOWS = frozenset({"sliding_window", "use_sliding_window"})
_GEMMA = frozenset({"query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"})
_GELU = frozenset({"gelu_pytorch_tanh"})

ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture(_llama, frozenset({"pretraining_tp"})),
    "mistral": Architecture(_llama, _WINDOWS),
    "qwen2": Architecture(_llama, _WINDOWS),
    "qwen3": Architecture(_qwen3, _WINDOWS),
    "olmo2": Architecture(_olmo2, frozenset()),
    "granite": Architecture(
        _granite,
        frozenset({"embedding_multiplier", "residual_multiplier"})
        | frozenset({"attention_multiplier", "logits_scaling"}),
    ),
    "gemma2": Architecture(_gemma2, _WINDOWS | _GEMMA, _GELU),
    "gemma3_text": Architecture(_gemma3, _WINDOWS | _GEMMA, _GELU),
    "phi3": Architecture(_phi3, _WINDOWS | {"partial_rotary_factor"}),
    # The expert count under either name (each config maps one to the other).
    "mixtral": Architecture(_mixtral, _WINDOWS | {"num_local_experts", "num_experts"}),
    "qwen3_moe": Architecture(_qwen3_moe, _WINDOWS | {"num_experts", "num_local_experts"}),
}


def read_block(hf: Any, num_layers: int) -> Block:
    """The ``Block`` of an HF config, or ``ModelLoadError`` naming what is not served."""
    arch = ARCHITECTURES.get(hf.model_type)
    if arch is None:
        raise ModelLoadError(
            f"model type {hf.model_type!r} is not supported "
            f"(supported: {', '.join(sorted(ARCHITECTURES))})"
        )
    for name, neutral in MATH_FIELDS.items():
        value = getattr(hf, name, None)
        if name not in arch.handles and not neutral(value):
            raise ModelLoadError(
                f"{hf.model_type} config field {name}={value!r} changes the model's math and "
                "is not supported for this model type"
            )
    act = getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", "silu")
    if act not in arch.activations:
        raise ModelLoadError(
            f"{hf.model_type} activation {act!r} is not supported "
            f"(supported: {', '.join(sorted(arch.activations))})"
        )
    return arch.read(hf, num_layers)
