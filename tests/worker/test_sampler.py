"""Sampler: greedy, penalties, top-k / top-p / min-p, seeded sampling, logprobs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from worker.sampling.penalties import apply_penalties_
from worker.sampling.rows import SampledToken, SamplingRow, make_generator
from worker.sampling.sampler import LOGPROB_FLOOR, Sampler, filter_logits
from worker.sampling.sampling_params import SamplingParams
from worker.sampling.token_draw import pick, row_sums

NEG_INF = -math.inf


def make_row(
    *,
    output: list[int] | None = None,
    prompt: list[int] | None = None,
    **params: object,
) -> SamplingRow:
    sampling = SamplingParams(**params)  # type: ignore[arg-type]
    return SamplingRow(
        params=sampling,
        output_token_ids=list(output or []),
        prompt_token_ids=list(prompt or [0]),
        generator=make_generator(sampling.seed),
    )


def logits_from_probs(*rows: list[float]) -> torch.Tensor:
    """Logits whose softmax is exactly the given distribution per row: [len(rows), vocab]."""
    return torch.tensor(rows, dtype=torch.float64).log().float()


def finite(row: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(row)).flatten().tolist())


def sample_many(logits_row: torch.Tensor, n: int, seed: int = 0, **params: object) -> list[int]:
    """n independent draws from one row of logits, as one batch of n rows."""
    torch.manual_seed(seed)
    rows = [make_row(**params) for _ in range(n)]
    return [t.token_id for t in Sampler()(logits_row.expand(n, -1), rows)]


# --- greedy -------------------------------------------------------------------------------


@pytest.mark.parametrize("num_rows", [1, 3, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax(num_rows: int, dtype: torch.dtype) -> None:
    logits = torch.randn(num_rows, 1000, generator=torch.Generator().manual_seed(num_rows))
    logits = logits.to(dtype)
    out = Sampler()(logits, [make_row(temperature=0.0) for _ in range(num_rows)])
    assert [t.token_id for t in out] == logits.argmax(dim=-1).tolist()
    assert all(t.logprob is None and t.top_logprobs is None for t in out)


def test_the_device_argmax_path_matches_numpy_with_nan_and_inf_rows() -> None:
    """The GPU's one-transfer argmax (run here on CPU tensors) against numpy: a large id,
    a tie, a NaN row and an all -inf row."""
    from worker.sampling.sampler import _argmax_and_max_on_device

    logits = torch.randn(4, 70_000, generator=torch.Generator().manual_seed(3))
    logits[0, 69_999] = 50.0  # the last id of a vocabulary larger than SmolLM2's
    logits[1, [5, 9]] = 40.0  # a tie: the lowest index
    logits[2, 123] = math.nan
    logits[3] = -math.inf
    ids, top = _argmax_and_max_on_device(logits)
    a = logits.numpy()
    want_ids = a.argmax(axis=-1)
    assert ids == want_ids.tolist() == [69_999, 5, 123, 0]
    assert top[:2] == [50.0, 40.0] and math.isnan(top[2]) and top[3] == -math.inf


def test_greedy_ties_go_to_the_lowest_index_like_torch_argmax() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, 5.0, 5.0, 5.0]])
    out = Sampler()(logits, [make_row(temperature=0.0), make_row(temperature=0.0)])
    assert [t.token_id for t in out] == [1, 0] == logits.argmax(dim=-1).tolist()


def test_tiny_temperature_is_greedy() -> None:
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(1))
    out = Sampler()(logits, [make_row(temperature=1e-7) for _ in range(4)])
    assert [t.token_id for t in out] == logits.argmax(dim=-1).tolist()


def test_greedy_rows_in_a_mixed_batch_are_still_argmax() -> None:
    logits = torch.randn(6, 500, generator=torch.Generator().manual_seed(2))
    rows = [make_row(temperature=0.0 if i % 2 == 0 else 1.0, seed=i) for i in range(6)]
    out = Sampler()(logits, rows)
    for i in range(0, 6, 2):
        assert out[i].token_id == int(logits[i].argmax())


def test_logits_are_not_modified() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(3))
    before = logits.clone()
    rows = [
        make_row(temperature=0.7, top_p=0.5, top_k=5, min_p=0.1, seed=1),
        make_row(temperature=0.0, repetition_penalty=1.5, output=[1, 2]),
        make_row(temperature=1.0, frequency_penalty=1.0, output=[3], logprobs=2),
    ]
    Sampler()(logits, rows)
    assert torch.equal(logits, before)


def test_rows_must_match_logits() -> None:
    with pytest.raises(ValueError, match="rows"):
        Sampler()(torch.zeros(2, 10), [make_row()])


# --- penalties ----------------------------------------------------------------------------


def penalize(
    logits: list[float],
    *,
    prompt: list[int],
    output: list[int],
    repetition: float = 1.0,
    presence: float = 0.0,
    frequency: float = 0.0,
) -> list[float]:
    x = torch.tensor([logits])
    apply_penalties_(
        x,
        prompt_token_ids=[prompt],
        output_token_ids=[output],
        repetition_penalty=[repetition],
        presence_penalty=[presence],
        frequency_penalty=[frequency],
    )
    return x[0].tolist()


def test_repetition_penalty_divides_positive_and_multiplies_negative_over_prompt_and_output():
    # token 0 in the prompt, token 1 in the output, tokens 2 and 3 unseen.
    got = penalize([2.0, -1.0, 0.5, 3.0], prompt=[0], output=[1, 1], repetition=2.0)
    assert got == [1.0, -2.0, 0.5, 3.0]


def test_frequency_penalty_scales_with_the_output_count_only() -> None:
    got = penalize([1.0, 1.0, 1.0, 1.0], prompt=[3], output=[1, 1, 2], frequency=0.5)
    assert got == [1.0, 0.0, 0.5, 1.0]


def test_presence_penalty_applies_once_per_output_token() -> None:
    got = penalize([1.0, 1.0, 1.0, 1.0], prompt=[3], output=[1, 1, 2], presence=0.25)
    assert got == [1.0, 0.75, 0.75, 1.0]


def test_repetition_comes_before_frequency_and_presence() -> None:
    got = penalize(
        [4.0, -2.0, 4.0, 1.0],
        prompt=[2],
        output=[0, 0, 1],
        repetition=2.0,
        frequency=0.5,
        presence=0.25,
    )
    # token 0: 4 / 2 - 0.5 * 2 - 0.25; token 1: -2 * 2 - 0.5 - 0.25; token 2 (prompt): 4 / 2
    assert got == [0.75, -4.75, 2.0, 1.0]


def test_negative_penalties_encourage_repeats() -> None:
    got = penalize([0.0, 0.0], prompt=[0], output=[1], frequency=-1.0, presence=-0.5)
    assert got == [0.0, 1.5]


def test_penalties_are_per_row_in_a_batch() -> None:
    x = torch.zeros(3, 4)
    apply_penalties_(
        x,
        prompt_token_ids=[[0], [0], [0]],
        output_token_ids=[[1], [2, 2], []],
        repetition_penalty=[1.0, 1.0, 1.0],
        presence_penalty=[1.0, 0.0, 1.0],
        frequency_penalty=[0.0, 1.0, 0.0],
    )
    assert x.tolist() == [[0, -1, 0, 0], [0, 0, -2, 0], [0, 0, 0, 0]]


def test_sampler_applies_penalties_before_greedy_choice() -> None:
    logits = torch.tensor([[5.0, 4.0, 1.0], [5.0, 4.0, 1.0], [5.0, 4.0, 1.0]])
    rows = [
        make_row(temperature=0.0, output=[0], frequency_penalty=2.0),  # 5 - 2 < 4
        make_row(temperature=0.0, prompt=[0], repetition_penalty=1.5),  # 5 / 1.5 < 4
        make_row(temperature=0.0, output=[1], presence_penalty=2.0),  # unaffected top
    ]
    assert [t.token_id for t in Sampler()(logits, rows)] == [1, 1, 0]


# --- top-k / top-p / min-p ----------------------------------------------------------------


def test_top_k_keeps_exactly_the_k_largest() -> None:
    logits = torch.tensor([[0.1, 2.0, -1.0, 3.0, 1.0, 0.5]])
    assert finite(filter_logits(logits, top_k=[1])[0]) == {3}
    assert finite(filter_logits(logits, top_k=[3])[0]) == {1, 3, 4}
    assert finite(filter_logits(logits, top_k=[0])[0]) == set(range(6))
    assert finite(filter_logits(logits, top_k=[6])[0]) == set(range(6))
    assert finite(filter_logits(logits, top_k=[100])[0]) == set(range(6))


def test_top_k_keeps_ties_with_the_kth_logit() -> None:
    logits = torch.tensor([[1.0, 2.0, 2.0, 0.0]])
    assert finite(filter_logits(logits, top_k=[2])[0]) == {1, 2}
    assert finite(filter_logits(logits, top_k=[1])[0]) == {1, 2}


def test_kept_logits_are_unchanged() -> None:
    logits = torch.tensor([[0.1, 2.0, -1.0, 3.0]])
    filtered = filter_logits(logits, top_k=[2], top_p=[0.99], min_p=[0.01])
    assert filtered[0].tolist() == [NEG_INF, 2.0, NEG_INF, 3.0]


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [
        (0.3, {0}),  # the top token always stays
        (0.5, {0}),
        (0.55, {0, 1}),
        (0.7, {0, 1}),
        (0.8, {0, 1, 2}),
        (0.95, {0, 1, 2, 3}),
        (1.0, {0, 1, 2, 3, 4}),
    ],
)
def test_top_p_keeps_the_smallest_set_with_enough_mass(top_p: float, kept: set[int]) -> None:
    logits = logits_from_probs([0.52, 0.25, 0.13, 0.06, 0.04])
    assert finite(filter_logits(logits, top_p=[top_p])[0]) == kept


def test_top_p_works_on_unsorted_logits() -> None:
    logits = logits_from_probs([0.06, 0.25, 0.04, 0.52, 0.13])
    assert finite(filter_logits(logits, top_p=[0.8])[0]) == {1, 3, 4}


def test_top_p_sees_the_top_k_renormalized_distribution() -> None:
    logits = logits_from_probs([0.4, 0.3, 0.2, 0.1])
    assert finite(filter_logits(logits, top_p=[0.5])[0]) == {0, 1}
    # after top-2 the distribution is [4/7, 3/7]: 4/7 >= 0.5 alone
    assert finite(filter_logits(logits, top_k=[2], top_p=[0.5])[0]) == {0}
    assert finite(filter_logits(logits, top_k=[3], top_p=[0.99])[0]) == {0, 1, 2}


@pytest.mark.parametrize(
    ("min_p", "kept"),
    [(0.0, {0, 1, 2, 3}), (0.1, {0, 1, 2, 3}), (0.25, {0, 1, 2}), (0.5, {0, 1}), (1.0, {0})],
)
def test_min_p_drops_tokens_below_a_fraction_of_the_top(min_p: float, kept: set[int]) -> None:
    logits = logits_from_probs([0.5, 0.3, 0.14, 0.06])
    assert finite(filter_logits(logits, min_p=[min_p])[0]) == kept


def test_top_p_and_min_p_both_apply() -> None:
    logits = logits_from_probs([0.5, 0.3, 0.14, 0.06])
    assert finite(filter_logits(logits, top_p=[0.7], min_p=[0.2])[0]) == {0, 1}
    assert finite(filter_logits(logits, top_p=[0.9], min_p=[0.2])[0]) == {0, 1, 2}


def test_each_row_keeps_its_own_settings() -> None:
    vocab = 64
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(4)) * 3
    settings = [
        {"top_k": 0, "top_p": 1.0, "min_p": 0.0},
        {"top_k": 5, "top_p": 1.0, "min_p": 0.0},
        {"top_k": 0, "top_p": 0.6, "min_p": 0.0},
        {"top_k": 10, "top_p": 0.8, "min_p": 0.05},
        {"top_k": 0, "top_p": 1.0, "min_p": 0.3},
    ]
    batched = filter_logits(
        logits,
        top_k=[s["top_k"] for s in settings],
        top_p=[s["top_p"] for s in settings],
        min_p=[s["min_p"] for s in settings],
    )
    for i, s in enumerate(settings):
        alone = filter_logits(
            logits[i : i + 1], top_k=[s["top_k"]], top_p=[s["top_p"]], min_p=[s["min_p"]]
        )
        assert torch.equal(batched[i], alone[0])
    assert len(finite(batched[0])) == vocab
    assert len(finite(batched[1])) == 5


def test_sampler_never_picks_a_filtered_token_and_reaches_every_kept_one() -> None:
    logits = logits_from_probs([0.3, 0.05, 0.25, 0.02, 0.2, 0.18])[0]
    # top-k 4 keeps {0, 2, 4, 5}, renormalized to [.32, .27, .22, .19]: top-p 0.9 needs all
    # four, top-p 0.7 the first three. min-p 0.5 keeps p >= 0.15.
    assert set(sample_many(logits, 3000, top_k=4, top_p=0.9)) == {0, 2, 4, 5}
    assert set(sample_many(logits, 3000, top_k=4, top_p=0.7)) == {0, 2, 4}
    assert set(sample_many(logits, 3000, min_p=0.5)) == {0, 2, 4, 5}
    assert set(sample_many(logits, 3000, top_k=1)) == {0}


def test_banned_tokens_at_minus_inf_are_never_sampled() -> None:
    logits = torch.zeros(1, 3000)
    logits[0, ::2] = NEG_INF  # every even token banned
    for params in [{}, {"temperature": 0.3}, {"top_p": 0.5}, {"min_p": 0.5}, {"top_k": 2000}]:
        assert all(t % 2 == 1 for t in sample_many(logits[0], 500, **params)), params


@pytest.mark.parametrize("spread", [0.5, 3.0])  # flat: the nucleus is wider than the window
def test_top_p_on_a_large_vocabulary_samples_only_from_the_nucleus(spread: float) -> None:
    vocab = 2048
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(14)) * spread
    kept = finite(filter_logits(logits[None], top_p=[0.8])[0])
    draws = sample_many(logits, 2500, top_p=0.8)
    assert set(draws) <= kept
    if spread > 1:  # peaked: few tokens, all of them drawn, in the right proportions
        assert 20 < len(kept) < 256 and set(draws) == kept
        probs = torch.softmax(filter_logits(logits[None], top_p=[0.8])[0].double(), dim=-1)
        top = sorted(kept, key=lambda t: -probs[t].item())[:8]
        rest = 1.0 - sum(probs[t].item() for t in top)
        counts = [draws.count(t) for t in top] + [sum(t not in top for t in draws)]
        assert chi_square(counts, [probs[t].item() for t in top] + [rest]) < 26.1  # 8 dof
    else:  # flat: most of the vocabulary, far more than the window
        assert len(kept) > 1000 and len(set(draws)) > 700


# --- sampling distribution and seeds ------------------------------------------------------


def chi_square(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs, strict=True))


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_samples_follow_softmax_of_logits_over_temperature(temperature: float) -> None:
    probs = [0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.015, 0.005]
    logits = logits_from_probs(probs)[0]
    draws = sample_many(logits, 20_000, seed=5, temperature=temperature)
    expected = torch.softmax(logits.double() / temperature, dim=-1).tolist()
    counts = [draws.count(i) for i in range(len(probs))]
    # 7 degrees of freedom: P(chi2 > 24.3) = 0.001; the seed is fixed, so this is not flaky.
    assert chi_square(counts, expected) < 24.3
    if temperature != 1.0:  # and it is not the untempered distribution
        assert chi_square(counts, probs) > 100


def test_samples_across_a_vocabulary_that_is_not_a_multiple_of_the_block() -> None:
    vocab = 1000  # the inverse CDF pads to 1024 and goes block by block
    probs = torch.full((vocab,), 1e-9, dtype=torch.float64)
    favourites = [0, 255, 256, 511, 700, 999]
    probs[favourites] = torch.tensor([0.3, 0.1, 0.2, 0.15, 0.05, 0.2], dtype=torch.float64)
    draws = sample_many(probs.log().float(), 10_000, seed=15)
    counts = [draws.count(t) for t in favourites]
    assert sum(counts) == len(draws)
    assert chi_square(counts, probs[favourites].tolist()) < 20.5  # 5 dof, p = 0.001


def test_inverse_cdf_stays_inside_the_chosen_block_when_fp32_block_sums_round_up() -> None:
    # fp32 rounds the block sum 1 + 0.75 * 2**-23 up to 1 + 2**-23, above the exact fp64 sum.
    weights = torch.zeros(2, 256)
    weights[:, 0] = 1.0
    weights[:, 1] = 3 * 2.0**-25
    largest_below_one = torch.nextafter(torch.tensor(1.0, dtype=torch.float64), torch.tensor(0.0))
    uniforms = torch.stack([largest_below_one, torch.tensor(0.0, dtype=torch.float64)])
    assert pick(weights, uniforms).tolist() == [1, 0]


def test_same_seed_gives_the_same_tokens() -> None:
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(6))

    def run(seed: int) -> list[int]:
        row = make_row(seed=seed, temperature=1.3, top_p=0.95)
        return [Sampler()(logits, [row])[0].token_id for _ in range(20)]

    assert run(7) == run(7)
    assert run(7) != run(8)


@pytest.mark.parametrize(
    "settings",
    [
        {"temperature": 0.8, "top_k": 50, "top_p": 0.9},  # within the window
        {"temperature": 4.0, "top_p": 0.95},  # nucleus wider than the window
        {"temperature": 1.1, "min_p": 0.05, "repetition_penalty": 1.3, "output": [3, 4]},
    ],
)
def test_seeded_rows_do_not_depend_on_the_rest_of_the_batch(settings: dict[str, object]) -> None:
    settings = {**settings, "seed": 1234}
    vocab = 1000
    gen = torch.Generator().manual_seed(9)
    mine = torch.randn(vocab, generator=gen)
    others = torch.randn(7, vocab, generator=gen)

    def tokens_of_seeded_row(batch: torch.Tensor, position: int, rows: list[SamplingRow]):
        out = []
        for _ in range(10):
            out.append(Sampler()(batch, rows)[position].token_id)
        return out

    alone = tokens_of_seeded_row(mine[None], 0, [make_row(**settings)])
    kinds: list[dict[str, object]] = [
        {"temperature": 1.3},
        {"temperature": 0.7, "top_p": 0.6},
        {"temperature": 0.0},
        {"temperature": 0.0, "repetition_penalty": 1.2, "output": [5, 6]},
        {"temperature": 5.0, "top_p": 0.99},  # flat: falls back to the whole vocabulary
        {"temperature": 1.0, "min_p": 0.1, "seed": 77},
        {"temperature": 0.9, "frequency_penalty": 1.0, "output": [1], "logprobs": 2},
    ]
    for position, num_others in [(0, 3), (3, 3), (7, 7), (2, 5)]:
        rows = [make_row(**kinds[i]) for i in range(num_others)]
        rows.insert(position, make_row(**settings))
        batch = torch.cat([others[:position], mine[None], others[position:num_others]])
        assert tokens_of_seeded_row(batch, position, rows) == alone


def test_a_rows_mass_does_not_depend_on_the_rows_beside_it() -> None:
    """Batch invariance of top-p's mass: a full-vocabulary row (here SmolLM2's 49,152 plus
    a ragged tail) sums to the same bits alone, among others, and padded with zeros (a wider
    window, chosen by another row's top-k)."""
    x = torch.rand(5, 49152 + 7, generator=torch.Generator().manual_seed(3))
    whole = row_sums(x)
    torch.testing.assert_close(whole, x.double().sum(dim=-1).float())
    for i in range(5):
        assert torch.equal(row_sums(x[i : i + 1]), whole[i : i + 1])
    assert torch.equal(row_sums(torch.nn.functional.pad(x, (0, 3000))), whole)


def test_two_seeded_rows_in_one_batch_match_running_alone_in_any_order() -> None:
    logits = torch.randn(2, 2000, generator=torch.Generator().manual_seed(10))

    def tokens(order: list[int]) -> dict[int, list[int]]:
        rows = {i: make_row(seed=100 + i, temperature=1.0, min_p=0.01) for i in order}
        out: dict[int, list[int]] = {i: [] for i in order}
        for _ in range(5):
            sampled = Sampler()(logits[order], [rows[i] for i in order])
            for i, t in zip(order, sampled, strict=True):
                out[i].append(t.token_id)
        return out

    assert tokens([0, 1]) == tokens([1, 0]) == {**tokens([0]), **tokens([1])}


def test_make_generator() -> None:
    assert make_generator(None) is None
    a, b = make_generator(3), make_generator(3)
    assert a is not None and b is not None
    assert torch.rand(4, generator=a).tolist() == torch.rand(4, generator=b).tolist()


# --- logprobs -----------------------------------------------------------------------------


def test_logprobs_are_the_raw_log_softmax_of_the_logits() -> None:
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(11)) * 2
    rows = [
        make_row(temperature=0.0, logprobs=5),
        # penalties, temperature and filters change the choice, never the reported logprobs
        make_row(temperature=0.5, top_k=3, seed=1, logprobs=3, output=[4], frequency_penalty=2.0),
        make_row(temperature=0.0, logprobs=0, repetition_penalty=1.3, prompt=[5, 6]),
    ]
    out = Sampler()(logits, rows)
    reference = torch.log_softmax(logits.double(), dim=-1)
    for i, token in enumerate(out):
        n = rows[i].params.logprobs
        assert token.logprob == pytest.approx(reference[i, token.token_id].item(), abs=1e-5)
        assert token.top_logprobs is not None and len(token.top_logprobs) == n
        expected = torch.topk(reference[i], n) if n else None
        if expected is not None:
            assert [t for t, _ in token.top_logprobs] == expected.indices.tolist()
            got = [lp for _, lp in token.top_logprobs]
            assert got == pytest.approx(expected.values.tolist(), abs=1e-5)
            assert got == sorted(got, reverse=True)
    assert out[0].top_logprobs is not None and out[0].top_logprobs[0][0] == out[0].token_id


