"""Batched sampling of the next token for every sequence in an engine step.

Order of transforms, per row (the order of vLLM and Hugging Face `generate`):

1. Reported logprobs: `log_softmax` of the logits as the sampler gets them (vLLM's default
   "raw logprobs"), untouched by anything below. The engine has already set the tokens a
   structured output forbids to -inf (`worker.sampling.grammar`), as vLLM does.
2. Logit bias (OpenAI's: added to the logits of the tokens it names), then the repetition
   penalty (CTRL, Keskar et al. 2019, as in HF): for tokens in prompt + output, positive
   logits are divided by the penalty and negative ones multiplied by it.
3. Frequency penalty (`- freq * count`) and presence penalty (`- presence` once), counted over
   the output tokens only (OpenAI semantics).
4. Greedy rows (temperature < 1e-5, like vLLM): argmax; ties go to the lowest token id.
5. Temperature: logits / T.
6. Top-k, then top-p (nucleus, Holtzman et al. 2019) on the top-k-renormalized distribution,
   then min-p (relative to the top token). `filter_logits` is the specification.
7. One draw from softmax of what is left, by inverse CDF with one uniform per row. Seeded rows
   draw their uniform from their own generator, so their tokens do not depend on the batch.

Non-finite values, from any source (the model or an adapter, a penalty, a tiny temperature):
a row with a NaN, or with no token above -inf, is not sampled; its `SampledToken.failure`
says why, and the engine ends that request alone. Where a row has +inf logits (after the
penalties and the temperature), its distribution is their limit: uniform over the +inf
tokens, every other token at zero; greedy takes the lowest of them, as for any tie.

Speed on the CPU: a full-vocabulary sort or an exponential race costs far more than the
draw itself, so rows with top-k or top-p work on their most likely tokens
(`worker.sampling.token_draw`) and fall back to the full vocabulary only when the nucleus
does not fit; the inverse CDF goes block sums first, then one block.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from worker.sampling.penalties import apply_penalties_
from worker.sampling.rows import SampledToken, SamplingRow
from worker.sampling.sampling_params import SamplingParams
from worker.sampling.token_draw import is_windowed, sample_rows, take_rows, thresholds

# Below this temperature `logits / T` overflows fp32; such rows are sampled greedily (as vLLM).
GREEDY_TEMPERATURE = 1e-5
# Reported logprobs of impossible tokens (-inf) are this, as OpenAI reports them: JSON has
# no infinity.
LOGPROB_FLOOR = -9999.0


class Sampler:
    """Picks one token per row of a logits batch; see the module docstring for the order."""

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[SampledToken]:
        # logits: [num_rows, vocab], any float dtype; never modified.
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(rows)} rows")
        params = [row.params for row in rows]
        greedy = [p.temperature < GREEDY_TEMPERATURE for p in params]
        with_logprobs = [i for i, p in enumerate(params) if p.logprobs is not None]
        plain = [i for i, p in enumerate(params) if greedy[i] and not p.has_penalties]
        if len(plain) == len(rows) and not with_logprobs:
            argmax, top = _argmax_and_max(logits)
            pairs = zip(argmax, top, strict=True)
            return [SampledToken(t, None, None, why_unusable(v)) for t, v in pairs]
        token_ids = [0] * len(rows)
        failures: dict[int, str] = {}
        if plain:
            # Every row: cheaper than copying a subset first; the max finds unusable rows.
            argmax, top = _argmax_and_max(logits)
            for i in plain:
                token_ids[i] = argmax[i]
                if (why := why_unusable(top[i])) is not None:
                    failures[i] = why
        # One fp32 scratch copy of the other rows, grouped so each group is a slice of it:
        # penalized greedy rows, then rows sampled in a window, then rows sampled in full.
        vocab = logits.shape[1]
        penalized_greedy = [i for i, p in enumerate(params) if greedy[i] and p.has_penalties]
        windowed = [i for i, p in enumerate(params) if not greedy[i] and is_windowed(p, vocab)]
        whole = [i for i, p in enumerate(params) if not greedy[i] and not is_windowed(p, vocab)]
        order = penalized_greedy + windowed + whole
        if order:
            x = _gather_fp32(logits, order)  # [len(order), vocab]
            if any(params[i].has_penalties for i in order):
                _penalize(x, [rows[i] for i in order])
            num_greedy = len(penalized_greedy)
            _divide_by_temperature_(x[num_greedy:], [params[i] for i in order[num_greedy:]])
            for j, why in _tame_(x).items():
                failures[order[j]] = why
            picked = _argmax(x[:num_greedy]) if num_greedy else []
            picked += sample_rows(x[num_greedy:], [rows[i] for i in order[num_greedy:]])
            for i, t in zip(order, picked, strict=True):
                token_ids[i] = t
        results = [SampledToken(t, None, None, failures.get(i)) for i, t in enumerate(token_ids)]
        if with_logprobs:
            _attach_logprobs(results, logits, with_logprobs, [params[i] for i in with_logprobs])
        return results


def filter_logits(
    logits: torch.Tensor,
    *,
    top_k: Sequence[int] | None = None,
    top_p: Sequence[float] | None = None,
    min_p: Sequence[float] | None = None,
) -> torch.Tensor:
    """Top-k, then top-p, then min-p: removed tokens become -inf; `logits` is not modified.

    logits: [n, vocab] fp32, temperature already applied. Per row: top_k 0 = off, top_p 1.0 =
    off, min_p 0.0 = off. Each filter keeps the tokens at or above a threshold logit, so tokens
    tied with the last one kept stay too.
    """
    threshold = thresholds(logits, top_k=top_k, top_p=top_p, min_p=min_p)  # [n]
    return logits.masked_fill(logits < threshold[:, None], -math.inf)


def _divide_by_temperature_(x: torch.Tensor, params: list[SamplingParams]) -> None:
    """x /= T per row, in place. x: [m, vocab] fp32; every T >= GREEDY_TEMPERATURE."""
    temperatures = [p.temperature for p in params]
    if any(t != 1.0 for t in temperatures):
        x.div_(torch.tensor(temperatures, device=x.device)[:, None])


def why_unusable(top: float) -> str | None:
    """Why a row cannot be sampled, or None. `top`: the row's max with NaN propagated
    (numpy's and torch's max and argmax do). Penalties and temperature keep a NaN and make
    none out of numbers (x / p, x * p, x - c, x / T with finite p, c and T > 0 only
    overflow to +-inf), so checking the processed row checks the raw one too."""
    if math.isnan(top):
        return "the model's logits for this request are not numbers (NaN)"
    if top == -math.inf:
        return "no token's logit for this request is above -inf"
    return None


def _tame_(x: torch.Tensor) -> dict[int, str]:
    """Rows with +inf logits become their limit distribution in place: 0 at the +inf
    tokens, -inf elsewhere (uniform over them). Returns the rows that cannot be sampled
    (`why_unusable`), set to 0 everywhere so that sampling them is harmless (the caller
    discards them). x: [m, vocab] fp32, penalties and temperature applied."""
    if x.shape[0] == 0:
        return {}
    top = x.amax(dim=-1)  # [m], NaN where the row has one
    infinite = torch.isposinf(top)
    bad = torch.isnan(top) | torch.isneginf(top)
    any_infinite, any_bad = torch.stack([infinite.any(), bad.any()]).tolist()  # one host sync
    if any_infinite:
        rows = infinite.nonzero().flatten()
        x[rows] = torch.where(torch.isposinf(x[rows]), 0.0, -math.inf)
    if not any_bad:
        return {}
    unusable = {}
    for j in bad.nonzero().flatten().tolist():
        unusable[j] = why_unusable(float(top[j])) or "unusable logits"
        x[j] = 0.0
    return unusable


def _argmax_and_max(x: torch.Tensor) -> tuple[list[int], list[float]]:
    """Row argmax and the value there: NaN if the row has one (both numpy's and torch's
    argmax return a NaN's index), -inf if every entry is. x: [n, vocab]."""
    if x.device.type == "cpu":
        a = x.detach().float().numpy()
        ids = a.argmax(axis=-1)
        return ids.tolist(), a[np.arange(a.shape[0]), ids].tolist()
    return _argmax_and_max_on_device(x)


def _argmax_and_max_on_device(x: torch.Tensor) -> tuple[list[int], list[float]]:
    """``_argmax_and_max`` with one device-to-host copy (token ids are exact in float64)."""
    ids = x.argmax(dim=-1)
    both = torch.stack([ids.double(), x.gather(1, ids[:, None]).squeeze(1).double()])
    ids_host, top_host = both.tolist()
    return [int(t) for t in ids_host], top_host


def _argmax(x: torch.Tensor) -> list[int]:
    """Row argmax, first index on ties (both numpy and torch). x: [n, vocab]."""
    if x.device.type == "cpu":
        # numpy's argmax is about ten times faster than torch's on CPU (docs/performance.md).
        return x.detach().float().numpy().argmax(axis=-1).tolist()
    return x.argmax(dim=-1).tolist()


def _penalize(x: torch.Tensor, rows: list[SamplingRow]) -> None:
    """apply_penalties_ with each row's settings; x: [len(rows), vocab] fp32, in place."""
    apply_penalties_(
        x,
        prompt_token_ids=[row.prompt_token_ids if row.params.has_penalties else [] for row in rows],
        output_token_ids=[row.output_token_ids if row.params.has_penalties else [] for row in rows],
        repetition_penalty=[row.params.repetition_penalty for row in rows],
        presence_penalty=[row.params.presence_penalty for row in rows],
        frequency_penalty=[row.params.frequency_penalty for row in rows],
        logit_bias=[row.params.logit_bias for row in rows],
    )


def _gather_fp32(logits: torch.Tensor, order: list[int]) -> torch.Tensor:
    """logits[order] as a new contiguous fp32 tensor, in one pass where possible."""
    if order == list(range(logits.shape[0])):
        return logits.to(torch.float32, copy=True).contiguous()
    index = torch.tensor(order, device=logits.device)
    return logits.index_select(0, index).to(torch.float32).contiguous()


def _attach_logprobs(
    results: list[SampledToken],
    logits: torch.Tensor,
    indices: list[int],
    params: list[SamplingParams],
) -> None:
    """Fill logprob and top_logprobs of results[indices] from the raw logits (rows with +inf
    through `_tame_`, so no NaN; -inf reported as LOGPROB_FLOOR)."""
    x = take_rows(logits, indices).float()
    if bool(torch.isposinf(x).any()):
        x = x.clone()
        _tame_(x)
    logprobs = torch.log_softmax(x, dim=-1).clamp_(min=LOGPROB_FLOOR)  # [m, vocab]
    chosen = torch.tensor([results[i].token_id for i in indices], device=logits.device)
    chosen_logprobs = logprobs.gather(1, chosen[:, None]).squeeze(1).tolist()
    max_n = max(p.logprobs or 0 for p in params)
    top_values: list[list[float]] = [[] for _ in indices]
    top_ids: list[list[int]] = [[] for _ in indices]
    if max_n:
        top = torch.topk(logprobs, max_n, dim=-1)  # sorted, descending
        top_values, top_ids = top.values.tolist(), top.indices.tolist()
    for j, (i, p) in enumerate(zip(indices, params, strict=True)):
        n = p.logprobs or 0
        results[i].logprob = chosen_logprobs[j]
        results[i].top_logprobs = list(zip(top_ids[j][:n], top_values[j][:n], strict=True))
