"""A base model's identity: the name clients use and a content id of its checkpoint.

Workers publish both in the registry (and in `Stats`); the gateway groups workers into one
pool per base by them and keys its per-base tokenizer cache by the content id, so two
checkpoints that share a name but not their weights never share a pool's answers silently.

The content id is the sha256 of the files that decide what a base computes and how its text
is read: `config.json`, the tokenizer files, and every weight file, each by name and bytes,
in name order. Only workers compute it (they hold the weights); it reads every weight byte
once at start, about a second per GB. Imports nothing heavy: the gateway reads this module.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

# What the id covers besides the weights: what the model is, and how its text is tokenized.
IDENTITY_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "chat_template.json",
)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf")
_CHUNK = 1 << 20


@dataclass(frozen=True, slots=True)
class BaseIdentity:
    """The base a worker serves: its public name and the content id of its checkpoint."""

    name: str
    content_id: str


def base_content_id(model_dir: str | Path) -> str:
    """sha256 hex over the checkpoint's identity files and weight files (name, size, bytes)."""
    root = Path(model_dir)
    files = sorted(
        p
        for p in root.iterdir()
        if p.is_file() and (p.name in IDENTITY_FILES or p.name.endswith(WEIGHT_SUFFIXES))
    )
    digest = hashlib.sha256()
    for path in files:
        digest.update(f"{path.name}\0{path.stat().st_size}\0".encode())
        with path.open("rb") as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()


def base_name_for(model: str | Path, *, served_name: str | None = None) -> str:
    """The name clients give a checkpoint: ``served_name`` when set, else its directory's name."""
    return served_name or Path(str(model)).name