def test_only_rows_that_ask_get_logprobs() -> None:
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(12))
    out = Sampler()(logits, [make_row(temperature=0.0), make_row(temperature=0.0, logprobs=2)])
    assert out[0] == SampledToken(int(logits[0].argmax()), None, None)
    assert out[1].logprob is not None and out[1].top_logprobs is not None


def test_logprobs_from_bfloat16_logits_are_computed_in_fp32() -> None:
    logits = (torch.randn(1, 50, generator=torch.Generator().manual_seed(13)) * 4).bfloat16()
    token = Sampler()(logits, [make_row(temperature=0.0, logprobs=1)])[0]
    expected = torch.log_softmax(logits.float(), dim=-1)[0, token.token_id].item()
    assert token.logprob == pytest.approx(expected, abs=1e-6)


# --- non-finite values from any source ------------------------------------------------------


def reference_penalized(
    logits: np.ndarray, prompt: list[int], output: list[int], params: SamplingParams
) -> np.ndarray:
    """HF / OpenAI penalties on one fp32 row, in numpy (overflow to inf included)."""
    x = logits.astype(np.float32).copy()
    with np.errstate(over="ignore", invalid="ignore"):
        for t in set(prompt) | set(output):
            r = np.float32(params.repetition_penalty)
            x[t] = x[t] / r if x[t] > 0 else x[t] * r
        for t in set(output):
            x[t] -= np.float32(params.frequency_penalty * output.count(t) + params.presence_penalty)
    return x


