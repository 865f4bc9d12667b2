"""Drawing one token per row from processed logits (`worker.sampling.sampler` applies penalties,
temperature and the non-finite rules first): top-k, top-p and min-p on a window of each
row's most likely tokens where they fit, else on the whole vocabulary, then one draw by
inverse CDF with one uniform per row (a seeded row's from its own generator)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from worker.sampling.rows import SamplingRow
from worker.sampling.sampling_params import SamplingParams

# Candidates per row examined for top-k / top-p before falling back to the whole vocabulary.
WINDOW = 256
# Inverse-CDF block: one cumsum over block sums, then one inside the chosen block.
_BLOCK = 256
# exp() of fp32 values that underflow takes a slow path on CPU (10x): clamp log-weights at -80
# (e^-80 is a normal float), then subtract e^-79 so everything more than 79 nats below the top
# token, -inf (banned) included, has weight exactly 0 (it had probability < 5e-35).
_MIN_LOG_WEIGHT = -80.0
_WEIGHT_FLOOR = math.exp(-79.0)


def thresholds(
    logits: torch.Tensor,
    *,
    top_k: Sequence[int] | None,
    top_p: Sequence[float] | None,
    min_p: Sequence[float] | None,
) -> torch.Tensor:
    """Per row, the smallest logit that survives the filters: [n]; -inf keeps everything."""
    n, vocab = logits.shape
    threshold = torch.full((n,), -math.inf, device=logits.device)
    nucleus = [i for i in range(n) if top_p is not None and top_p[i] < 1.0]
    if nucleus and top_p is not None:
        ks = [top_k[i] if top_k is not None else 0 for i in nucleus]
        ps = [top_p[i] for i in nucleus]
        threshold[nucleus] = _top_p_threshold(take_rows(logits, nucleus), ks, ps)
    in_nucleus = set(nucleus)
    only_k = [i for i in range(n) if top_k is not None and 0 < top_k[i] < vocab]
    only_k = [i for i in only_k if i not in in_nucleus]
    if only_k and top_k is not None:
        threshold[only_k] = _kth_largest(take_rows(logits, only_k), [top_k[i] for i in only_k])
    if min_p is not None and any(m > 0.0 for m in min_p):
        # p_i >= min_p * p_max  <=>  x_i >= x_max + log(min_p); log(0) = -inf keeps all.
        relative = torch.tensor(min_p, device=logits.device).log()
        threshold = torch.maximum(threshold, logits.amax(dim=-1) + relative)
    return threshold


def sample_rows(x: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
    """Filters, one draw per row. x: [m, vocab] fp32 scratch (modified), temperature
    applied and tamed (`_tame_`), rows that `is_windowed` accepts first."""
    params = [row.params for row in rows]
    uniforms = _uniforms([row.generator for row in rows]).to(x.device)  # [m]
    vocab = x.shape[1]
    num_windowed = sum(is_windowed(p, vocab) for p in params)
    token_ids: list[int] = []
    if num_windowed:
        window = _sample_windowed(x[:num_windowed], params[:num_windowed], uniforms[:num_windowed])
        # Rows whose nucleus is wider than the window start over on the whole vocabulary.
        wide = [j for j, t in enumerate(window) if t is None]
        if wide:
            redo = _sample_whole(x[wide], [params[j] for j in wide], uniforms[wide])
            for j, t in zip(wide, redo, strict=True):
                window[j] = t
        token_ids += [t for t in window if t is not None]
    if num_windowed < len(rows):
        rest = slice(num_windowed, None)
        token_ids += _sample_whole(x[rest], params[rest], uniforms[rest])
    return token_ids


def is_windowed(params: SamplingParams, vocab: int) -> bool:
    """Whether top-k or top-p limit the row, so its candidates come from a window."""
    return 0 < params.top_k < vocab or params.top_p < 1.0


def _sample_whole(
    x: torch.Tensor, params: list[SamplingParams], uniforms: torch.Tensor
) -> list[int]:
    """Filters and draws over the whole vocabulary. x: [m, vocab] fp32 (modified)."""
    top_k = [p.top_k for p in params]
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    threshold = None
    if any(top_k) or any(p < 1.0 for p in top_p) or any(min_p):
        threshold = thresholds(x, top_k=top_k, top_p=top_p, min_p=min_p)
    return _sample_full(x, threshold, uniforms)


def _sample_windowed(
    x: torch.Tensor, params: list[SamplingParams], uniforms: torch.Tensor
) -> list[int | None]:
    """Filters and draws among each row's most likely tokens; None where the top-p nucleus
    does not fit in them. x: [m, vocab] fp32, temperature applied."""
    m, vocab = x.shape
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    width = min(vocab, max(WINDOW, *ks))
    values, token_ids = _top_candidates(x, width)  # [m, width] each, values descending
    weights = (values - values[:, :1]).exp()  # [m, width]: p_i / p_max
    k = torch.tensor([k or width for k in ks], device=x.device)
    keep = values >= values.gather(1, (k - 1)[:, None])  # top-k; ties stay
    # Top-p renormalizes over what top-k kept; without top-k, over the whole row.
    mass = row_sums(weights * keep)  # [m], in units of p_max
    whole_row = [i for i in range(m) if ks[i] == 0]
    if whole_row:
        rest = take_rows(x, whole_row) - values[whole_row, :1]
        mass[whole_row] = row_sums(rest.clamp_(min=_MIN_LOG_WEIGHT).exp_())
    probs = weights * keep / mass[:, None]  # [m, width]
    cumulative = probs.cumsum(dim=-1)
    top_p = torch.tensor([p.top_p if p.top_p < 1.0 else math.inf for p in params], device=x.device)
    keep &= cumulative - probs < top_p[:, None]  # smallest set with mass >= top_p
    fits = (cumulative[:, -1] >= top_p) | torch.isinf(top_p)
    min_p = torch.tensor([p.min_p for p in params], device=x.device)
    keep &= weights >= min_p[:, None]
    chosen = pick(weights * keep, uniforms)  # [m], positions in the window
    picked = token_ids.gather(1, chosen[:, None]).squeeze(1).tolist()
    return [t if ok else None for t, ok in zip(picked, fits.tolist(), strict=True)]


def _sample_full(
    x: torch.Tensor, threshold: torch.Tensor | None, uniforms: torch.Tensor
) -> list[int]:
    """Draws from softmax(x) over tokens >= threshold. x: [m, vocab] fp32 (modified)."""
    head = x.amax(dim=-1, keepdim=True)  # [m, 1]
    relative = x.sub_(head)  # [m, vocab], <= 0
    keep = relative >= (threshold[:, None] - head) if threshold is not None else None
    weights = relative.clamp_(min=_MIN_LOG_WEIGHT).exp_().sub_(_WEIGHT_FLOOR).clamp_(min=0.0)
    if keep is not None:
        weights = torch.where(keep, weights, 0.0)
    return pick(weights, uniforms).tolist()


def pick(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse CDF: index i with probability weights[i] / sum, first over block sums, then
    inside the chosen block. weights: [m, n] >= 0 with a positive entry; uniforms: [m] in
    [0, 1) fp64. Zero-weight entries are never chosen."""
    m, n = weights.shape
    if n % _BLOCK:
        weights = F.pad(weights, (0, _BLOCK - n % _BLOCK))
    blocks = weights.view(m, -1, _BLOCK)  # [m, num_blocks, BLOCK]
    block_cdf = blocks.sum(dim=-1).double().cumsum_(dim=-1)  # [m, num_blocks]
    target = _below(uniforms * block_cdf[:, -1], block_cdf[:, -1])  # [m]
    # right=True: the first cdf entry above target, so never one after a zero weight.
    block = torch.searchsorted(block_cdf, target[:, None], right=True).squeeze(1)  # [m]
    before = F.pad(block_cdf, (1, 0)).gather(1, block[:, None]).squeeze(1)  # mass of blocks < b
    inner_cdf = blocks[torch.arange(m, device=weights.device), block].double().cumsum_(dim=-1)
    inner = _below(target - before, inner_cdf[:, -1])
    offset = torch.searchsorted(inner_cdf, inner[:, None], right=True).squeeze(1)
    return block * _BLOCK + offset


