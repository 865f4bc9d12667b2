"""How a Llama-family checkpoint splits over the ranks of a tensor-parallel group.

Megatron-LM (Shoeybi et al., 2019): q/k/v and gate/up are column-parallel (each rank holds
a slice of their output features: whole attention heads, KV heads with their query heads,
a slice of the MLP's intermediate features), o and down are row-parallel (the matching
slice of their input features), so each attention block and each MLP needs one all-reduce,
after its row-parallel projection. The embedding and the output layer are split by
vocabulary rows (vocabulary-parallel), padded to a multiple of the group size. Norms are
replicated, except OLMo 2's q/k norms, which span every head: each rank holds its heads' share
and their mean square is all-reduced. Phi-3's fused tensors (``qkv_proj``, ``gate_up_proj``) are
split part by part: each rank reads its share of q, of k and of v (of gate and of up). Every split
is even: a head count (or size) the group does not divide is refused.

A MoE layer's experts (Mixtral, Qwen3-MoE) split like the dense MLP, expert by expert: each rank
holds every expert's slice of the intermediate features (gate and up by output rows, down by input
columns), so each expert's product is a partial sum and the layer's summed output needs the one
all-reduce a dense MLP needs. The router is replicated: every rank routes every token alike.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from adapters.lora import LoraWeights
from worker.errors import TensorParallelConfigError
from worker.model.architectures import QKNorm
from worker.model.model_config import ModelConfig

# The tensors split by vocabulary rows.
VOCAB_PARALLEL = ("model.embed_tokens.weight", "lm_head.weight")
# Phi-3's fused checkpoint tensors: the projections stacked in each, split one by one.
FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# One expert's projections as checkpoints name them (Mixtral's w1/w3/w2, Qwen3-MoE's): gate and
# up hold the expert's intermediate features as output rows, down as input columns.
EXPERT_OUT = ("w1", "w3", "gate_proj", "up_proj")
EXPERT_IN = ("w2", "down_proj")


@dataclass(frozen=True, slots=True)
class Shard:
    """This process's place in a tensor-parallel group: ``rank`` of ``size``."""

    rank: int
    size: int

    def span(self, features: int) -> slice:
        """This rank's even share of ``features`` (which ``size`` divides)."""
        per = features // self.size
        return slice(self.rank * per, (self.rank + 1) * per)

    def vocab_rows(self, vocab_size: int) -> int:
        """Rows of each rank's vocabulary shard: the vocabulary padded to a multiple of size."""
        return -(-vocab_size // self.size)

    def vocab_span(self, vocab_size: int) -> slice:
        """This rank's vocabulary ids (the last rank's may be fewer than ``vocab_rows``)."""
        rows = self.vocab_rows(vocab_size)
        return slice(min(self.rank * rows, vocab_size), min((self.rank + 1) * rows, vocab_size))

    def part_spans(self, sizes: Sequence[int]) -> tuple[slice, ...]:
        """This rank's rows of a tensor stacking parts of ``sizes`` rows: its share of each."""
        spans, start = [], 0
        for size in sizes:
            own = self.span(size)
            spans.append(slice(start + own.start, start + own.stop))
            start += size
        return tuple(spans)


def check_divisible(config: ModelConfig, size: int) -> None:
    """Refuse a model that ``size`` ranks cannot split evenly, naming what does not divide."""
    counts = {
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "intermediate_size": config.intermediate_size,
        "hidden_size": config.hidden_size,
    }
    if config.block.experts is not None:
        counts["expert intermediate size"] = config.block.experts.intermediate_size
    bad = [f"{name}={value}" for name, value in counts.items() if value % size]
    if bad:
        raise TensorParallelConfigError(
            f"tensor_parallel_size={size} does not divide this model's {', '.join(bad)}: "
            "each rank must hold whole attention and KV heads and an even share of the "
            "projections (choose a size that divides them)"
        )


Span = slice | tuple[slice, ...]  # a tensor's rows (or columns), or its parts' rows stacked


def weight_slicer(config: ModelConfig, shard: Shard) -> Callable[[str], tuple[int, Span] | None]:
    """For a checkpoint tensor's name, the (dim, span) this rank loads, or None: whole."""
    c = config
    q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    out_features = {
        "q_proj": q_size,
        "k_proj": kv_size,
        "v_proj": kv_size,
        "gate_proj": c.intermediate_size,
        "up_proj": c.intermediate_size,
    }
    in_features = {"o_proj": q_size, "down_proj": c.intermediate_size}
    if c.block.qk_norm is QKNorm.ACROSS_HEADS:  # OLMo 2: a weight per feature of q (of k)
        out_features |= {"q_norm": q_size, "k_norm": kv_size}
    expert_size = c.block.experts.intermediate_size if c.block.experts is not None else 0

    def select(name: str) -> tuple[int, Span] | None:
        if name in VOCAB_PARALLEL:
            return 0, shard.vocab_span(c.vocab_size)
        if ".experts." in name:
            return _expert_part(name, expert_size, shard)
        module = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
        if module in FUSED_PARTS:
            return 0, shard.part_spans([out_features[part] for part in FUSED_PARTS[module]])
        if module in out_features:  # weight [out, in] and bias [out]: output rows
            return 0, shard.span(out_features[module])
        if module in in_features and name.endswith(".weight"):
            return 1, shard.span(in_features[module])
        return None

    return select


def _expert_part(name: str, size: int, shard: Shard) -> tuple[int, Span] | None:
    """The (dim, span) of an expert tensor this rank loads: its share of the expert
    intermediate features ``size`` (transformers 5's fused [E, 2I, H] and [E, H, I] tensors,
    or one expert's projection as the hub stores it)."""
    if name.endswith("experts.gate_up_proj"):
        return 1, shard.part_spans([size, size])
    if name.endswith("experts.down_proj"):
        return 2, shard.span(size)
    module = name.rsplit(".", 2)[-2]
    if module in EXPERT_OUT:
        return 0, shard.span(size)
    if module in EXPERT_IN and name.endswith(".weight"):
        return 1, shard.span(size)
    return None


def expert_lora_shard(
    weights: LoraWeights, module: str, intermediate: int, shard: Shard
) -> LoraWeights:
    """This rank's part of one layer's expert LoRA (``module``: ``experts.gate_up_proj`` or
    ``experts.down_proj``; ``intermediate``: each expert's, whole), lined up with the experts'
    split so that it needs no exchange of its own. gate_up (column-parallel): A whole, B's rows of
    this rank's gate and up features; every rank does the whole shrink, a few columns per row.
    down (row-parallel): A's columns of this rank's input features, B whole; each rank's shrink is
    a partial sum and so is its expand (B is linear), which the layer's all-reduce completes.
    S-LoRA's exchange between shrink and expand would cost a collective per expert."""
    if module == "experts.gate_up_proj":
        spans = shard.part_spans([intermediate, intermediate])
        b = np.concatenate([weights.b[s] for s in spans])
        return replace(weights, a=weights.a.copy(), b=b)
    a = np.ascontiguousarray(weights.a[:, shard.span(intermediate)])
    return replace(weights, a=a, b=weights.b.copy())