def test_a_repetition_penalty_near_zero_samples_uniformly_among_the_overflowed_tokens():
    """The attack of issue 27: positive logits of seen tokens / 1e-38 overflow to +inf; the
    sampler drew from NaN weights and indexed past its blocks. Now the row's distribution
    is the limit: uniform over the +inf tokens (numpy finds them independently)."""
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(1, 1000, generator=generator) * 3
    prompt = list(range(0, 60, 3))
    params = dict(repetition_penalty=1e-38, temperature=0.7)
    x = reference_penalized(logits[0].numpy(), prompt, [], SamplingParams(**params))
    support = set(np.flatnonzero(np.isposinf(x / np.float32(0.7))).tolist())
    assert 3 <= len(support) < len(prompt)
    n = 3000
    torch.manual_seed(0)
    rows = [make_row(prompt=prompt, **params) for _ in range(n)]
    draws = [t.token_id for t in Sampler()(logits.expand(n, -1), rows)]
    assert all(t.failure is None for t in Sampler()(logits, rows[:1]))
    counts = [draws.count(t) for t in sorted(support)]
    assert sum(counts) == n
    assert chi_square(counts, [1 / len(support)] * len(support)) < 3 * len(support) + 10
    greedy = Sampler()(logits, [make_row(prompt=prompt, repetition_penalty=1e-38, temperature=0)])
    assert greedy[0].token_id == min(support)  # ties go to the lowest id


