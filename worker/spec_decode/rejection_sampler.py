"""The accept/reject rule of speculative sampling, on probability tables (no model).

Semantics, per row with drafts d_0..d_{k-1} drawn from q_0..q_{k-1} and target
distributions p_0..p_k: for i = 0, 1, ...: accept d_i if u_i < p_i(d_i) / q_i(d_i);
at the first rejection i, emit a token from norm(max(0, p_i - q_i)) and stop; if all k
are accepted, emit a bonus token from p_k. Every emitted token is then distributed exactly
as p (Leviathan et al. 2023, Theorem 3.5; Chen et al. 2023, Theorem 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class Verdict:
    num_accepted: torch.Tensor  # [n] int64: leading drafts accepted
    next_token: torch.Tensor  # [n] int64: the correction (or bonus) token emitted after them


def rejection_sample(
    target_probs: torch.Tensor,  # [n, k + 1, vocab]: p_0..p_k, rows sum to 1
    draft_tokens: torch.Tensor,  # [n, k] int64
    draft_probs: torch.Tensor | None,  # [n, k, vocab]: q_i; None: drafts were deterministic
    uniforms: torch.Tensor,  # [n, k + 1] in [0, 1): k acceptance tests, then one draw
) -> Verdict:
    """Verify ``n`` rows of ``k`` drafts at once. ``draft_probs=None`` means each q_i is
    one-hot at d_i (an n-gram proposal, or a greedy draft): accept with probability p_i(d_i),
    else draw from p_i with d_i removed."""
    n, k = draft_tokens.shape
    # The drafts and uniforms may come from the host; the distributions' device decides.
    device = target_probs.device
    draft_tokens, uniforms = draft_tokens.to(device), uniforms.to(device)
    rows = torch.arange(n, device=device)
    if k == 0:  # no drafts (a step verifying alternatives alone): the token comes from p_0
        return Verdict(
            torch.zeros(n, dtype=torch.int64, device=device),
            draw(target_probs[:, 0], uniforms[:, 0]),
        )
    index = draft_tokens.unsqueeze(-1)  # [n, k, 1]
    p_d = target_probs[:, :k].gather(-1, index).squeeze(-1).double()  # [n, k]
    if draft_probs is None:
        ratio = p_d
    else:
        q_d = draft_probs.gather(-1, index).squeeze(-1).double()  # [n, k]
        ratio = p_d / q_d  # q_d > 0: d was drawn from q
    accepted = uniforms[:, :k] < ratio  # [n, k]
    # Leading run of acceptances: cumprod stays 1 until the first rejection.
    num_accepted = accepted.long().cumprod(dim=-1).sum(dim=-1)  # [n]
    p = target_probs[rows, num_accepted].double()  # [n, vocab]: p_i at the stop position
    rejected = num_accepted < k
    at = num_accepted.clamp(max=k - 1)
    if draft_probs is None:
        q = torch.zeros_like(p)
        q[rows, draft_tokens[rows, at]] = 1.0
    else:
        q = draft_probs[rows, at].double()
    q = q * rejected.unsqueeze(-1)  # a bonus token comes from p itself
    residual = (p - q).clamp_(min=0.0)
    # p == q exactly makes a rejection impossible; rounding can still leave ~0 mass.
    empty = residual.sum(dim=-1) <= 1e-12
    residual[empty] = p[empty]
    next_token = draw(residual, uniforms[:, k])
    return Verdict(num_accepted=num_accepted, next_token=next_token)


def draw(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse CDF: index i with probability weights[i] / sum; zero weights never chosen.
    weights: [n, vocab] >= 0; uniforms: [n] in [0, 1) -> [n] int64."""
    cdf = weights.double().cumsum(dim=-1)  # [n, vocab]
    total = cdf[:, -1]
    below_total = torch.nextafter(total, torch.zeros_like(total))
    target = torch.minimum(uniforms.to(cdf.device).double() * total, below_total)
    # right=True: the first entry above target, never one right after a zero weight.
    return torch.searchsorted(cdf, target[:, None], right=True).squeeze(1)
