"""Building the speculator from the engine's keyword arguments, refusing bad settings."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from kernels.linear_native import native_linear
from kernels.q4_native import native_q4
from worker.block_manager import BlockManager
from worker.errors import SpeculativeConfigError
from worker.sampling_params import MAX_SPECULATIVE_TOKENS
from worker.spec_decode.backoff import BackoffPolicy, flat_verify_cost
from worker.spec_decode.draft import DraftProposer
from worker.spec_decode.ngram import NgramProposer
from worker.spec_decode.proposal import MAX_ALTERNATIVES, Proposer
from worker.spec_decode.speculator import Speculator
from worker.spec_decode.step_cost import LiveStepCosts, StepCostTable

NGRAM = "ngram"
# How a draft model's weights are held on CPU, where its one-token passes read them all from
# memory: "int4" (small passes through 4-bit copies: with a C compiler, one-token passes run
# as one native call, kernels/draft_cpu.c, the default model's draft 2.6 -> 0.75 ms on a
# Zen 4 in bf16, weights evicted; without one, torch's 4-bit kernel), "int8" (every pass
# through int8 weights, our panel kernel; fp32 models), "none", or "auto": int4 where the
# native 4-bit kernel builds, else the one that fits the dtype (torch's 4-bit kernel ran
# 4-27x slower than fp32 on an AVX2-only CPU, so fp32 models then take int8).
DRAFT_QUANTIZATIONS = ("auto", "int4", "int8", "none")


def resolve_draft_quantization(
    name: str, *, dtype: torch.dtype, device: torch.device
) -> str | None:
    """``kernels.linear.Linear``'s quantization for the draft's weights (None: exact)."""
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
    speculative_model: str | Path | None,
    num_speculative_tokens: int | None,
    *,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    block_manager: BlockManager,
    max_model_len: int,
    vocab_size: int,
    tokenizer,
    max_batch_size: int,
    min_acceptance: float,
    target_weight_bytes: int,
    position_cost: float | None,
    draft_cost: float | None,
    num_alternatives: int,
    draft_quantization: str = "auto",
    copy_kv_slots: Callable[[list[int], list[int]], None],
    measure_steps: Callable[[int, int], StepCostTable],
) -> Speculator | None:
    """None when speculation is off. ``speculative_model``: ``"ngram"`` (prompt lookup) or a
    draft checkpoint directory; ``num_speculative_tokens`` (k) defaults to 4 with either.
    ``position_cost`` None: the cost of verifying is measured, ``measure_steps(max_batch,
    max_drafts)`` timing the target's decode steps up to that many sequences and drafts
    each (once the settings are valid)."""
    if speculative_model is None:
        if num_speculative_tokens:
            raise SpeculativeConfigError(
                "num_speculative_tokens is set but speculative_model is not: "
                "give a draft checkpoint path or 'ngram'"
            )
        return None
    k = 4 if num_speculative_tokens is None else num_speculative_tokens
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise SpeculativeConfigError(
            f"num_speculative_tokens must be an integer from 1 to {MAX_SPECULATIVE_TOKENS}, "
            f"got {k!r}"
        )
    if (
        isinstance(num_alternatives, bool)
        or not isinstance(num_alternatives, int)
        or not 0 <= num_alternatives <= MAX_ALTERNATIVES
    ):
        raise SpeculativeConfigError(
            f"speculative_alternatives must be an integer from 0 to {MAX_ALTERNATIVES}, "
            f"got {num_alternatives!r}"
        )
    if max_batch_size < 0 or not 0.0 <= min_acceptance <= 1.0:
        raise SpeculativeConfigError(
            "speculative_max_batch_size must be >= 0 and speculative_min_acceptance in [0, 1]"
        )
    quantization = resolve_draft_quantization(
        draft_quantization, dtype=dtype, device=torch.device(device)
    )
    if (position_cost is not None and position_cost < 0) or (
        draft_cost is not None and draft_cost < 0
    ):
        raise SpeculativeConfigError(
            "speculative_position_cost and speculative_draft_cost must be >= 0"
        )
    proposer: Proposer
    measure = False
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
        # On a GPU the forward pass returns before the device is done: not timed there.
        measure = draft_cost is None and torch.device(device).type == "cpu"
        if draft_cost is None:
            # A small batch's decode step reads the weights: a draft step costs their ratio,
            # to start with; then what the engine measures (Speculator.verify).
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
        measure_draft_cost=measure,
        policy=BackoffPolicy(
            max_batch_size=max_batch_size,
            min_acceptance=min_acceptance,
            verify_cost=verify_cost,
            draft_cost=draft_cost,
            step_costs=step_costs,
        ),
    )
