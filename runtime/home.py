"""Where Switchboard keeps what it derives at run time (the converted default model).

Light on purpose: the gateway and the CLI import it, and neither may pull in torch.
"""

from __future__ import annotations

import os
from pathlib import Path

HOME_ENV = "SWITCHBOARD_HOME"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def switchboard_home() -> Path:
    """`$SWITCHBOARD_HOME`, else `~/.cache/switchboard` (kept across CI runs and sessions)."""
    configured = os.environ.get(HOME_ENV)
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "switchboard"


def default_model_dir(home: Path | None = None) -> Path:
    """The converted default model's checkpoint directory (it may not exist yet)."""
    return (home or switchboard_home()) / "models" / DEFAULT_MODEL_NAME


def default_adapter_store(home: Path | None = None) -> Path:
    """Where the gateway writes adapters by content id and workers read them."""
    return (home or switchboard_home()) / "adapters"


def default_tls_dir(home: Path | None = None) -> Path:
    """Where `switchboard up` keeps the gateway⇄worker certificates (runtime/certs.py)."""
    return (home or switchboard_home()) / "tls"
