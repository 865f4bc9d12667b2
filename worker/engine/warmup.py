"""One pass over the step shapes serving will use, run before the first request.

What a fresh process pays on its first steps and not again: the native kernels the forward
pass loads on first use (in a fresh container, compiled: about a second each), oneDNN's
primitives for each new shape, first-touch pages for activations; the first users should
not (the profile: docs/performance.md#warm-from-the-first-request). The warm-up runs the
model runner on scratch sequences the way served batches run: a step of prompts filling the
token budget, decodes beside a chunk continuing a prompt, and decode steps of one and of
several sequences; the sampler draws from each step's logits, greedy and seeded. Its blocks
come from the engine's pool and all go back; nothing enters the prefix cache and no request
or counter changes.

``measure_step_times`` then times steps of one prompt chunk of growing size, the points the
decode step budget starts from (``worker.core.step_budget``), and ``measure_decode_times``
steps of decodes alone, by rows.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from switchboard_kernels.lora_native import native_library
from worker.core.batch import ScheduledSequence
from worker.core.block_manager import BlockManager
from worker.core.sequence import Sequence
from worker.core.step_budget import SWEEP_DECODE_ROWS, SWEEP_TOKENS
from worker.sampling.rows import SamplingRow, make_generator
from worker.sampling.sampler import Sampler
from worker.sampling.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Prompt tokens per scratch sequence: a chat turn's length, so a budget's worth of them is
# a batch of several prompts, as under load.
PROMPT_TOKENS = 128
# Decode steps run: one sequence alone, and a batch (the sequences beyond the prefilled
# ones attend scratch K/V). Each batch size is a new oneDNN shape, but a cheap one to meet
# first: the kernels, allocations and the sampler's paths are what these steps warm.
DECODE_BATCHES = (1, 16)
GREEDY = SamplingParams(temperature=0.0)
# The step-time sweep: the fastest of this many runs per size counts (noise only slows a run
# down; the small steps, which the default budget is made of, are cheap to run more often);
# sizes stop once the sweep has taken this long, or one step this long.
SWEEP_REPEATS = 2
SWEEP_SMALL_REPEATS, SWEEP_SMALL_TOKENS = 5, 16
SWEEP_SECONDS = 20.0
SWEEP_STEP_SECONDS = 5.0
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
    # Enough sequences for a full prefill step, the widest decode step and one more.
    wanted = max(min(max(DECODE_BATCHES), max_num_seqs), row_limit // prompt) + 1
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
    """A prefill step of a budget's worth of whole prompts; then decodes of those prompts
    beside a chunk continuing another prompt from a block boundary (chunked prefill's
    masked path), and decode steps of ``DECODE_BATCHES`` sequences."""
    prefilled = seqs[: max(1, row_limit // prompt)]
    prefills = [[ScheduledSequence(s, 0, prompt) for s in prefilled]]
    rest = []
    decodes = min(len(prefilled), len(seqs) - 1, max_num_seqs - 1, row_limit - 1)
    context = min(block_size, prompt - 1)
    chunk = min(prompt + 1 - context, row_limit - decodes)
    if decodes >= 1 and context >= 1 and chunk >= 1:
        mixed = [ScheduledSequence(s, prompt, 1) for s in seqs[:decodes]]
        rest.append([*mixed, ScheduledSequence(seqs[-1], context, chunk)])
    for batch in sorted({min(b, len(seqs), max_num_seqs, row_limit) for b in DECODE_BATCHES}):
        rest.append([ScheduledSequence(s, prompt, 1) for s in seqs[:batch]])
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


def measure_step_times(
    execute: Execute,
    block_manager: BlockManager,
    *,
    row_limit: int,
    max_model_len: int,
    vocab_size: int,
) -> dict[int, float]:
    """Seconds of a step feeding one fresh prompt of each of ``SWEEP_TOKENS`` tokens (at most
    ``row_limit``, and what the model and the pool hold), the fastest of ``SWEEP_REPEATS``
    (``SWEEP_SMALL_REPEATS`` up to ``SWEEP_SMALL_TOKENS`` tokens);
    larger sizes are skipped once the sweep has run ``SWEEP_SECONDS`` or a step took
    ``SWEEP_STEP_SECONDS``. Its blocks all go back to the pool."""
    bs = block_manager.block_size
    room = block_manager.num_free_blocks * bs - 1
    sizes = [t for t in SWEEP_TOKENS if t <= min(row_limit, max_model_len - 1, room)]
    measured: dict[int, float] = {}
    started = time.perf_counter()
    for tokens in sizes:
        seq = Sequence(f"sweep-{tokens}", [i % vocab_size for i in range(tokens)], GREEDY, 0)
        block_manager.allocate(seq.block_table, tokens)
        try:
            best = math.inf
            repeats = SWEEP_SMALL_REPEATS if tokens <= SWEEP_SMALL_TOKENS else SWEEP_REPEATS
            for _ in range(repeats):
                start = time.perf_counter()
                execute([ScheduledSequence(seq, 0, tokens)])
                best = min(best, time.perf_counter() - start)
        finally:
            block_manager.free(seq.block_table)
        measured[tokens] = best
        if best > SWEEP_STEP_SECONDS or time.perf_counter() - started > SWEEP_SECONDS:
            break
    return measured


# The decode sweep's sequences: this many prompt tokens each (a short context: the rows'
# attention is a small part of a decode step; the observed steps correct for longer ones).
DECODE_SWEEP_CONTEXT = 16


def measure_decode_times(
    execute: Execute,
    block_manager: BlockManager,
    *,
    max_rows: int,
    row_limit: int,
    max_model_len: int,
    vocab_size: int,
) -> dict[int, float]:
    """Seconds of a step of decodes alone, by rows (``SWEEP_DECODE_ROWS`` up to ``max_rows``,
    the step's token limit and what the pool holds), the fastest of ``SWEEP_SMALL_REPEATS``:
    each row one token after a ``DECODE_SWEEP_CONTEXT``-token prompt, prefilled first. The
    runner takes such a step as it takes a served one (on a CPU, the native decode step).
    Its blocks all go back to the pool."""
    context = min(DECODE_SWEEP_CONTEXT, max_model_len - 2)
    sizes = [r for r in SWEEP_DECODE_ROWS if r <= min(max_rows, row_limit)]
    if context < 1 or not sizes:
        return {}
    tokens = [i % vocab_size for i in range(context + 1)]
    seqs: list[Sequence] = []
    measured: dict[int, float] = {}
    try:
        while len(seqs) < sizes[-1] and block_manager.can_allocate([], context + 1):
            seq = Sequence(f"decode-sweep-{len(seqs)}", tokens[:context], GREEDY, 0)
            block_manager.allocate(seq.block_table, context + 1)
            seqs.append(seq)
        per_step = max(1, row_limit // context)
        for first in range(0, len(seqs), per_step):
            execute([ScheduledSequence(s, 0, context) for s in seqs[first : first + per_step]])
        for seq in seqs:
            seq.append_token(tokens[context])
        for rows in (r for r in sizes if r <= len(seqs)):
            step = [ScheduledSequence(s, context, 1) for s in seqs[:rows]]
            best = math.inf
            for _ in range(SWEEP_SMALL_REPEATS):
                start = time.perf_counter()
                execute(step)
                best = min(best, time.perf_counter() - start)
            measured[rows] = best
    finally:
        for seq in seqs:
            block_manager.free(seq.block_table)
    return measured


# Prompt tokens of the steps that price scoring a prompt (``measure_scoring_cost``), the
# alternatives they ask for (the most a request may: the host's work grows with them), and how
# many of each step are timed (the fastest kept: a busy machine's hiccups only slow a step).
SCORING_TOKENS = 256
SCORING_TOP = 20
SCORING_REPEATS = 3


def measure_scoring_cost(
    execute: Execute, block_manager: BlockManager, *, tokens: int, vocab_size: int
) -> float | None:
    """A prompt position scored for its logprobs, in plain prompt tokens on this machine: the
    fastest step scoring a fresh prompt of ``tokens`` tokens over the fastest plain step of as
    many, timed in turns. None where the pool cannot hold the prompt. The vocabulary
    projection is the part a model's shapes predict; the host's work per scored position
    (its alternatives) is the rest, and on a small model it dominates."""
    if tokens < 2 or block_manager.num_free_blocks * block_manager.block_size <= tokens:
        return None
    scored = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=SCORING_TOP)
    best = {False: math.inf, True: math.inf}
    for repeat in range(SCORING_REPEATS):
        for scoring in (False, True):
            ids = [i % vocab_size for i in range(tokens)]
            seq = Sequence(f"scoring-{repeat}", ids, scored if scoring else GREEDY, 0)
            if scoring:
                seq.prompt_logprobs = [None] * (tokens - 1)
            block_manager.allocate(seq.block_table, tokens)
            try:
                start = time.perf_counter()
                execute([ScheduledSequence(seq, 0, tokens)])
                best[scoring] = min(best[scoring], time.perf_counter() - start)
            finally:
                block_manager.free(seq.block_table)
    return best[True] / best[False]
