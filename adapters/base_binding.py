"""Which served base an uploaded adapter is bound to.

An upload may name its base explicitly (the gateway's `base_model` form field), and PEFT writes
the base it trained on into adapter_config.json (`base_model_name_or_path`: a hub id such as
`Qwen/Qwen3-0.6B` or a local path). The explicit name wins; either matches a served base by its
name or by its last path component (`Qwen/Qwen3-0.6B` → `Qwen3-0.6B`). An adapter naming
neither is bound to the default base, as every adapter was before bases were named. A name no
served base matches is refused (400): validating it against another base's shapes could pass
and serve something the tenant never trained.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from pathlib import Path, PurePosixPath

from adapters.errors import IncompatibleAdapterError

CONFIG_FILE = "adapter_config.json"
MAX_CONFIG_BYTES = 1 << 20  # as adapters.peft_config reads it


def declared_base(adapter_dir: Path) -> str | None:
    """adapter_config.json's `base_model_name_or_path` (None: absent, empty or not a string);
    a config that cannot be read is left to the full validation that follows."""
    path = adapter_dir / CONFIG_FILE
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            return None
        raw = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    value = raw.get("base_model_name_or_path") if isinstance(raw, dict) else None
    return value.strip() or None if isinstance(value, str) else None


def choose_base(
    *, explicit: str | None, declared: str | None, served: Collection[str], default: str
) -> str:
    """The served base the adapter is bound to (see the module docstring)."""
    wanted = explicit or declared
    if wanted is None:
        return default
    if wanted in served:
        return wanted
    tail = PurePosixPath(wanted.rstrip("/")).name
    if tail in served:
        return tail
    field = "base_model" if explicit else "base_model_name_or_path"
    where = "the `base_model` field" if explicit else f"{CONFIG_FILE}'s base_model_name_or_path"
    raise IncompatibleAdapterError(
        f"{where} names the base model {wanted[:200]!r}, which no worker here serves "
        f"(served: {', '.join(sorted(served))}); name a served base in the `base_model` form "
        "field",
        field=field,
    )
