"""How a projection's product joins the decoder's residual stream: plus its LoRA delta, and
all-reduced under tensor parallelism.

Split by rows (Megatron-LM's row-parallel o and down: ``worker.model.sharding``), each rank's
product is a partial sum that one all-reduce completes, the residual added on rank 0 only (into an
fp32 stream, after the all-reduce). A half-precision model on CPU keeps the stream in fp32
(``stream_dtype``): on one rank the product's fp32 sums take the residual before any rounding,
and an adapter's delta is added after, so a base row's bits never depend on its neighbours'
adapters (``batch_invariant``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from switchboard_kernels.linear import Linear
from worker.model.layer_lora import LayerLora

if TYPE_CHECKING:
    from worker.model.parallel_group import TensorParallelGroup


def stream_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The residual stream's dtype (each layer's input and output): fp32 in a half-precision
    model on CPU, while the projections, norms' outputs and attention stay in ``dtype``. bf16
    spaces the first token's massive activation (about 25,000 in one feature of the default
    model from layer 11 on) 128 apart, and its rounding then reaches every later token through
    attention: echoed prompt logprobs came out as far from fp32 as transformers' bf16 ones, and
    half as far with this (bench.logit_fidelity). On CUDA the stream keeps ``dtype`` (CUDA
    graphs' buffers and the Triton kernels take one dtype)."""
    half = dtype in (torch.bfloat16, torch.float16)
    return torch.float32 if half and device.type == "cpu" else dtype


def projected(
    linear: Linear,
    x: torch.Tensor,
    adapters: LayerLora | None,
    lora_group: str,
    *,
    group: TensorParallelGroup | None,
) -> torch.Tensor:
    """``x @ W.T`` plus the LoRA delta, all-reduced under tensor parallelism."""
    y = linear(x)
    if adapters is not None:
        adapters.add(y, x, lora_group)
    if group is not None:
        group.all_reduce(y)
    return y


def row_parallel(
    linear: Linear,
    x: torch.Tensor,
    residual: torch.Tensor,
    adapters: LayerLora | None,
    lora_group: str,
    *,
    group: TensorParallelGroup | None,
) -> torch.Tensor:
    """``residual + x @ W.T`` plus the LoRA delta. Split by rows, each rank's product is
    a partial sum (the residual added on rank 0 only, the LoRA delta on its columns) and
    one all-reduce completes it."""
    if residual.dtype != x.dtype:
        return added_to_stream(linear, x, residual, adapters, lora_group, group=group)
    first = group is None or group.rank == 0
    y = linear.add_to(x, residual) if first else linear(x)
    if adapters is not None:
        adapters.add(y, x, lora_group, base=residual if first else None)
    if group is not None:
        group.all_reduce(y)
    return y


def added_to_stream(
    linear: Linear,
    x: torch.Tensor,
    residual: torch.Tensor,  # [T, hidden] fp32, this step's own
    adapters: LayerLora | None,
    lora_group: str,
    *,
    group: TensorParallelGroup | None,
) -> torch.Tensor:
    """``residual + x @ W.T`` plus the LoRA delta, into the fp32 residual stream: the
    product's fp32 sums take the residual before any rounding. An adapter's delta is
    computed apart and added after, so a base row's bits never depend on whether its
    neighbours have adapters (``batch_invariant``)."""
    if group is not None:  # each rank's partial sum: the stream added after
        return residual.add_(projected(linear, x, adapters, lora_group, group=group))
    y = linear.add_to(x, residual)  # [T, hidden] fp32
    if adapters is None or not adapters.stacks[lora_group].used:
        return y
    if adapters.dora and adapters.stacks[lora_group].dora is not None:
        # DoRA rescales the base product too: the delta against that product
        base = linear(x)
        adapted = base.clone()
        adapters.add(adapted, x, lora_group)
        return y.add_(adapted.float().sub_(base.float()))
    delta = x.new_zeros(y.shape)  # [T, hidden] in the rows' dtype, as the kernels add
    adapters.add(delta, x, lora_group)
    return y.add_(delta)
