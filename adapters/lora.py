"""The normalized adapter: per (layer, projection) float32 A, B and a scaling, plus its id.

This is what the worker loads: for a batch row using this adapter, a projection computes
`y = W x + scaling · B (A x)`, whatever the file's dtype, naming or rank/alpha patterns were;
with DoRA, `y = g ⊙ (W x + scaling · B (A x))` where `g = magnitude / ‖W + scaling · B A‖` per
output feature (row norms of the adapted weight), which the worker computes from its base weight.
With modules_to_save, the row's embeddings and logits come from the adapter's copies; with
trainable tokens, a few embedding rows are the adapter's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np

from adapters.identity import canonical_order, compute_adapter_id
from adapters.peft_config import AdapterConfig
from adapters.saved_modules import SAVED_MODULES
from adapters.trainable_tokens import TrainableTokens


@dataclass(frozen=True, slots=True)
class LoraWeights:
    """One projection's low-rank update, delta_W = scaling · B @ A. Arrays are read-only."""

    a: np.ndarray  # [r, in_features] float32
    b: np.ndarray  # [out_features, r] float32
    scaling: float  # alpha / r, or alpha / sqrt(r) with use_rslora
    # lora_alpha as configured, kept so a re-serialized adapter reproduces `scaling` bit for
    # bit (alpha·r/r need not round-trip in floating point).
    alpha: float
    magnitude: np.ndarray | None = None  # [out_features] float32: DoRA's, None for plain LoRA
    # LoRA on a MoE layer's experts (PEFT's target_parameters): A [experts * r, in] holds expert
    # e's A in rows e*r .. (e+1)*r, B [out, r * experts] its B in columns j*experts + e.
    experts: int = 1

    def __post_init__(self) -> None:
        if self.a.dtype != np.float32 or self.b.dtype != np.float32:
            raise TypeError(f"LoraWeights needs float32 arrays, got {self.a.dtype}, {self.b.dtype}")
        if self.a.ndim != 2 or self.b.ndim != 2 or self.a.shape[0] != self.b.shape[1]:
            raise ValueError(f"LoraWeights shapes A {self.a.shape}, B {self.b.shape} do not chain")
        m = self.magnitude
        if m is not None and (m.dtype != np.float32 or m.shape != (self.b.shape[0],)):
            raise ValueError(f"DoRA magnitude {m.dtype} {m.shape} does not fit B {self.b.shape}")
        # The id is a hash of these bytes: freeze them so the two cannot drift apart.
        self.a.flags.writeable = False
        self.b.flags.writeable = False
        if m is not None:
            m.flags.writeable = False

    @property
    def rank(self) -> int:
        """The rank of each expert's update (of the one update for a plain projection)."""
        return int(self.a.shape[0]) // self.experts

    @property
    def num_bytes(self) -> int:
        extra = 0 if self.magnitude is None else self.magnitude.nbytes
        return int(self.a.nbytes + self.b.nbytes + extra)


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    """A validated adapter. `id` and `num_bytes` are computed from `weights`, never passed."""

    config: AdapterConfig
    # (layer, module) → weights, in canonical order (layer, then q k v o gate up down)
    weights: Mapping[tuple[int, str], LoraWeights]
    # modules_to_save: "embed_tokens" / "lm_head" → the trained copy [vocab, hidden] float32
    # that replaces the base module for this adapter's rows (``adapters/saved_modules.py``).
    saved: Mapping[str, np.ndarray] = field(default_factory=dict)
    # trainable_token_indices: embedding rows replaced for this adapter's rows (and, on a
    # tied base, the output layer's columns of those ids; ``adapters/trainable_tokens.py``).
    tokens: TrainableTokens | None = None
    id: str = field(init=False)
    num_bytes: int = field(init=False)  # float32 bytes of all tensors: the host-cache cost

    def __post_init__(self) -> None:
        ordered = {key: self.weights[key] for key in sorted(self.weights, key=canonical_order)}
        saved = {m: self.saved[m] for m in SAVED_MODULES if m in self.saved}
        for module, table in saved.items():
            if table.dtype != np.float32 or table.ndim != 2:
                raise ValueError(f"saved {module} must be a 2-D float32 array, got {table.dtype}")
            table.flags.writeable = False
        object.__setattr__(self, "weights", MappingProxyType(ordered))
        object.__setattr__(self, "saved", MappingProxyType(saved))
        object.__setattr__(self, "id", compute_adapter_id(ordered, saved, self.tokens))
        # A tied pair shares one array: counted once.
        distinct = {id(t): t.nbytes for t in saved.values()}
        total = sum(w.num_bytes for w in ordered.values()) + sum(distinct.values())
        total += 0 if self.tokens is None else self.tokens.num_bytes
        object.__setattr__(self, "num_bytes", total)

    @property
    def uses_dora(self) -> bool:
        return any(w.magnitude is not None for w in self.weights.values())

    @property
    def max_rank(self) -> int:
        return max((w.rank for w in self.weights.values()), default=0)

    @property
    def target_modules(self) -> frozenset[str]:
        """Projection names present in at least one layer, e.g. {"q_proj", "v_proj"}."""
        return frozenset(module for _, module in self.weights)

    @property
    def layers(self) -> frozenset[int]:
        return frozenset(layer for layer, _ in self.weights)
