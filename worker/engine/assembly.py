"""An engine's parts, built from its config: where it runs, the other tensor-parallel ranks,
the model and tokenizer, the KV cache's blocks (and swap pool), the scheduler, LoRA slots,
the runner and the speculator.

Apart from ``LLMEngine`` so that the engine's module reads as what a step does; the order
here matters (the cache's size needs the model's shape, the speculator times the runner).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from switchboard_kernels.linear_choice import invariant_plan, linear_plan
from worker.core.block_manager import BlockManager
from worker.core.config import EngineConfig, PreemptionMode
from worker.core.prompt_scoring import scoring_cost
from worker.core.scheduler import Scheduler
from worker.engine.placement import (
    resolve_async_output,
    resolve_attention_backend,
    resolve_cuda_graphs,
    resolve_device,
    resolve_dtype,
)
from worker.errors import InvalidRequestError
from worker.model.llama import LlamaModel, projection_shapes
from worker.model.lora_manager import LoraManager
from worker.model.model_config import ModelConfig
from worker.model.model_runner import ModelRunner, kv_bytes_per_block
from worker.model.op_choice import OpShapes, fixed_op_plans, op_plans
from worker.model.quantize_on_load import base_on_load
from worker.model.rope import long_rope_threshold
from worker.parallel.launch import RankProcesses, start_ranks
from worker.parallel.runner import TensorParallelRunner
from worker.spec_decode.setup import build_speculator
from worker.spec_decode.speculator import Speculator
from worker.spec_decode.step_cost import measure_step_costs
from worker.text.tokenizer import load_tokenizer


@dataclass(slots=True)
class EngineParts:
    device: torch.device
    attention_backend: str
    tensor_parallel: RankProcesses | None  # None on one rank
    model: LlamaModel
    tokenizer: object
    max_model_len: int
    block_manager: BlockManager
    scheduler: Scheduler
    lora_manager: LoraManager | None  # None when max_loras is 0
    runner: ModelRunner
    speculator: Speculator | None
    async_output: bool


def assemble(model: str | Path, config: EngineConfig) -> EngineParts:
    """Every part of an engine serving the checkpoint at ``model`` as ``config`` says."""
    block_size, max_loras = config.block_size, config.max_loras
    device = resolve_device(config.device)
    torch_dtype = resolve_dtype(config.dtype, device)
    attention_backend = resolve_attention_backend(config.attention_backend, device)
    tp_size = config.tensor_parallel_size
    model_config = ModelConfig.from_pretrained(model)
    on_load = base_on_load(config)
    cuda_graphs = resolve_cuda_graphs(
        config.cuda_graphs,
        device,
        attention_backend,
        tp_size,
        sparse_experts=model_config.block.experts is not None,
    )
    async_output = resolve_async_output(config.async_output, device, config.speculative.enabled)
    num_kv_blocks, num_host_blocks = kv_cache_blocks(model, config, torch_dtype)
    # Measured op plans switch kernels by rows, and each rank of a group must compute alike:
    # batch-invariant numerics and tensor parallelism keep the fixed rule.
    ops = fixed_op_plans(torch_dtype, device)
    if config.batch_invariant:
        if model_config.quantization is not None:  # its projections' kernel has no fixed order
            raise InvalidRequestError(
                "batch_invariant is not served over a checkpoint published quantized "
                f"({model_config.quantization.method})"
            )
        plan = batch_invariant_plan(config, torch_dtype, device)
    else:
        if tp_size == 1:
            ops = op_plans(
                op_shapes(model_config, config),
                torch_dtype,
                device=device,
                measure=config.kernel_choice == "measure",
            )
        # A base quantized on load multiplies through its own kernels: nothing to measure.
        # Decode steps in one native call, through the small-row kernel: the conditions of
        # LlamaModel.native_decode_step that the config tells before the model is built (a
        # Llama block, one rank, not a published quantized checkpoint).
        one_call = model_config.block.is_llama and tp_size == 1
        one_call = one_call and model_config.quantization is None
        plan = linear_plan(
            projection_shapes(model_config),
            torch_dtype,
            num_layers=model_config.num_layers,
            max_rows=config.max_num_batched_tokens,
            decode_rows=config.max_num_seqs if one_call else 0,
            device=device,
            measure=config.kernel_choice == "measure" and on_load is None,
        )
    # Tensor parallelism: ranks 1..N-1 load their shards while this process (rank 0) loads
    # its own; None on one rank.
    tensor_parallel = start_ranks(
        model,
        config,
        dtype=torch_dtype,
        device=device,
        num_kv_blocks=num_kv_blocks,
        num_host_blocks=num_host_blocks,
        linear_plan=plan,
    )
    group = tensor_parallel.group if tensor_parallel is not None else None
    try:
        llama = LlamaModel.from_pretrained(
            model,
            dtype=torch_dtype,
            device=device,
            group=group,
            linear_plan=plan,
            op_plans=ops,
            on_load=on_load,
        )
        if tensor_parallel is not None:
            tensor_parallel.connect()
    except BaseException:
        if tensor_parallel is not None:
            tensor_parallel.abandon()
        raise
    tokenizer = load_tokenizer(model)
    max_model_len = min(config.max_model_len or 10**9, llama.config.max_position_embeddings)
    block_manager = BlockManager(
        num_blocks=num_kv_blocks, block_size=block_size, enable_caching=config.enable_prefix_caching
    )
    host_pool = None
    if num_host_blocks is not None:
        host_pool = BlockManager(
            num_blocks=num_host_blocks, block_size=block_size, enable_caching=False
        )
    scheduler = Scheduler(
        block_manager=block_manager,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        burst_prefill_tokens=config.burst_prefill_tokens,
        # An arrival stops a step of batch work alone (worker.model.step_interrupt), except
        # where every rank must run every layer.
        batch_steps_stop=group is None,
        watermark_blocks=num_kv_blocks // 100,
        max_loras=max_loras,
        preemption_mode=config.preemption_mode,
        host_block_manager=host_pool,
        fairness=config.fairness,
        scored_token_cost=scoring_cost(
            hidden_size=model_config.hidden_size,
            vocab_size=model_config.vocab_size,
            layer_macs=sum(out * inp for out, inp in projection_shapes(model_config)),
            num_layers=model_config.num_layers,
        ),
    )
    # max_loras=0 turns LoRA off (no slot buffers are ever allocated).
    lora_manager = None
    if max_loras > 0:
        lora_manager = LoraManager(
            model,
            dtype=torch_dtype,
            device=device,
            max_loras=max_loras,
            max_lora_rank=config.max_lora_rank,
            host_cache_bytes=int(config.lora_host_cache_gb * 2**30),
            shard=group.shard if group is not None else None,
            ops=ops,
            on_load=on_load,
        )
    runner_options = dict(
        num_blocks=num_kv_blocks,
        block_size=block_size,
        lora_manager=lora_manager,
        num_host_blocks=host_pool.num_blocks if host_pool is not None else 0,
        attention_backend=attention_backend,
        cuda_graphs=cuda_graphs,
        max_num_seqs=config.max_num_seqs,
        max_model_len=max_model_len,
        batch_invariant=config.batch_invariant,
    )
    if config.batch_invariant and lora_manager is not None and not lora_manager.native:
        raise InvalidRequestError(
            "batch_invariant needs the native LoRA kernel (bf16 or fp32 on CPU, a C compiler)"
        )
    runner = (
        ModelRunner(llama, **runner_options)
        if tensor_parallel is None
        else TensorParallelRunner(llama, ranks=tensor_parallel, **runner_options)
    )
    speculator = build_speculator(
        config.speculative,
        dtype=torch_dtype,
        device=device,
        block_manager=block_manager,
        max_model_len=max_model_len,
        vocab_size=llama.config.vocab_size,
        tokenizer=tokenizer,
        target_weight_bytes=llama.decode_weight_bytes,
        copy_kv_slots=runner.copy_slots,
        measure_steps=lambda max_batch, max_drafts: measure_step_costs(
            runner.execute,
            block_manager,
            max_batch=max_batch,
            max_drafts=max_drafts,
            row_limit=min(config.max_num_batched_tokens, max_model_len),
            max_model_len=max_model_len,
            vocab_size=llama.config.vocab_size,
            device=device,
        ),
    )
    if speculator is not None:
        speculator.rope_switch = long_rope_threshold(model_config.rope)
    return EngineParts(
        device=device,
        attention_backend=attention_backend,
        tensor_parallel=tensor_parallel,
        model=llama,
        tokenizer=tokenizer,
        max_model_len=max_model_len,
        block_manager=block_manager,
        scheduler=scheduler,
        lora_manager=lora_manager,
        runner=runner,
        speculator=speculator,
        async_output=async_output,
    )


def kv_cache_blocks(
    model: str | Path, config: EngineConfig, dtype: torch.dtype
) -> tuple[int, int | None]:
    """The KV cache's blocks and, for swap preemption, the host pool's (None otherwise):
    as configured, else as many as their memory budgets hold."""
    block_bytes = kv_bytes_per_block(
        ModelConfig.from_pretrained(model),
        config.block_size,
        dtype,
        tensor_parallel_size=config.tensor_parallel_size,
    )
    num_kv_blocks = config.num_kv_blocks
    if num_kv_blocks is None:
        num_kv_blocks = max(1, int(config.kv_cache_memory_gb * 2**30) // block_bytes)
    num_host_blocks = None
    if config.preemption_mode is PreemptionMode.SWAP:
        num_host_blocks = config.num_host_blocks
        if num_host_blocks is None:
            num_host_blocks = max(1, int(config.swap_space_gb * 2**30) // block_bytes)
    return num_kv_blocks, num_host_blocks


def batch_invariant_plan(config: EngineConfig, dtype: torch.dtype, device: torch.device):
    """The projections' one kernel for ``batch_invariant`` (``linear_choice.invariant_plan``),
    or a refusal naming what is missing: one rank on CPU, bf16 or fp32, native kernels."""
    if device.type != "cpu" or config.tensor_parallel_size != 1:
        raise InvalidRequestError("batch_invariant serves one rank on CPU only")
    plan = invariant_plan(dtype, device)
    if plan is None:
        raise InvalidRequestError(
            f"batch_invariant needs the native panel kernels for {dtype} (a C compiler)"
        )
    return plan


def op_shapes(model: ModelConfig, config: EngineConfig) -> OpShapes:
    """What ``op_choice`` measures the ops on: the model's dims and the engine's bounds."""
    return OpShapes(
        hidden_size=model.hidden_size,
        intermediate_size=model.intermediate_size,
        num_layers=model.num_layers,
        num_heads=model.num_heads,
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        block_size=config.block_size,
        max_rows=config.max_num_batched_tokens,
        max_seqs=config.max_num_seqs,
    )
