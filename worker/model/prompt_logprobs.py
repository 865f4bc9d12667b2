"""Prompt logprobs: the logprob of each prompt token given the tokens before it, computed in
the prefill pass that runs anyway (OpenAI's legacy `echo` + `logprobs`, vLLM's
`prompt_logprobs`).

Semantics: for a prompt t_0 … t_{P-1}, entry i (i = 0 … P-2) is
``log_softmax(logits(h_i))[t_{i+1}]`` with the ``k`` most likely tokens of that row, where h_i is
the hidden state at position i; t_0 has none. The logits are the model's raw ones (no sampling
settings), as vLLM reports them. Rows are projected a slice at a time, so a long prompt never
holds a [P, vocab] tensor. A cached prefix has no hidden states: the scheduler gives a sequence
that still needs its prompt logprobs no prefix-cache hits (`worker.core.prefix_lookup`).
"""

from __future__ import annotations

import torch

from worker.core.batch import ScheduledSequence
from worker.model.saved_modules import SavedRows
from worker.sampling.rows import SampledToken

# Rows projected to the vocabulary at once: [ROWS, vocab] fp32 (12.6 MB for 49,152 tokens).
ROWS = 64
# As the sampler reports an impossible token (JSON has no infinity).
LOGPROB_FLOOR = -9999.0


def wants_prompt_logprobs(s: ScheduledSequence) -> bool:
    """Whether this step computes prompt positions whose logprobs ``s``'s request asked for."""
    pending = s.seq.prompt_logprobs
    return pending is not None and s.start < len(pending)


def record_prompt_logprobs(
    model, hidden: torch.Tensor, order: list[ScheduledSequence], *, saved: SavedRows | None = None
) -> None:
    """Fill ``seq.prompt_logprobs[p]`` for every prompt position p this step computes.

    ``hidden``: [rows, hidden] in ``order``'s flattened layout (each sequence's ``num_fed``
    rows in turn). Writing by position makes a step that is run again (a failing batch split
    apart, a recompute after preemption) write the same entries again, never twice. ``saved``:
    the step's adapters' lm_head copies, for their rows."""
    rows: list[int] = []  # rows of ``hidden``
    targets: list[tuple[list, int, int, int]] = []  # (list, position, next token, top k)
    offset = 0
    for s in order:
        if wants_prompt_logprobs(s):
            pending = s.seq.prompt_logprobs
            k = s.seq.params.prompt_logprobs or 0
            prompt = s.seq.prompt_token_ids
            for p in range(s.start, min(s.start + s.num_tokens, len(pending))):
                rows.append(offset + p - s.start)
                targets.append((pending, p, prompt[p + 1], k))
        offset += s.num_fed
    for first in range(0, len(rows), ROWS):
        index = torch.tensor(rows[first : first + ROWS], device=hidden.device)
        heads = None if saved is None else saved.heads(index)
        logits = model.compute_logits(hidden.index_select(0, index), heads=heads)  # [rows, vocab]
        _fill(logits, targets[first : first + ROWS])


def _fill(logits: torch.Tensor, targets: list[tuple[list, int, int, int]]) -> None:
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    logprobs = torch.nan_to_num_(logprobs, nan=LOGPROB_FLOOR).clamp_(min=LOGPROB_FLOOR)
    tokens = torch.tensor([t[2] for t in targets], device=logprobs.device)
    chosen = logprobs.gather(1, tokens[:, None]).squeeze(1).tolist()
    max_k = max(t[3] for t in targets)
    top_values: list[list[float]] = [[] for _ in targets]
    top_ids: list[list[int]] = [[] for _ in targets]
    if max_k:
        top = torch.topk(logprobs, max_k, dim=-1)  # sorted, descending
        top_values, top_ids = top.values.tolist(), top.indices.tolist()
    for j, (pending, position, token, k) in enumerate(targets):
        top_k = list(zip(top_ids[j][:k], top_values[j][:k], strict=True))
        pending[position] = SampledToken(token, chosen[j], top_k)
