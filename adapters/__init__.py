"""PEFT LoRA adapters: read, validate and normalize them, identify them by content, store them.

Shared by the gateway (upload) and the worker (load); imports neither torch nor triton.

    adapter = load_adapter_dir(path, base=BaseModelSpec.from_config_dict(cfg),
                               max_lora_rank=64, max_bytes=256 << 20)
    adapter.id                                   # sha256 hex of the normalized content
    adapter.weights[(layer, "q_proj")].a / .b / .scaling   # float32 [r, in], [out, r], float
    store = FilesystemAdapterStore(root); store.put(adapter); store.get(adapter.id)
"""

from adapters.archive import ArchiveLimits, unpack_adapter_archive
from adapters.base_model import PROJECTIONS, BaseModelSpec
from adapters.errors import (
    AdapterError,
    AdapterNotFoundError,
    AdapterTooLargeError,
    IncompatibleAdapterError,
    InvalidAdapterError,
    InvalidAdapterIdError,
    UnsafeArchiveError,
    UnsupportedAdapterFeatureError,
)
from adapters.identity import check_adapter_id, compute_adapter_id, is_adapter_id
from adapters.lora import LoraAdapter, LoraWeights
from adapters.peft_config import AdapterConfig, parse_adapter_config
from adapters.peft_format import load_adapter_dir, parse_adapter
from adapters.store import AdapterStore, FilesystemAdapterStore

__all__ = [
    "PROJECTIONS",
    "AdapterConfig",
    "AdapterError",
    "AdapterNotFoundError",
    "AdapterStore",
    "AdapterTooLargeError",
    "ArchiveLimits",
    "BaseModelSpec",
    "FilesystemAdapterStore",
    "IncompatibleAdapterError",
    "InvalidAdapterError",
    "InvalidAdapterIdError",
    "LoraAdapter",
    "LoraWeights",
    "UnsafeArchiveError",
    "UnsupportedAdapterFeatureError",
    "check_adapter_id",
    "compute_adapter_id",
    "is_adapter_id",
    "load_adapter_dir",
    "parse_adapter",
    "parse_adapter_config",
    "unpack_adapter_archive",
]
