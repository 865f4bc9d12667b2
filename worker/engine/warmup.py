"""One pass over the step shapes serving will use, run before the first request.

A fresh process pays extra on its first steps of each shape; the first batch of users
should not (the profile: docs/performance.md#warm-from-the-first-request). The warm-up runs
the model runner on scratch sequences the way served batches run: steps of prompt chunks
filling the token budget (fresh prompts, then a chunk continuing a cached prompt beside
decodes), and decode steps of 1, 2, 4, ... sequences up to ``max_num_seqs``; the sampler
draws from each step's logits, greedy and seeded. Its blocks come from the engine's pool
and all go back; nothing enters the prefix cache and no request or counter changes. The
native kernels the steps use are built (in a fresh container) or loaded on the way.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels.lora_native import native_library
from worker.engine.batch import ScheduledSequence
from worker.engine.block_manager import BlockManager
from worker.engine.sequence import Sequence
from worker.sampling.sampler import Sampler, SamplingRow, make_generator
from worker.sampling.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Prompt tokens per scratch sequence: a chat turn's length, so a budget's worth of them is
# a batch of several prompts, as under load.
PROMPT_TOKENS = 128
GREEDY = SamplingParams(temperature=0.0)
# Seeded rows draw from their own generators: the global one, which unseeded requests
# use, is left as it was.
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=0)
Step = list[ScheduledSequence]
Execute = Callable[[list[ScheduledSequence]], tuple[list[ScheduledSequence], torch.Tensor]]


@dataclass(frozen=True, slots=True)
class WarmupReport:
    steps: int
    seconds: float


def warm_up(
    execute: Execute,
    sampler: Sampler,
    block_manager: BlockManager,
    *,
    max_num_seqs: int,
    row_limit: int,
    max_model_len: int,
    vocab_size: int,
    cpu_lora: bool = False,
) -> WarmupReport:
    """Run the shapes (see the module docstring) through ``execute`` (the runner's forward
    pass) and ``sampler``, on blocks of ``block_manager`` that are all freed again. Steps
    hold at most ``row_limit`` tokens; sequences that do not fit the pool are left out.
    ``cpu_lora``: also build the native LoRA kernel, which a fresh container would
    otherwise compile on its first adapter request."""
    start = time.perf_counter()
    if cpu_lora:
        native_library()
    bs = block_manager.block_size
    # A prompt and the token after it fit the model, the step and (a small pool) the pool.
    room = block_manager.num_free_blocks * bs - 1
    prompt = max(1, min(PROMPT_TOKENS, row_limit, max_model_len - 2, room))
    # Enough sequences for a full prefill step and for the widest decode step.
    wanted = max(max_num_seqs, row_limit // prompt)
    tokens = [i % vocab_size for i in range(prompt + 1)]
    seqs: list[Sequence] = []
    try:
        while len(seqs) < wanted and block_manager.can_allocate([], prompt + 1):
            seq = Sequence(f"warmup-{len(seqs)}", tokens[:prompt], GREEDY, 0)
            block_manager.allocate(seq.block_table, prompt + 1)
            seqs.append(seq)
        prefills, rest = _steps(seqs, prompt, row_limit, max_num_seqs, bs) if seqs else ([], [])
        for step in prefills:
            _run(execute, sampler, step)
        for seq in seqs:  # each prompt's first token, fed by the decode steps
            seq.append_token(tokens[prompt])
        for step in rest:
            _run(execute, sampler, step)
    finally:
        for seq in seqs:
            block_manager.free(seq.block_table)
    report = WarmupReport(len(prefills) + len(rest), time.perf_counter() - start)
    logger.info("warm-up: %d steps in %.2f s", report.steps, report.seconds)
    return report


def _steps(
    seqs: list[Sequence], prompt: int, row_limit: int, max_num_seqs: int, block_size: int
) -> tuple[list[Step], list[Step]]:
    """A prefill step of a budget's worth of whole prompts; then a step of decodes beside a
    chunk continuing a prompt from a block boundary (chunked prefill's masked path), and
    decode steps of 1, 2, 4, ... sequences (those never prefilled attend scratch K/V)."""
    prefills = [[ScheduledSequence(s, 0, prompt) for s in seqs[: max(1, row_limit // prompt)]]]
    rest = []
    decodes = min(len(seqs) - 1, max_num_seqs - 1, row_limit - 1)
    context = min(block_size, prompt - 1)
    chunk = min(prompt + 1 - context, row_limit - decodes)
    if decodes >= 1 and context >= 1 and chunk >= 1:
        mixed = [ScheduledSequence(s, prompt, 1) for s in seqs[:decodes]]
        rest.append([*mixed, ScheduledSequence(seqs[-1], context, chunk)])
    batch = 1
    while batch <= min(len(seqs), max_num_seqs, row_limit):
        rest.append([ScheduledSequence(s, prompt, 1) for s in seqs[:batch]])
        batch *= 2
    return prefills, rest


def _run(execute: Execute, sampler: Sampler, step: Step) -> None:
    """One forward pass, then the sampler on its logits, greedy and seeded rows alike."""
    sampling, logits = execute(step)
    rows = [
        SamplingRow(GREEDY, [], s.seq.prompt_token_ids, None)
        if i % 2 == 0
        else SamplingRow(SEEDED, [], s.seq.prompt_token_ids, make_generator(i))
        for i, s in enumerate(sampling)
    ]
    if rows:
        sampler(logits, rows)
