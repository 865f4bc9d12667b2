"""The worker: Switchboard's inference engine and (later) its gRPC service.

The public names load lazily, so light modules such as ``worker.errors`` or
``worker.model.default_model`` import without pulling in torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from worker.core.config import EngineConfig, engine_config
    from worker.core.outputs import RequestOutput
    from worker.engine.llm_engine import LLMEngine
    from worker.llm import LLM
    from worker.sampling.sampling_params import SamplingParams

_EXPORTS = {
    "EngineConfig": "worker.core.config",
    "engine_config": "worker.core.config",
    "LLM": "worker.llm",
    "LLMEngine": "worker.engine.llm_engine",
    "RequestOutput": "worker.core.outputs",
    "SamplingParams": "worker.sampling.sampling_params",
}

__all__ = ["LLM", "EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams", "engine_config"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'worker' has no attribute {name!r}")