def test_rows_with_a_nan_or_no_finite_logit_fail_alone_and_the_others_are_untouched():
    generator = torch.Generator().manual_seed(4)
    logits = torch.randn(5, 300, generator=generator)
    logits[1, 17] = math.nan
    logits[2] = -math.inf
    logits[4, 5] = math.nan  # a greedy row
    settings = [
        dict(temperature=0.9, seed=1, top_p=0.8),
        dict(temperature=0.9, seed=2),
        dict(temperature=0.0, repetition_penalty=1.3, output=[1]),
        dict(temperature=1.1, seed=3, top_k=20, logprobs=2),
        dict(temperature=0.0),
    ]
    batch = Sampler()(logits, [make_row(**s) for s in settings])
    assert [t.failure is not None for t in batch] == [False, True, True, False, True]
    assert "NaN" in batch[1].failure and "-inf" in batch[2].failure
    for i in (0, 3):
        alone = Sampler()(logits[i : i + 1], [make_row(**settings[i])])[0]
        assert (batch[i].token_id, batch[i].top_logprobs) == (alone.token_id, alone.top_logprobs)


@pytest.mark.parametrize("temperature", [1e-30, 1e-6, 0.0])
def test_tiny_temperatures_are_greedy_even_on_huge_logits(temperature: float) -> None:
    logits = torch.tensor([[1e38, -3e38, 2e38, 0.0, 3e38]])
    [token] = Sampler()(logits, [make_row(temperature=temperature)])
    assert (token.token_id, token.failure) == (int(np.argmax(logits.numpy()[0])), None)


