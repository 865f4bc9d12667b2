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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from worker.errors import TensorParallelConfigError
from worker.model.architectures import QKNorm
from worker.model.model_config import ModelConfig

# The tensors split by vocabulary rows.
VOCAB_PARALLEL = ("model.embed_tokens.weight", "lm_head.weight")
# Phi-3's fused checkpoint tensors: the projections stacked in each, split one by one.
FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


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
    """Refuse a model that ``size`` ranks cannot split evenly, naming what does not divide,
    or whose experts would have to be split (a MoE model's experts are not split yet)."""
    if size > 1 and config.block.experts is not None:
        raise TensorParallelConfigError(
            f"tensor parallelism is not supported for {config.model_type} models yet"
        )
    counts = {
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "intermediate_size": config.intermediate_size,
        "hidden_size": config.hidden_size,
    }
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

    def select(name: str) -> tuple[int, Span] | None:
        if name in VOCAB_PARALLEL:
            return 0, shard.vocab_span(c.vocab_size)
        module = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
        if module in FUSED_PARTS:
            return 0, shard.part_spans([out_features[part] for part in FUSED_PARTS[module]])
        if module in out_features:  # weight [out, in] and bias [out]: output rows
            return 0, shard.span(out_features[module])
        if module in in_features and name.endswith(".weight"):
            return 1, shard.span(in_features[module])
        return None

    return select
