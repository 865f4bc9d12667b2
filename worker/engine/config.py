"""An engine's settings in one value, checked when made (nothing loaded here).

`LLMEngine(model, config)` takes an `EngineConfig`; `LLM(...)` and the worker's flags use
the flat option names of `engine_config`, which builds one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from worker.engine.batch import PreemptionMode
from worker.engine.fairness import FairnessConfig
from worker.errors import InvalidRequestError
from worker.spec_decode.config import SpeculativeConfig

ATTENTION_BACKENDS = ("torch", "triton")

# The KV pool's memory when neither ``kv_cache_memory_gb`` nor ``num_kv_blocks`` is given.
# Read as each config is made: the test session lowers it (tests/conftest.py), since a
# tiny test model's gigabyte is some 100,000 blocks and zeroing them was most of the time
# an engine took to build.
DEFAULT_KV_CACHE_MEMORY_GB = 1.0

# engine_config's flat names for SpeculativeConfig's fields.
SPECULATIVE_OPTIONS = {
    "speculative_model": "model",
    "num_speculative_tokens": "num_tokens",
    "speculative_max_batch_size": "max_batch_size",
    "speculative_min_acceptance": "min_acceptance",
    "speculative_position_cost": "position_cost",
    "speculative_draft_cost": "draft_cost",
    "speculative_alternatives": "alternatives",
    "speculative_draft_quantization": "draft_quantization",
}


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """``device``: where the weights, the KV cache and the adapter slots live (on ``cuda``
    the LoRA ops run the Triton kernels; the scheduler, sampler bookkeeping and detokenizer
    stay on the host). The KV cache is ``num_kv_blocks`` blocks of ``block_size`` tokens,
    or as many as ``kv_cache_memory_gb`` holds. ``share_base_model_prefixes``: base-model
    requests of different tenants share cached prefixes (faster; but one tenant can then
    time another's prompts); adapter requests are always isolated per tenant.
    ``swap_space_gb`` (or ``num_host_blocks``) sizes the host pool used when
    ``preemption_mode`` is ``"swap"``. ``max_loras=0`` turns LoRA off.
    ``tensor_parallel_size``: ranks the model is split over (docs/tensor-parallelism.md);
    the KV cache and swap sizes are then each rank's. ``attention_backend``: ``"triton"``
    (kernels reading the cache in place, the default on CUDA) or ``"torch"`` (SDPA and the
    native CPU kernel, the default elsewhere); ``cuda_graphs``: replay decode steps as CUDA
    graphs (CUDA, triton, one rank: the default there); ``async_output``: render each
    step's tokens (detokenize, stop strings, outputs) while the device runs the next step,
    handing them out one step later (CUDA without speculation: the default there); see
    docs/engine.md."""

    dtype: str | torch.dtype = "auto"
    device: str | torch.device = "cpu"
    block_size: int = 16
    kv_cache_memory_gb: float = field(default_factory=lambda: DEFAULT_KV_CACHE_MEMORY_GB)
    num_kv_blocks: int | None = None
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 1024
    max_model_len: int | None = None
    max_loras: int = 8
    max_lora_rank: int = 32
    lora_host_cache_gb: float = 2.0
    enable_prefix_caching: bool = True
    share_base_model_prefixes: bool = False
    preemption_mode: PreemptionMode | str = PreemptionMode.RECOMPUTE
    swap_space_gb: float = 1.0
    num_host_blocks: int | None = None
    tensor_parallel_size: int = 1
    attention_backend: str | None = None  # None: by device (placement.resolve_attention_backend)
    cuda_graphs: bool | None = None  # decode steps as CUDA graphs; None: where they can run
    async_output: bool | None = None  # render a step's tokens during the next; None: on CUDA
    # Run the step shapes serving will use once before the first request (worker.engine.warmup):
    # the worker's default, off for the offline engine, which tests build by the hundred.
    warmup: bool = False
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    fairness: FairnessConfig = field(default_factory=FairnessConfig)

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise InvalidRequestError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("num_kv_blocks", "num_host_blocks", "max_model_len"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise InvalidRequestError(f"{name} must be at least 1 (or unset), got {value}")
        if self.tensor_parallel_size < 1:
            raise InvalidRequestError(
                f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}"
            )
        if self.max_loras < 0 or self.max_lora_rank < 1:
            raise InvalidRequestError("max_loras must be >= 0 and max_lora_rank >= 1")
        object.__setattr__(self, "preemption_mode", PreemptionMode(self.preemption_mode))
        if self.attention_backend not in (None, *ATTENTION_BACKENDS):
            raise InvalidRequestError(
                f"attention_backend must be one of {list(ATTENTION_BACKENDS)}, "
                f"got {self.attention_backend!r}"
            )


def engine_config(**options) -> EngineConfig:
    """An `EngineConfig` from flat keyword options: its own fields, plus
    ``speculative_model``, ``num_speculative_tokens`` and the other ``speculative_*`` names
    (`SPECULATIVE_OPTIONS`) for its `SpeculativeConfig`."""
    speculative = {
        SPECULATIVE_OPTIONS[name]: options.pop(name)
        for name in list(options)
        if name in SPECULATIVE_OPTIONS
    }
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise TypeError(f"unknown engine options: {', '.join(unknown)}")
    if speculative:
        options["speculative"] = SpeculativeConfig(**speculative)
    if options.get("fairness") is None:
        options.pop("fairness", None)
    return EngineConfig(**options)


__all__ = ["ATTENTION_BACKENDS", "SPECULATIVE_OPTIONS", "EngineConfig", "engine_config"]