def test_huge_logits_over_a_small_temperature_draw_among_those_that_overflow():
    logits = torch.tensor([[3e38, 1e30, 3.1e38, -3e38, 5.0, 2e-3]])
    temperature = 1e-3
    with np.errstate(over="ignore"):
        support = set(np.flatnonzero(np.isposinf(logits.numpy()[0] / np.float32(temperature))))
    assert support == {0, 2}
    torch.manual_seed(0)
    n = 400
    rows = [make_row(temperature=temperature, top_k=3, min_p=0.5) for _ in range(n)]
    draws = [t.token_id for t in Sampler()(logits.expand(n, -1), rows)]
    assert set(draws) == support


def test_logprobs_of_a_row_with_inf_logits_are_its_limit_and_never_nan():
    logits = torch.tensor([[1.0, math.inf, 2.0, math.inf, -math.inf]])
    [token] = Sampler()(logits, [make_row(temperature=0.0, logprobs=4)])
    assert token.token_id == 1
    assert token.logprob == pytest.approx(math.log(0.5))
    assert [t for t, _ in token.top_logprobs[:2]] == [1, 3]
    assert [lp for _, lp in token.top_logprobs] == pytest.approx(
        [math.log(0.5), math.log(0.5), LOGPROB_FLOOR, LOGPROB_FLOOR]
    )


