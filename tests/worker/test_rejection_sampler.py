"""The speculative accept/reject rule against its oracle: the target distribution itself.

Given probability tables p (target) and q (draft) over a small vocabulary, drafts drawn
from q and verified by ``rejection_sample`` must come out distributed as p, exactly: the
distance between the empirical and the target distribution shrinks like 1/sqrt(samples).
"""

from __future__ import annotations

import pytest
import torch

from worker.spec_decode.rejection_sampler import draw, rejection_sample

VOCAB = 6


def tables(seed: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random p [k + 1, vocab] and q [k, vocab], some entries zero (as after top-k)."""
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(k + 1, VOCAB, generator=g) ** 3
    q = torch.rand(k, VOCAB, generator=g) ** 3
    p[:, 0] = 0.0  # a token the target never emits, but the draft proposes
    q[:, -1] = 0.0  # a token the draft never proposes, but the target emits
    return p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)


def run(p, q, num: int, seed: int, one_hot_drafts: torch.Tensor | None = None):
    """Verify ``num`` independent rows; returns (first emitted token, second or -1)."""
    g = torch.Generator().manual_seed(seed)
    k = p.shape[0] - 1
    if one_hot_drafts is None:
        drafts = torch.stack([torch.multinomial(q[i], num, True, generator=g) for i in range(k)], 1)
        draft_probs = q.expand(num, k, VOCAB)
    else:
        drafts, draft_probs = one_hot_drafts.expand(num, k), None
    uniforms = torch.rand(num, k + 1, dtype=torch.float64, generator=g)
    verdict = rejection_sample(p.expand(num, k + 1, VOCAB), drafts, draft_probs, uniforms)
    n = verdict.num_accepted
    emitted = torch.cat([drafts, torch.full((num, 1), -1)], 1)  # [num, k + 1]
    emitted[torch.arange(k + 1) > n[:, None]] = -1  # nothing comes after the stop
    emitted[torch.arange(num), n] = verdict.next_token
    return emitted[:, 0], emitted[:, 1]


def tv(samples: torch.Tensor, p: torch.Tensor) -> float:
    """Total variation distance between the samples' histogram and p."""
    counts = torch.bincount(samples, minlength=VOCAB).double()
    return 0.5 * (counts / counts.sum() - p.double()).abs().sum().item()


@pytest.mark.parametrize("proposer", ["draft", "one-hot"])
def test_first_token_is_distributed_as_the_target_and_the_error_shrinks(proposer):
    p, q = tables(seed=1, k=2)
    one_hot = torch.tensor([0, 3]) if proposer == "one-hot" else None  # 0: p never emits it
    distances = []
    for num in (1_000, 10_000, 200_000):
        first, _ = run(p, q, num, seed=num, one_hot_drafts=one_hot)
        distances.append(tv(first, p[0]))
    # Sampling noise alone: E[TV] ~ sqrt(vocab / (2 pi num)); 200k samples give ~0.002.
    assert distances[-1] < 0.006, distances
    assert distances[0] > distances[-1] and distances[1] > distances[-1], distances
    assert (first != 0).all()  # the token p gives zero probability never comes out


def test_second_token_given_the_first_draft_accepted_is_distributed_as_the_target():
    """Position 1 is reached only after accepting d_0; its tokens must follow p_1."""
    p, q = tables(seed=2, k=2)
    first, second = run(p, q, 300_000, seed=5)
    reached = second[second >= 0]
    assert len(reached) > 50_000
    assert tv(reached, p[1]) < 0.01
    assert tv(first, p[0]) < 0.006


def test_equal_target_and_draft_accept_everything_and_emit_a_bonus_from_the_target():
    p, _ = tables(seed=3, k=3)
    q = p[:3].clone()
    g = torch.Generator().manual_seed(0)
    drafts = torch.stack([torch.multinomial(q[i], 2_000, True, generator=g) for i in range(3)], 1)
    uniforms = torch.rand(2_000, 4, dtype=torch.float64, generator=g)
    verdict = rejection_sample(
        p.expand(2_000, 4, VOCAB), drafts, q.expand(2_000, 3, VOCAB), uniforms
    )
    assert (verdict.num_accepted == 3).all()
    assert tv(verdict.next_token, p[3]) < 0.05


def test_a_draft_the_target_rules_out_is_always_rejected():
    p, _ = tables(seed=4, k=1)
    drafts = torch.zeros(500, 1, dtype=torch.int64)  # token 0: p = 0 there
    uniforms = torch.rand(500, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    verdict = rejection_sample(p.expand(500, 2, VOCAB), drafts, None, uniforms)
    assert (verdict.num_accepted == 0).all() and (verdict.next_token != 0).all()


def test_draw_never_picks_a_zero_weight_token_even_at_the_edges():
    weights = torch.tensor([[0.0, 1.0, 0.0, 1.0, 0.0]]).expand(4, 5)
    uniforms = torch.tensor([0.0, 0.4999999, 0.5, 1.0 - 1e-16], dtype=torch.float64)
    assert draw(weights, uniforms).tolist() == [1, 1, 3, 3]


def test_no_drafts_draw_the_token_from_the_targets_first_row():
    """A step that verifies alternatives alone has no chain to test: the token comes from
    p_0 itself (then distributed as p_0, the distance shrinking with the samples)."""
    p, _ = tables(seed=7, k=0)
    num = 40_000
    g = torch.Generator().manual_seed(8)
    verdict = rejection_sample(
        p.expand(num, 1, VOCAB),
        torch.zeros(num, 0, dtype=torch.int64),
        None,
        torch.rand(num, 1, dtype=torch.float64, generator=g),
    )
    assert (verdict.num_accepted == 0).all()
    assert tv(verdict.next_token, p[0]) < 0.01
