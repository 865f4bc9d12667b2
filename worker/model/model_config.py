"""The few facts about a checkpoint the engine needs, read from its HF config; how its decoder
block departs from Llama's comes from the architecture registry (``worker.model.architectures``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from worker.errors import ModelLoadError
from worker.model.architectures import ARCHITECTURES, Block, read_block
from worker.model.quantized_checkpoints import Reader, checkpoint_reader

SUPPORTED_MODEL_TYPES = tuple(ARCHITECTURES)


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
    # How the block departs from Llama's (the registry's reading of the config).
    block: Block = field(default_factory=Block)
    # A checkpoint published quantized: its format's reader (``worker.model.quantized_checkpoints``)
    quantization: Reader | None = None

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        """Read ``config.json`` through transformers, which normalizes old and new field names."""
        from transformers import AutoConfig

        path = Path(path)
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} is not a Hugging Face checkpoint (no config.json)")
        hf = AutoConfig.from_pretrained(path)
        quantization = checkpoint_reader(hf)  # refuses a method or option not served, by name
        block = read_block(hf, hf.num_hidden_layers)
        num_heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
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
            rope=block.ropes[0],
            max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=hf.model_type == "qwen2" or bool(getattr(hf, "attention_bias", False)),
            eos_token_ids=_eos_ids(path, hf),
            block=block,
            quantization=quantization,
        )


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