def test_hostile_rows_never_break_the_sampler():
    """Random rows with NaN, +-inf and huge values under random in-bounds settings: never
    an exception; a row fails iff numpy finds a NaN or nothing above -inf in it; greedy rows
    pick numpy's argmax of the penalized row; sampled tokens are never banned ones."""
    rng = np.random.default_rng(27)
    vocab = 700
    for trial in range(20):
        n = int(rng.integers(1, 9))
        raw = rng.normal(0, 5, size=(n, vocab)).astype(np.float32)
        for i in range(n):
            kind = rng.integers(0, 6)
            where = rng.choice(vocab, size=int(rng.integers(1, 5)), replace=False)
            if kind == 1:
                raw[i, where] = np.nan
            elif kind == 2:
                raw[i, where] = np.inf
            elif kind == 3:
                raw[i] = -np.inf
            elif kind == 4:
                raw[i, where] = rng.choice([3e38, -3e38, 1e37])
        rows, settings = [], []
        for _ in range(n):
            params = SamplingParams(
                temperature=float(rng.choice([0.0, 1e-30, 1e-5, 0.5, 1.0, 2.0, 100.0])),
                top_k=int(rng.choice([0, 1, 5, vocab])),
                top_p=float(rng.choice([1.0, 0.5, 1e-6])),
                min_p=float(rng.choice([0.0, 0.3, 1.0])),
                repetition_penalty=float(rng.choice([1.0, 1e-38, 1e-6, 2.0])),
                presence_penalty=float(rng.choice([0.0, -2.0, 2.0])),
                frequency_penalty=float(rng.choice([0.0, -2.0, 2.0])),
                logprobs=int(rng.choice([0, 20])) if rng.random() < 0.3 else None,
                seed=int(rng.integers(0, 2**62)) if rng.random() < 0.5 else None,
            )
            prompt = rng.choice(vocab, size=6).tolist()
            output = rng.choice(vocab, size=int(rng.integers(0, 6))).tolist()
            settings.append((params, prompt, output))
            rows.append(SamplingRow(params, output, prompt, make_generator(params.seed)))
        tokens = Sampler()(torch.from_numpy(raw), rows)
        for i, token in enumerate(tokens):
            row = raw[i]
            unusable = bool(np.isnan(row).any()) or bool(np.isneginf(row).all())
            params, prompt, output = settings[i]
            penalized = reference_penalized(row, prompt, output, params)
            unusable |= not unusable and bool(np.isneginf(penalized).all())
            assert (token.failure is not None) == unusable, (trial, i)
            if unusable:
                continue
            assert 0 <= token.token_id < vocab
            assert penalized[token.token_id] > -np.inf, (trial, i)
            if params.temperature < 1e-5:
                assert token.token_id == int(np.argmax(penalized)), (trial, i)
            if token.top_logprobs is not None:
                assert all(math.isfinite(lp) for _, lp in token.top_logprobs)
                assert math.isfinite(token.logprob)
