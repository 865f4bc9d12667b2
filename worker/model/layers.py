"""One decoder layer's weights, loaded from a checkpoint as its family stores them.

Where the norms sit (``NormPlacement``), whether q/k have norms, Gemma's ``w - 1`` norm storage and
Phi-3's fused tensors come from the architecture registry's ``Block``
(``worker.model.architectures``); q/k/v and gate/up end up fused into one projection each. A
sparse layer of a MoE family holds its router and experts (``worker.model.moe``) instead of the
dense MLP.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from switchboard_kernels.linear import Linear
from switchboard_kernels.linear_choice import LinearPlan
from switchboard_kernels.quantized_weight import QuantizedWeight, cat_rows
from worker.errors import ModelLoadError
from worker.model.architectures import NormPlacement, QKNorm
from worker.model.model_config import ModelConfig
from worker.model.moe import MoeWeights, load_experts
from worker.model.quantize_on_load import OnLoad, quantized


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor | None  # [hidden], before attention (None: OLMo 2)
    qkv: Linear  # hidden -> (heads + 2 * kv_heads) * head_dim, with Qwen2's biases
    o: Linear  # heads * head_dim -> hidden
    post_norm: torch.Tensor | None  # [hidden], before the MLP (None: OLMo 2)
    gate_up: Linear | None  # hidden -> 2 * intermediate (None: a sparse layer)
    down: Linear | None  # intermediate -> hidden
    # The registry's departures from the Llama block (``worker.model.architectures``).
    attn_out_norm: torch.Tensor | None = None  # [hidden], on attention's output (OLMo 2, Gemma)
    mlp_out_norm: torch.Tensor | None = None  # [hidden], on the MLP's output (OLMo 2, Gemma)
    q_norm: torch.Tensor | None = None  # [head_dim] per head, or [heads * head_dim] (OLMo 2)
    k_norm: torch.Tensor | None = None
    window: int | None = None  # sliding window (keys p - W < j <= p), None: full attention
    rope: int = 0  # index of this layer's RoPE tables
    moe: MoeWeights | None = None  # a sparse layer's router and experts (Mixtral, Qwen3-MoE)

    @property
    def dense_linears(self) -> tuple[Linear, ...]:
        """The projections every row multiplies by (a sparse layer's experts aside)."""
        mlp = () if self.gate_up is None or self.down is None else (self.gate_up, self.down)
        return (self.qkv, self.o, *mlp)


def decode_weight_bytes(
    layers: list[LayerWeights], *, lm_head: Linear, final_norm: torch.Tensor
) -> int:
    """What one decode step reads of the weights (the embedding table is only gathered from):
    a small batch's step time on CPU goes with it. A sparse layer reads its router and top_k
    experts for one token."""
    linears = [lm_head] + [lin for layer in layers for lin in layer.dense_linears]
    experts = sum(
        y.moe.routing.top_k * y.moe.expert_bytes
        + y.moe.router.numel() * y.moe.router.element_size()
        for y in layers
        if y.moe is not None
    )
    norms = [final_norm] + [
        n
        for y in layers
        for n in (y.input_norm, y.post_norm, y.attn_out_norm, y.mlp_out_norm)
        if n is not None
    ]
    return (
        sum(lin.decode_bytes for lin in linears)
        + experts
        + sum(n.numel() * n.element_size() for n in norms)
    )


def norm_weight(w: dict[str, torch.Tensor], name: str, offset: float) -> torch.Tensor:
    """A norm's weight, with Gemma's ``w - 1`` storage undone (``offset`` 1)."""
    try:
        weight = w[name]
    except KeyError:
        raise ModelLoadError(f"the checkpoint has no {name}") from None
    return weight + offset if offset else weight


def fused(
    w: dict[str, torch.Tensor | QuantizedWeight], names: list[str]
) -> torch.Tensor | QuantizedWeight:
    """Projections that read the same input, stacked by output features: plain weights, or
    weights of a published quantized checkpoint quantized alike (``cat_rows``)."""
    parts = [w[name] for name in names]
    quantized = [isinstance(p, QuantizedWeight) for p in parts]
    if not any(quantized):
        return torch.cat(parts)
    if not all(quantized):
        plain = [n for n, q in zip(names, quantized, strict=True) if not q]
        raise ModelLoadError(f"{', '.join(plain)} unquantized beside quantized parts: not served")
    try:
        return cat_rows(parts)
    except ValueError as e:
        raise ModelLoadError(f"{names[0]} and the projections fused with it: {e}") from None


def load_layer(
    w: dict[str, torch.Tensor],
    i: int,
    config: ModelConfig,
    *,
    quantization: str | None,
    plan: LinearPlan | None,
    shards: int = 1,
    on_load: OnLoad | None = None,
) -> LayerWeights:
    """Layer ``i`` of the checkpoint's tensors ``w`` (see ``LlamaModel`` for the options);
    ``shards``: a tensor-parallel group's size, ``w`` being one rank's shard (each expert holds
    its share of the intermediate features: ``worker.model.sharding``); ``on_load``: the
    projections quantized as they load (fused ones after fusing: each output feature's groups
    are its own, so that equals fusing the quantized parts)."""
    p = f"model.layers.{i}."
    attn, mlp = p + "self_attn.", p + "mlp."
    block = config.block
    experts = block.experts
    sparse = experts is not None and experts.sparse_layers[i]
    moe = gate_up = down = None
    if sparse:
        assert experts is not None
        own = replace(experts, intermediate_size=experts.intermediate_size // shards)
        moe = load_experts(w, i, own, quantization=quantization, plan=plan, on_load=on_load)
    if block.fused_checkpoint:  # Phi-3: stored in our fused order already
        qkv, gate_up = w[attn + "qkv_proj.weight"], w[mlp + "gate_up_proj.weight"]
    else:
        qkv = fused(w, [attn + f"{n}_proj.weight" for n in "qkv"])
        if not sparse:
            gate_up = fused(w, [mlp + "gate_proj.weight", mlp + "up_proj.weight"])

    def linear(name: str, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
        return Linear(quantized(on_load, name, weight), bias, quantization=quantization, plan=plan)

    if not sparse:
        down = linear(mlp + "down_proj.weight", w[mlp + "down_proj.weight"])
    bias = None
    if config.qkv_bias:
        bias = torch.cat([w[attn + f"{n}_proj.bias"] for n in "qkv"])

    def norm(name: str) -> torch.Tensor:
        return norm_weight(w, name, block.norm_offset)

    norms: dict[str, torch.Tensor | None] = {}
    if block.norm_placement is NormPlacement.PRE:
        norms["input_norm"] = norm(p + "input_layernorm.weight")
        norms["post_norm"] = norm(p + "post_attention_layernorm.weight")
    elif block.norm_placement is NormPlacement.POST:
        norms["input_norm"] = norms["post_norm"] = None
        norms["attn_out_norm"] = norm(p + "post_attention_layernorm.weight")
        norms["mlp_out_norm"] = norm(p + "post_feedforward_layernorm.weight")
    else:  # SANDWICH
        norms["input_norm"] = norm(p + "input_layernorm.weight")
        norms["attn_out_norm"] = norm(p + "post_attention_layernorm.weight")
        norms["post_norm"] = norm(p + "pre_feedforward_layernorm.weight")
        norms["mlp_out_norm"] = norm(p + "post_feedforward_layernorm.weight")
    if block.qk_norm is not QKNorm.NONE:
        norms["q_norm"] = norm(attn + "q_norm.weight")
        norms["k_norm"] = norm(attn + "k_norm.weight")
    return LayerWeights(
        qkv=linear(attn + "qkv", qkv, bias),
        o=linear(attn + "o_proj.weight", w[attn + "o_proj.weight"]),
        gate_up=None if gate_up is None else linear(mlp + "gate_up", gate_up),
        down=down,
        moe=moe,
        window=block.layer_windows[i] if block.layer_windows else None,
        rope=block.layer_ropes[i] if block.layer_ropes else 0,
        **norms,
    )
