"""Loading a checkpoint's tokenizer (and its chat template) through transformers."""

from __future__ import annotations

from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def load_tokenizer(path: str | Path):
    """The checkpoint's HF tokenizer, or None when it ships none (token-id-only use)."""
    path = Path(path)
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
