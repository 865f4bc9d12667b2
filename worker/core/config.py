"""Every setting of an engine, in one module below everything that reads them: the engine's
own (`EngineConfig`), fair scheduling's (`FairnessConfig`) and speculative decoding's
(`SpeculativeConfig`), each checked when made (nothing is loaded or built here).

`LLMEngine(model, config)` takes an `EngineConfig`; `LLM(...)` and the worker's flags use
the flat option names of `engine_config`, which builds one.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from worker.errors import InvalidRequestError, SpeculativeConfigError
from worker.sampling.sampling_params import MAX_SPECULATIVE_TOKENS


class PreemptionMode(enum.StrEnum):
    RECOMPUTE = "recompute"
    SWAP = "swap"


class SchedulingPolicy(enum.StrEnum):
    FAIR = "fair"  # the lowest virtual counter first
    FCFS = "fcfs"  # arrival order, whoever sent it


@dataclass(frozen=True, slots=True)
class FairnessConfig:
    """How the scheduler shares a worker between tenants; checked here, nothing else done."""

    policy: SchedulingPolicy | str = SchedulingPolicy.FAIR
    prefill_weight: float = 1.0
    decode_weight: float = 2.0
    # Seats a tenant may hold at once (None: no cap beyond max_num_seqs).
    max_running_per_tenant: int | None = None
    # Steps a request under its tenant's share waits for room before it preempts a tenant
    # over its share (0: at once). Waiting first lets a finishing request free the room.
    share_wait_steps: int = 4
    # A step that computes a lone request's whole prompt takes at most this many tokens
    # of other prefill work after it (None: no limit): the first token of a tenant that
    # sends one request at a time costs a short step, not a full chunk of someone else's.
    lone_prompt_step_tokens: int | None = 64

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy", SchedulingPolicy(self.policy))
        for name in ("prefill_weight", "decode_weight"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if self.max_running_per_tenant is not None and self.max_running_per_tenant < 1:
            raise ValueError("max_running_per_tenant must be at least 1 (or None)")
        if self.share_wait_steps < 0:
            raise ValueError("share_wait_steps must be >= 0")
        if self.lone_prompt_step_tokens is not None and self.lone_prompt_step_tokens < 0:
            raise ValueError("lone_prompt_step_tokens must be >= 0 (or None)")


# Alternatives a draft model offers per draft by default, and the most it may offer (the
# step verifies those worth their rows: ``draft_plan``).
NUM_ALTERNATIVES = 7
MAX_ALTERNATIVES = 8
DEFAULT_SPECULATIVE_TOKENS = 4


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """``model``: ``"ngram"`` (prompt lookup), a draft checkpoint sharing the target's
    vocabulary, or None (off). ``num_tokens`` is k, the most drafts a sequence gets in a
    step (None: 4 when a model is set); each gets as many as its acceptance makes worth
    their cost (``BackoffPolicy``). Speculation is off for steps with more than
    ``max_batch_size`` decoding sequences, and paused for a sequence whose drafts are not
    worth their cost or whose acceptance per position falls below ``min_acceptance``. The
    costs a draft must cover, relative to a plain decode step: ``position_cost`` per
    position and decoding sequence (None: measured at start by timing the forward pass by
    rows) and ``draft_cost`` per draft token (None: the draft's weights over the target's;
    0 for prompt lookup). A draft model also offers up to ``alternatives`` runner-up tokens
    per draft, each verified in a row of its own. ``draft_quantization`` (CPU): "int4",
    "int8", "none" or "auto" (int4 where the native kernel builds)."""

    model: str | Path | None = None
    num_tokens: int | None = None
    max_batch_size: int = 8
    min_acceptance: float = 0.0
    position_cost: float | None = None
    draft_cost: float | None = None
    alternatives: int = NUM_ALTERNATIVES
    draft_quantization: str = "auto"

    def __post_init__(self) -> None:
        if self.model is None:
            if self.num_tokens:
                raise SpeculativeConfigError(
                    "num_speculative_tokens is set but speculative_model is not: "
                    "give a draft checkpoint path or 'ngram'"
                )
            return
        k = self.k
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise SpeculativeConfigError(
                f"num_speculative_tokens must be an integer from 1 to {MAX_SPECULATIVE_TOKENS}, "
                f"got {k!r}"
            )
        alternatives = self.alternatives
        if (
            isinstance(alternatives, bool)
            or not isinstance(alternatives, int)
            or not 0 <= alternatives <= MAX_ALTERNATIVES
        ):
            raise SpeculativeConfigError(
                f"speculative_alternatives must be an integer from 0 to {MAX_ALTERNATIVES}, "
                f"got {alternatives!r}"
            )
        if self.max_batch_size < 0 or not 0.0 <= self.min_acceptance <= 1.0:
            raise SpeculativeConfigError(
                "speculative_max_batch_size must be >= 0 and speculative_min_acceptance in [0, 1]"
            )
        if (self.position_cost is not None and self.position_cost < 0) or (
            self.draft_cost is not None and self.draft_cost < 0
        ):
            raise SpeculativeConfigError(
                "speculative_position_cost and speculative_draft_cost must be >= 0"
            )

    @property
    def enabled(self) -> bool:
        return self.model is not None

    @property
    def k(self) -> int:
        return DEFAULT_SPECULATIVE_TOKENS if self.num_tokens is None else self.num_tokens


ATTENTION_BACKENDS = ("torch", "triton")
# A bf16/fp32 base quantized as it loads (worker.model.quantize_on_load; docs/quantization.md).
BASE_QUANTIZATIONS = ("int4", "int8")
KERNEL_CHOICES = ("measure", "fixed")
# How the projections' kernels are chosen when a config does not say: measured on this CPU
# (`switchboard_kernels.linear_choice`). The test session fixes them (tests/conftest.py): its
# engines then multiply the same way on every machine, and none waits for a measurement.
DEFAULT_KERNEL_CHOICE = "measure"

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
    handing them out one step later (CUDA without speculation: the default there);
    ``kernel_choice``: "measure" (the projections' kernels timed on this CPU once, then
    cached: `switchboard_kernels.linear_choice`) or "fixed" (a rule by CPU features);
    ``burst_prefill_tokens``: while one tenant's waiting prompts hold more tokens than one
    step computes (all its work interactive, no other tenant active), steps take at most this
    many tokens and its decodes wait behind at most ``max_num_batched_tokens`` of prompt
    tokens (`worker.core.burst`); None: off;
    ``decode_step_budget_ms``: while a step carries decodes and more than one tenant is
    active, its prompt tokens are cut so that it takes at most this long (prefill chunks wait;
    `worker.core.step_budget`); None: three
    of a lone stream's decode steps as measured at warm-up, off without one; 0: off;
    ``batch_invariant``: every row's numerics fixed whatever else the step holds, whether its
    prefix was cached and how its prompt was chunked (one rank on CPU, native kernels: the
    projections through the panels in one order, every attention row through the native
    kernel; `worker.engine.assembly` refuses it elsewhere);
    ``quantization``: "int4" or "int8" weight-only quantization of a bf16/fp32 base as it loads
    (round to nearest; activations unrounded, fp32 sums), in groups of
    ``quantization_group_size`` input features (None: int4 32, int8 per channel; -1: per
    channel), the output layer too by ``quantization_lm_head`` ("int8" or "int4", that method's
    defaults; None: as loaded) (docs/quantization.md). See
    docs/engine.md."""

    dtype: str | torch.dtype = "auto"
    device: str | torch.device = "cpu"
    block_size: int = 16
    kv_cache_memory_gb: float = field(default_factory=lambda: DEFAULT_KV_CACHE_MEMORY_GB)
    num_kv_blocks: int | None = None
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    burst_prefill_tokens: int | None = 512
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
    decode_step_budget_ms: float | None = None
    kernel_choice: str = field(default_factory=lambda: DEFAULT_KERNEL_CHOICE)
    batch_invariant: bool = False
    quantization: str | None = None
    quantization_group_size: int | None = None
    quantization_lm_head: str | None = None
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    fairness: FairnessConfig = field(default_factory=FairnessConfig)

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise InvalidRequestError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("num_kv_blocks", "num_host_blocks", "max_model_len", "burst_prefill_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise InvalidRequestError(f"{name} must be at least 1 (or unset), got {value}")
        if self.tensor_parallel_size < 1:
            raise InvalidRequestError(
                f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}"
            )
        if self.max_loras < 0 or self.max_lora_rank < 1:
            raise InvalidRequestError("max_loras must be >= 0 and max_lora_rank >= 1")
        if self.kernel_choice not in KERNEL_CHOICES:
            raise InvalidRequestError(
                f"kernel_choice must be one of {list(KERNEL_CHOICES)}, got {self.kernel_choice!r}"
            )
        budget = self.decode_step_budget_ms
        if budget is not None and not (math.isfinite(budget) and budget >= 0):
            raise InvalidRequestError(
                f"decode_step_budget_ms must be a finite number >= 0 (or unset), got {budget!r}"
            )
        object.__setattr__(self, "preemption_mode", PreemptionMode(self.preemption_mode))
        self._check_quantization()
        if self.attention_backend not in (None, *ATTENTION_BACKENDS):
            raise InvalidRequestError(
                f"attention_backend must be one of {list(ATTENTION_BACKENDS)}, "
                f"got {self.attention_backend!r}"
            )

    def _check_quantization(self) -> None:
        if self.quantization is None:
            if self.quantization_group_size is not None or self.quantization_lm_head:
                raise InvalidRequestError(
                    "quantization_group_size and quantization_lm_head need quantization "
                    f"({' or '.join(BASE_QUANTIZATIONS)})"
                )
            return
        for name in ("quantization", "quantization_lm_head"):
            value = getattr(self, name)
            if value is not None and value not in BASE_QUANTIZATIONS:
                raise InvalidRequestError(
                    f"{name} must be one of {list(BASE_QUANTIZATIONS)}, got {value!r}"
                )
        group = self.quantization_group_size
        if group is not None and (
            isinstance(group, bool) or not isinstance(group, int) or (group < 1 and group != -1)
        ):
            raise InvalidRequestError(
                f"quantization_group_size must be a positive number of input features or -1 "
                f"(per channel), got {group!r}"
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
