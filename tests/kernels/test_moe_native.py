"""The native grouped experts (switchboard_kernels/moe_*_cpu.c) against float64 references over
skewed routings (every token to one expert, experts with no tokens, top-1/2/8, one token), in
bf16 and fp32, on each path this CPU can build, and with int8 panels."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from switchboard_kernels.linear import Linear
from switchboard_kernels.linear_choice import ONEDNN, PANELS, LinearPlan
from switchboard_kernels.moe_native import GroupedExperts, grouped_kernel

E, HIDDEN, INTER = 8, 64, 40  # 2 * INTER = 80: a partial last panel in both layouts
PANEL_PLAN = LinearPlan(PANELS, PANELS)
OTHER_PATHS = {  # as in test_linear_bf16_native.py: (flags, the CPU flag the path lacks)
    "avx512-fma": (("-mno-avx512bf16",), "avx512_bf16"),
    "avx2": (("-mno-avx512f",), "avx512f"),
}


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as info:
        return {f for line in info if line.startswith("flags") for f in line.split()}


def needs(dtype):
    return pytest.mark.skipif(
        grouped_kernel(dtype) is None, reason=f"no native grouped-experts kernel for {dtype}"
    )


def experts(dtype, seed=0, *, quantization=None, plan=PANEL_PLAN):
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(E, 2 * INTER, HIDDEN, generator=g) / HIDDEN**0.5).to(dtype)
    down = (torch.randn(E, HIDDEN, INTER, generator=g) / INTER**0.5).to(dtype)

    def linear(w):
        return Linear(w, plan=plan, quantization=quantization)

    return [linear(w) for w in gate_up], [linear(w) for w in down], gate_up, down


def routing(tokens, top_k, skew, seed=1):
    """[tokens, top_k] distinct experts per token and positive weights; ``skew``: every
    token's first expert (the others drawn from the rest), or None for uniform draws."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(tokens):
        order = torch.randperm(E, generator=g)
        if skew is not None:
            order = torch.cat([torch.tensor([skew]), order[order != skew]])
        rows.append(order[:top_k])
    ids = torch.stack(rows) if rows else torch.empty(0, top_k, dtype=torch.int64)
    weights = torch.rand(tokens, top_k, generator=g) + 0.05
    return ids, weights / weights.sum(-1, keepdim=True)


def reference(x, gate_up, down, ids, weights, *, rounded):
    """Each token alone in float64; ``rounded``: rounded to x's dtype where the kernel rounds
    (each product, silu, the activation, the scaled pair, each partial sum), experts added in
    ascending order."""
    dtype = x.dtype

    def r(t):
        return t.to(dtype).double() if rounded else t

    x, gate_up, down = x.double(), gate_up.double(), down.double()
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in torch.argsort(ids[t]).tolist():
            e = int(ids[t, j])
            gate, up = r(gate_up[e] @ x[t]).chunk(2)
            y = r(down[e] @ r(r(F.silu(gate)) * up))
            out[t] = r(out[t] + r(y * float(weights[t, j])))
    return out


def check(got, x, gate_up, down, ids, weights):
    """Within a few roundings of the float64 product rounded where the kernel rounds, and
    close to the unrounded one (bf16: each rounding is 2^-9 relative)."""
    scale = float(x.double().abs().max()) or 1.0
    if x.dtype == torch.float32:
        want = reference(x, gate_up, down, ids, weights, rounded=False)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * scale)
        return
    want = reference(x, gate_up, down, ids, weights, rounded=True)  # equal here, mostly
    torch.testing.assert_close(got.double(), want, rtol=2**-7, atol=1e-4 * scale)
    exact = reference(x, gate_up, down, ids, weights, rounded=False)
    torch.testing.assert_close(got.double(), exact, rtol=2**-5, atol=2e-2 * scale)


CASES = [
    # (tokens, top_k, skew)
    (1, 2, None),  # a batch-1 decode step
    (17, 2, None),  # Mixtral-style, uneven counts
    (9, 1, 3),  # every token to expert 3: the other seven get none
    (12, 2, 5),  # every token to expert 5 and one other
    (6, 8, None),  # top-8 of 8: every expert gets every token
    (20, 1, None),  # top-1 over more tokens than a tile
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("tokens", "top_k", "skew"), CASES)
def test_matches_a_float64_loop_over_skewed_routings(dtype, tokens, top_k, skew):
    if grouped_kernel(dtype) is None:
        pytest.skip(f"no native grouped-experts kernel for {dtype}")
    gu, dn, gate_up, down = experts(dtype)
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens)).to(dtype)
    ids, weights = routing(tokens, top_k, skew)
    got = GroupedExperts(gu, dn)(x, ids, weights)
    assert got.dtype == dtype and got.shape == x.shape
    check(got, x, gate_up, down, ids, weights)
    if skew is not None:  # the skew happened: experts left without rows
        assert len(set(ids.flatten().tolist())) < E


