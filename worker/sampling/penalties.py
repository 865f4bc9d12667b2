"""Logit bias, then repetition, frequency and presence penalties, over a batch of logits rows.

Logit bias as OpenAI defines it: a number added to a token's logit (-100 bans it).

Repetition penalty as in HF (CTRL, Keskar et al. 2019): divide positive logits and
multiply negative ones for tokens seen in the prompt or output. Frequency and presence
penalties as OpenAI defines them: subtract ``frequency * count + presence`` for tokens in
the output.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import numpy as np
import torch


def apply_penalties_(
    logits: torch.Tensor,
    *,
    prompt_token_ids: Sequence[list[int]],
    output_token_ids: Sequence[list[int]],
    repetition_penalty: Sequence[float],
    presence_penalty: Sequence[float],
    frequency_penalty: Sequence[float],
    logit_bias: Sequence[dict[int, float] | None] | None = None,
) -> torch.Tensor:
    """Logit bias, then repetition, then frequency and presence penalties, in place;
    returns `logits`.

    logits: [n, vocab] contiguous fp32; the other arguments have one entry per row. Only the
    logits of tokens that occur are touched, so the cost follows the token counts, not vocab.
    """
    vocab = logits.shape[1]
    flat = logits.view(-1)  # [n * vocab]
    if logit_bias is not None and any(logit_bias):
        positions = [row * vocab + t for row, b in enumerate(logit_bias) if b for t in b]
        values = [v for b in logit_bias if b for v in b.values()]
        index = torch.tensor(positions, dtype=torch.int64, device=logits.device)
        flat.index_add_(0, index, torch.tensor(values, dtype=logits.dtype, device=logits.device))
    if any(r != 1.0 for r in repetition_penalty):
        both = [[*p, *o] for p, o in zip(prompt_token_ids, output_token_ids, strict=True)]
        seen = torch.unique(_flat_positions(both, vocab, logits.device))  # row * vocab + token
        penalty = torch.tensor(repetition_penalty, device=logits.device)[seen // vocab]
        values = flat[seen]
        flat[seen] = torch.where(values > 0, values / penalty, values * penalty)
    if any(f != 0.0 for f in frequency_penalty) or any(p != 0.0 for p in presence_penalty):
        positions = _flat_positions(output_token_ids, vocab, logits.device)
        positions, counts = torch.unique(positions, return_counts=True)
        row = positions // vocab
        frequency = torch.tensor(frequency_penalty, device=logits.device)[row]
        presence = torch.tensor(presence_penalty, device=logits.device)[row]
        flat[positions] -= frequency * counts + presence
    return logits


def _flat_positions(
    token_ids: Sequence[list[int]], vocab: int, device: torch.device
) -> torch.Tensor:
    """row * vocab + token for every token of every row: [total]."""
    lengths = [len(ids) for ids in token_ids]
    # np.fromiter reads a list of ints ~4x faster than torch.tensor does.
    tokens = np.fromiter(chain.from_iterable(token_ids), dtype=np.int64, count=sum(lengths))
    starts = np.repeat(np.arange(len(token_ids), dtype=np.int64) * vocab, lengths)
    return torch.from_numpy(starts + tokens).to(device)
