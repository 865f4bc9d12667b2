"""Rotary position embeddings (Su et al., RoFormer 2021), with the scalings Llama 3 uses and
Phi-3's LongRoPE (Ding et al., 2024): per-frequency short and long factors, the long ones for a
sequence longer than ``original_max_position_embeddings`` (``long_rope_threshold``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from worker.errors import ModelLoadError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")
_LONG_ROPE_TYPES = ("longrope", "su")  # "su": the name of Phi-3's first configs


def _rope_type(rope: dict) -> str:
    return rope.get("rope_type", rope.get("type", "default")) or "default"


def long_rope_threshold(rope: dict) -> int | None:
    """LongRoPE: the length past which a sequence rotates with the long factors (None: not
    LongRoPE). As transformers' Phi-3 does, the whole sequence switches at once, the keys
    already cached included."""
    if _rope_type(rope) not in _LONG_ROPE_TYPES:
        return None
    return int(rope["original_max_position_embeddings"])


def rotary_dim(head_dim: int, rope: dict) -> int:
    """The leading features of each head that RoPE rotates (Phi-4-mini: ``partial_rotary_factor``
    0.75; the rest pass through)."""
    return int(head_dim * (rope.get("partial_rotary_factor") or 1.0))


def inverse_frequencies(head_dim: int, rope: dict, *, long: bool = False) -> torch.Tensor:
    """[head_dim // 2] fp32 inverse frequencies for HF's ``rope_parameters`` dict
    (``long``: LongRoPE's long factors, else its short ones)."""
    base = float(rope.get("rope_theta", 10000.0))
    rope_type = _rope_type(rope)
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (base**exponents)
    if rope_type in _LONG_ROPE_TYPES:
        factors = rope["long_factor" if long else "short_factor"]
        if len(factors) != head_dim // 2:
            raise ModelLoadError(
                f"longrope has {len(factors)} factors for a rotary dimension of {head_dim}"
            )
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * base**exponents)
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(rope["factor"])
    if rope_type == "llama3":
        return _llama3_scaling(inv_freq, rope)
    raise ModelLoadError(
        f"rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
    )


def _llama3_scaling(inv_freq: torch.Tensor, rope: dict) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by ``factor``, blend in between."""
    factor = float(rope["factor"])
    low_freq_factor = float(rope["low_freq_factor"])
    high_freq_factor = float(rope["high_freq_factor"])
    old_context = float(rope["original_max_position_embeddings"])
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _attention_factor(rope: dict, max_positions: int) -> float:
    """LongRoPE's scale on cos and sin (so on the scores, squared): the config's, else
    sqrt(1 + ln(factor) / ln(original context)), ``factor`` defaulting to the context's growth."""
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])
    original = int(rope["original_max_position_embeddings"])
    factor = rope.get("factor") or max_positions / original
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(original))


@dataclass(frozen=True, slots=True)
class RopeTables:
    """cos and sign-folded sin per position, each [max_positions, rotary_dim] (``rotary_dim``:
    head_dim, or its leading part under a partial rotary factor).

    HF's rotate-half form is ``x * cos + cat(-x2, x1) * sin``. Folding the minus sign into
    the first half of ``sin`` turns ``cat(-x2, x1)`` into ``roll(x, half)``, so applying
    RoPE costs three ops instead of five, with the same products and sums.

    LongRoPE: [2 * max_positions, head_dim], the short factors' rows then the long ones', both
    times the attention factor: a row of a long sequence looks up ``position + max_positions``.
    """

    cos: torch.Tensor
    signed_sin: torch.Tensor

    @classmethod
    def build(cls, head_dim: int, rope: dict, max_positions: int, dtype: torch.dtype) -> RopeTables:
        head_dim = rotary_dim(head_dim, rope)
        positions = torch.arange(max_positions, dtype=torch.float32)
        variants = [False] if long_rope_threshold(rope) is None else [False, True]
        scale = 1.0 if len(variants) == 1 else _attention_factor(rope, max_positions)
        # computed in fp32, then cast; [rows, head_dim // 2]
        freqs = torch.cat(
            [torch.outer(positions, inverse_frequencies(head_dim, rope, long=v)) for v in variants]
        )
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        if scale != 1.0:
            cos, sin = cos * scale, sin * scale
        half = head_dim // 2
        signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1).to(dtype)
        return cls(cos.to(dtype), signed_sin)

    def to(self, device: torch.device | str) -> RopeTables:
        return RopeTables(self.cos.to(device), self.signed_sin.to(device))

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for each position, shaped [num_tokens, 1, head_dim]."""
        return self.cos[positions].unsqueeze(1), self.signed_sin[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; cos/signed_sin: [tokens, 1, head_dim] (rotate-half)."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)


def apply_partial_rope(
    x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor
) -> torch.Tensor:
    """``apply_rope`` on the leading ``rotary_dim`` features of each head (cos/signed_sin's
    width); the rest pass through."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return apply_rope(x, cos, signed_sin)
    return torch.cat((apply_rope(x[..., :rot], cos, signed_sin), x[..., rot:]), dim=-1)