def row_sums(x: torch.Tensor) -> torch.Tensor:
    """Each row's sum, [m, n] -> [m], added in one order whatever else is in the batch:
    sums of blocks of ``_BLOCK`` entries, then their running total. (torch's ``sum`` splits
    a lone long row over threads but not a row among others, so a row's mass, and its
    top-p cut, would depend on its neighbours; zeros past the end change nothing either.)"""
    m, n = x.shape
    if n % _BLOCK:
        x = F.pad(x, (0, _BLOCK - n % _BLOCK))
    return x.reshape(m, -1, _BLOCK).sum(dim=-1).cumsum_(dim=-1)[:, -1]


def _below(value: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """min(value, the largest float < total): some entry of a cdf ending at total exceeds it."""
    return torch.minimum(value, torch.nextafter(total, torch.zeros_like(total)))


def _uniforms(generators: list[torch.Generator | None]) -> torch.Tensor:
    """One fp64 uniform per row; seeded rows draw from their own generator only."""
    uniforms = torch.rand(len(generators), dtype=torch.float64)  # global RNG
    for i, generator in enumerate(generators):
        if generator is not None:
            uniforms[i] = torch.rand((), dtype=torch.float64, generator=generator)
    return uniforms


def _top_p_threshold(x: torch.Tensor, ks: list[int], ps: list[float]) -> torch.Tensor:
    """Per row, the smallest logit kept by top-k then top-p. x: [m, vocab] -> [m]."""
    _, vocab = x.shape
    ascending = _sort_ascending(x)  # [m, vocab]
    if any(0 < k < vocab for k in ks):
        k = torch.tensor([k if 0 < k < vocab else vocab for k in ks], device=x.device)
        kth = ascending.gather(1, (vocab - k)[:, None])  # [m, 1]
        ascending.masked_fill_(ascending < kth, -math.inf)
    cumulative = ascending.softmax(dim=-1).cumsum_(dim=-1)  # [m, vocab]
    # Drop the least likely tokens while their total mass is <= 1 - p: the rest is the smallest
    # set with mass >= p. The top token always stays.
    drop = 1.0 - torch.tensor(ps, device=x.device)[:, None]
    num_dropped = (cumulative <= drop).sum(dim=-1).clamp_(max=vocab - 1)  # [m]
    return ascending.gather(1, num_dropped[:, None]).squeeze(1)


def _kth_largest(x: torch.Tensor, ks: list[int]) -> torch.Tensor:
    """Per row, the k-th largest logit. x: [m, vocab] fp32, 1 <= k < vocab -> [m]."""
    max_k = max(ks)
    top, _ = _top_candidates(x, max_k)  # [m, max_k] descending
    k = torch.tensor(ks, device=x.device)
    return top.gather(1, (k - 1)[:, None]).squeeze(1)


def _top_candidates(x: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `width` largest logits per row, descending, and their token ids: [m, width] each."""
    if x.device.type != "cpu":
        top = torch.topk(x, width, dim=-1)
        return top.values, top.indices
    # numpy's argpartition is over twice as fast as torch.topk on CPU (docs/performance.md).
    a = x.numpy()
    ids = np.argpartition(a, a.shape[1] - width, axis=-1)[:, a.shape[1] - width :]
    values = np.take_along_axis(a, ids, axis=-1)
    order = np.argsort(-values, axis=-1, kind="stable")
    values = np.take_along_axis(values, order, axis=-1)
    return torch.from_numpy(values), torch.from_numpy(np.take_along_axis(ids, order, axis=-1))


def _sort_ascending(x: torch.Tensor) -> torch.Tensor:
    if x.device.type == "cpu":
        # numpy's vectorized sort is some twenty times faster than torch.sort on CPU
        # (docs/performance.md).
        return torch.from_numpy(np.sort(x.numpy(), axis=-1))
    return torch.sort(x, dim=-1).values


def take_rows(x: torch.Tensor, indices: list[int]) -> torch.Tensor:
    """x[indices], without a copy when indices is every row in order."""
    if len(indices) == x.shape[0]:
        return x
    return x[indices]