@pytest.mark.parametrize("path", OTHER_PATHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_paths_of_cpus_with_fewer_features(path, dtype):
    """A build without the features above another path's runs that path here, over the same
    panels (AVX-512 without BF16; AVX2 and FMA only: the plain activation loop too)."""
    flags, feature = OTHER_PATHS[path]
    if feature not in _cpu_flags() or grouped_kernel(dtype) is None:
        pytest.skip(f"without {feature} every other test here already runs this path")
    kernel = grouped_kernel(dtype, flags)
    assert kernel is not None
    gu, dn, gate_up, down = experts(dtype, seed=2)
    for tokens, top_k, skew in CASES:
        x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(7)).to(dtype)
        ids, weights = routing(tokens, top_k, skew, seed=3)
        got = GroupedExperts(gu, dn, kernel=kernel)(x, ids, weights)
        check(got, x, gate_up, down, ids, weights)


@needs(torch.float32)
def test_int8_panels_give_what_the_per_expert_projections_give():
    """A draft model's int8 experts: the kernel multiplies by the same approximate copy as
    each expert's own projection does."""
    gu, dn, _, _ = experts(torch.float32, quantization="int8")
    x = torch.randn(7, HIDDEN, generator=torch.Generator().manual_seed(4))
    ids, weights = routing(7, 2, None)
    got = GroupedExperts(gu, dn)(x, ids, weights)
    want = torch.zeros(7, HIDDEN, dtype=torch.float64)
    for t in range(7):
        for j in torch.argsort(ids[t]).tolist():
            e = int(ids[t, j])
            gate, up = gu[e](x[t : t + 1]).chunk(2, dim=-1)
            want[t] += float(weights[t, j]) * dn[e](F.silu(gate) * up)[0].double()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@needs(torch.bfloat16)
def test_no_rows_and_bad_routing_are_refused_or_empty():
    gu, dn, _, _ = experts(torch.bfloat16)
    grouped = GroupedExperts(gu, dn)
    empty = torch.empty(0, HIDDEN, dtype=torch.bfloat16)
    assert grouped(empty, torch.empty(0, 2, dtype=torch.int64), torch.empty(0, 2)).shape == (
        0,
        HIDDEN,
    )
    x = torch.randn(2, HIDDEN).bfloat16()
    with pytest.raises(ValueError, match="out of range"):
        grouped(x, torch.tensor([[0, E], [1, 2]]), torch.ones(2, 2))
    with pytest.raises(ValueError, match="out of range"):
        grouped(x, torch.tensor([[0, -1], [1, 2]]), torch.ones(2, 2))
    with pytest.raises(ValueError, match="CPU rows"):
        grouped(x.float(), torch.tensor([[0, 1], [1, 2]]), torch.ones(2, 2))
    with pytest.raises(ValueError, match="CPU rows"):
        grouped(x, torch.tensor([[0, 1]]), torch.ones(1, 2))


@needs(torch.bfloat16)
def test_served_only_where_every_expert_is_in_panels_and_within_their_rows():
    """oneDNN experts: no kernel. A plan whose panels take up to 4 rows: a step is served
    only while no expert gets more (the others go through each expert's projections)."""
    w = torch.randn(E, 2 * INTER, HIDDEN).bfloat16()
    d = torch.randn(E, HIDDEN, INTER).bfloat16()
    onednn = LinearPlan(ONEDNN, ONEDNN)
    if GroupedExperts.of([Linear(x, plan=onednn) for x in w], [Linear(x) for x in d]):
        pytest.fail("experts multiplied through oneDNN have no panels to read")
    split = LinearPlan(PANELS, ONEDNN, 4)
    grouped = GroupedExperts.of(
        [Linear(x, plan=split) for x in w], [Linear(x, plan=split) for x in d]
    )
    assert grouped is not None and grouped.max_rows == 4
    x = torch.randn(6, HIDDEN).bfloat16()
    spread = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7], [0, 1], [2, 3]])
    assert grouped.serves(x, spread)
    assert not grouped.serves(x, torch.zeros(6, 1, dtype=torch.int64) + 3)
    assert not grouped.serves(x.float(), spread)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fixed_order_panels_give_a_token_the_bits_it_has_among_others(dtype):
    """``batch_invariant``'s panels (``fixed_order``): a token's output does not depend on the
    other tokens of the step, whether its experts get 1 row or a tile's worth."""
    if grouped_kernel(dtype) is None:
        pytest.skip(f"no native grouped-experts kernel for {dtype}")
    gu, dn, _, _ = experts(dtype, seed=6, plan=LinearPlan(PANELS, PANELS, fixed_order=True))
    grouped = GroupedExperts(gu, dn)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(19, HIDDEN, generator=g).to(dtype)
    ids, weights = routing(19, 2, 4, seed=8)  # expert 4 gets all 19 rows
    whole = grouped(x, ids, weights)
    for t in (0, 7, 18):
        alone = grouped(x[t : t + 1], ids[t : t + 1], weights[t : t + 1])
        assert torch.equal(alone, whole[t : t + 1]), t
