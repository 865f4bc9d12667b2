"""Building the speculator from the engine's keyword arguments, refusing bad settings."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from switchboard_kernels.linear_native import native_linear
from switchboard_kernels.q4_native import native_q4
from worker.core.block_manager import BlockManager
from worker.core.config import SpeculativeConfig
from worker.errors import SpeculativeConfigError
from worker.spec_decode.backoff import BackoffPolicy, flat_verify_cost
from worker.spec_decode.draft import DraftProposer
from worker.spec_decode.ngram import NgramProposer
from worker.spec_decode.proposal import Proposer
from worker.spec_decode.speculator import Speculator
from worker.spec_decode.step_cost import LiveStepCosts, StepCostTable

NGRAM = "ngram"
# How a draft model's weights are held on CPU, where its one-token passes read them all from
# memory: "int4" (small passes through 4-bit copies: with a C compiler, one-token passes run
# as one native call, switchboard_kernels/draft_cpu.c; without one, torch's 4-bit kernel), "int8"
# (every pass through int8 weights, our panel kernel; fp32 models), "none", or "auto": int4
# where the native 4-bit kernel builds, else the one that fits the dtype (torch's 4-bit
# kernel is far slower than fp32 on AVX2-only CPUs, so fp32 models then take int8; figures
# in docs/performance.md).
DRAFT_QUANTIZATIONS = ("auto", "int4", "int8", "none")


def resolve_draft_quantization(
    name: str, *, dtype: torch.dtype, device: torch.device
) -> str | None:
    """``switchboard_kernels.linear.Linear``'s quantization for the draft's weights (None:
    exact)."""
    if name not in DRAFT_QUANTIZATIONS:
        raise SpeculativeConfigError(
            f"speculative_draft_quantization must be one of {', '.join(DRAFT_QUANTIZATIONS)}, "
            f"got {name!r}"
        )
    if name in ("int4", "int8") and device.type != "cpu":
        raise SpeculativeConfigError(f"speculative_draft_quantization {name!r} runs on CPU only")
    int8_runs = dtype == torch.float32 and native_linear() is not None
    if name == "int8" and not int8_runs:
        raise SpeculativeConfigError(
            "speculative_draft_quantization 'int8' needs a float32 model and the native "
            "linear kernel (a C compiler)"
        )
    if name == "auto":
        if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float32):
            return None
        if dtype == torch.bfloat16 or native_q4() is not None:
            return "int4"
        return "int8" if int8_runs else None
    return None if name == "none" else name


def build_speculator(
    config: SpeculativeConfig,
    *,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    block_manager: BlockManager,
    max_model_len: int,
    vocab_size: int,
    tokenizer,
    target_weight_bytes: int,
    copy_kv_slots: Callable[[list[int], list[int]], None],
    measure_steps: Callable[[int, int], StepCostTable],
) -> Speculator | None:
    """None when speculation is off; else the draft (or prompt lookup) loaded, its kernels
    built, and the cost of verifying measured: ``config.position_cost`` None times the
    target's decode steps with ``measure_steps(max_batch, max_drafts)``, up to that many
    sequences and drafts each."""
    if not config.enabled:
        return None
    k = config.k
    num_alternatives = config.alternatives
    max_batch_size = config.max_batch_size
    position_cost = config.position_cost
    draft_cost = config.draft_cost
    quantization = resolve_draft_quantization(
        config.draft_quantization, dtype=dtype, device=torch.device(device)
    )
    speculative_model = config.model
    proposer: Proposer
    if str(speculative_model) == NGRAM:
        proposer = NgramProposer()
        if draft_cost is None:
            draft_cost = 0.0  # a lookup in the sequence's own tokens: next to nothing
    else:
        path = Path(speculative_model)
        if not (path / "config.json").is_file():
            raise SpeculativeConfigError(
                f"speculative_model must be 'ngram' or a checkpoint directory; {path} has no "
                "config.json"
            )
        proposer = DraftProposer(
            path,
            dtype=dtype,
            device=device,
            num_blocks=block_manager.num_blocks,
            block_size=block_manager.block_size,
            target_vocab_size=vocab_size,
            target_tokenizer=tokenizer,
            num_alternatives=num_alternatives,
            quantization=quantization,
        )
        if draft_cost is None:
            # A small batch's decode step reads the weights: a draft step costs their ratio.
            # (Following its measured time instead did not pay: docs/speculative-decoding.md.)
            draft_cost = proposer.model.decode_weight_bytes / target_weight_bytes
    step_costs = None
    if position_cost is not None or max_batch_size == 0:
        verify_cost = flat_verify_cost(position_cost or 0.0)
    else:  # up to the largest batch that speculates, each sequence with all its rows
        rows = k * (1 + num_alternatives) if isinstance(proposer, DraftProposer) else k
        table = measure_steps(max_batch_size, rows)
        verify_cost = table.verify_cost
        # Corrected by the steps that run, where they are timed as they run (not on a GPU).
        if torch.device(device).type == "cpu":
            step_costs = LiveStepCosts(table)
    return Speculator(
        proposer,
        num_speculative_tokens=k,
        block_manager=block_manager,
        max_model_len=max_model_len,
        copy_kv_slots=copy_kv_slots,
        policy=BackoffPolicy(
            max_batch_size=max_batch_size,
            min_acceptance=config.min_acceptance,
            verify_cost=verify_cost,
            draft_cost=draft_cost,
            step_costs=step_costs,
        ),
    )
