"""The few facts about a Llama-family checkpoint the engine needs, read from its HF config."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from worker.errors import ModelLoadError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: dict
    max_position_embeddings: int
    tie_word_embeddings: bool
    # Qwen2 has biases on q/k/v; Llama may via ``attention_bias``.
    qkv_bias: bool
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        """Read ``config.json`` through transformers, which normalizes old and new field names."""
        from transformers import AutoConfig

        path = Path(path)
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} is not a Hugging Face checkpoint (no config.json)")
        hf = AutoConfig.from_pretrained(path)
        if hf.model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelLoadError(
                f"model type {hf.model_type!r} is not of the Llama family "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        if getattr(hf, "mlp_bias", False):
            raise ModelLoadError("mlp_bias=True is not supported")
        num_heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
        rope = _rope_parameters(hf)
        return cls(
            model_type=hf.model_type,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            rope=rope,
            max_position_embeddings=_max_len(hf),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=hf.model_type == "qwen2" or bool(getattr(hf, "attention_bias", False)),
            eos_token_ids=_eos_ids(path, hf),
        )


def _rope_parameters(hf) -> dict:
    rope = getattr(hf, "rope_parameters", None)
    if rope:
        return dict(rope)
    rope = dict(getattr(hf, "rope_scaling", None) or {})
    rope.setdefault("rope_theta", getattr(hf, "rope_theta", 10000.0))
    return rope


def _max_len(hf) -> int:
    """Context length; a sliding window (Mistral v0.1) caps it, so full attention stays exact."""
    max_len = hf.max_position_embeddings
    window = getattr(hf, "sliding_window", None)
    uses_window = getattr(hf, "use_sliding_window", hf.model_type == "mistral")
    if window and uses_window:
        max_len = min(max_len, window)
    return max_len


def _eos_ids(path: Path, hf) -> tuple[int, ...]:
    """EOS ids from generation_config.json (chat models list several) or the model config."""
    ids: list[int] = []
    try:
        from transformers import GenerationConfig

        eos = GenerationConfig.from_pretrained(path).eos_token_id
    except OSError:
        eos = None
    for source in (eos, getattr(hf, "eos_token_id", None)):
        if source is None:
            continue
        for token_id in source if isinstance(source, list) else [source]:
            if token_id not in ids:
                ids.append(int(token_id))
    return tuple(ids)
