"""The native CPU multi-LoRA kernel (switchboard_kernels/lora_cpu.c) against a float64 loop.

Both of its inner loops run here for bf16: the AVX-512 one (where this CPU has it) and the
portable C one; fp32 always takes the portable one. Shapes are the kernel-test shapes of
lora_factories.py: 80 inputs and 72 outputs, neither a multiple of 16, so the vector
loops' tails and the tiles' padding are exercised.
"""

from __future__ import annotations

import pytest
import torch

from lora_factories import (
    IN_FEATURES,
    OUT_FEATURES,
    PATTERNS,
    RANKS,
    assert_close,
    assert_untouched,
    loop_lora,
    make_batch,
    make_inputs,
    make_stacks,
)
from switchboard_kernels.lora import LoraMapping, NativeSlots, add_lora
from switchboard_kernels.lora_native import NativeGroups, native_library

LIBRARY = native_library()
pytestmark = pytest.mark.skipif(LIBRARY is None, reason="no C compiler: kernel not built")
BF16 = torch.bfloat16
# (dtype, portable loops forced): the AVX-512 loops (if built) and the plain-C ones
VARIANTS = {
    "bf16-vector": (BF16, False),
    "bf16-portable": (BF16, True),
    "fp32": (torch.float32, False),
}


def native_slots(a: torch.Tensor, b: torch.Tensor, blocks=((0, OUT_FEATURES),)) -> NativeSlots:
    slots = NativeSlots(a.shape[0], a.shape[2], blocks, a.dtype)
    for slot in range(a.shape[0]):
        slots.refresh(slot, a[slot], b[slot])
    return slots


def groups_of(token_slots: torch.Tensor) -> NativeGroups:
    return NativeGroups.from_runs([(t, t + 1, s) for t, s in enumerate(token_slots.tolist())])


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize(("rank", "max_rank"), RANKS)
@pytest.mark.parametrize(("num_tokens", "decode"), [(1, True), (9, True), (17, False), (70, False)])
def test_kernel_matches_a_per_token_loop(num_tokens, decode, rank, max_rank, pattern, variant):
    """Groups of 1 to 70 tokens (several token blocks of 8), ranks 1 to 64, base rows."""
    dtype, portable = VARIANTS[variant]
    batch = make_batch(pattern, num_tokens=num_tokens, decode=decode)
    slots = batch.token_slots
    a, b, scales = make_stacks(rank, max_rank, dtype=dtype)
    x, y = make_inputs(num_tokens, dtype=dtype, extra_cols=7)
    _, want = loop_lora(y, x, a, b, scales, slots, rank=rank, out_offset=4)
    got = y.clone()
    LIBRARY.bgmv(got, x, native_slots(a, b), scales, groups_of(slots), 4, portable=portable)
    assert_close(got, want, dtype)
    assert_untouched(got, y, slots, out_offset=4)


@pytest.mark.parametrize("variant", VARIANTS)
def test_fused_group_keeps_each_projections_block(variant):
    """Three projections sharing x (as q/k/v): A rows m*R.. and B's diagonal block m belong
    to projection m; slot 1 lacks the middle one, slot 2 has only it, slot 3 is empty."""
    max_rank, blocks = 8, ((0, 32), (32, 48), (48, 72))
    gen = torch.Generator().manual_seed(3)
    a = torch.zeros(4, 3 * max_rank, IN_FEATURES)
    b = torch.zeros(4, OUT_FEATURES, 3 * max_rank)
    ranks = {0: (8, 3, 5), 1: (2, 0, 8), 2: (0, 6, 0), 3: (0, 0, 0)}
    for slot, per_module in ranks.items():
        for m, ((lo, hi), r) in enumerate(zip(blocks, per_module, strict=True)):
            cols = slice(m * max_rank, m * max_rank + r)
            a[slot, cols] = torch.randn(r, IN_FEATURES, generator=gen) / 9
            b[slot, lo:hi, cols] = torch.randn(hi - lo, r, generator=gen) / 3
    dtype, portable = VARIANTS[variant]
    a, b = a.to(dtype), b.to(dtype)
    scales = torch.tensor([1.0, 0.5, 2.0, 1.0])
    table = native_slots(a, b, blocks)
    assert table.table[:, 1].tolist() == [16, 10, 6, 0]  # rank rows kept per slot
    assert table.table[:, 2].tolist() == [3, 2, 1, 0]  # projections with weights
    slots = torch.tensor([2, 0, 3, 1, -1, 0, 2])
    x, y = make_inputs(len(slots), dtype=dtype)
    _, want = loop_lora(y, x, a, b, scales, slots, rank=3 * max_rank)
    got = y.clone()
    LIBRARY.bgmv(got, x, table, scales, groups_of(slots), portable=portable)
    assert_close(got, want, dtype)
    assert torch.equal(got[2], y[2]) and torch.equal(got[4], y[4])  # empty slot, no adapter


def test_rows_may_be_strided_views():
    """x and y as column windows of wider buffers (the fused projection outputs are)."""
    a, b, scales = make_stacks(8, 16, dtype=BF16)
    wide_x = torch.randn(5, IN_FEATURES + 11).to(BF16)
    x = wide_x[:, 6 : 6 + IN_FEATURES]
    slots = torch.tensor([1, 3, 3, -1, 0])
    _, y = make_inputs(5, dtype=BF16, extra_cols=20)
    _, want = loop_lora(y, x, a, b, scales, slots, rank=8, out_offset=13)
    got = y.clone()
    LIBRARY.bgmv(got, x, native_slots(a, b), scales, groups_of(slots), 13)
    assert_close(got, want, BF16)
    assert_untouched(got, y, slots, out_offset=13)


def test_refilled_slot_points_at_its_new_weights():
    a, b, scales = make_stacks(8, 16, dtype=BF16)
    table = native_slots(a, b)
    a2, b2, _ = make_stacks(4, 16, dtype=BF16, seed=7)
    table.refresh(1, a2[1], b2[1])  # slot 1 now holds another adapter of rank 4
    a[1], b[1] = a2[1], b2[1]
    slots = torch.tensor([1, 0, 1])
    x, y = make_inputs(3, dtype=BF16)
    _, want = loop_lora(y, x, a, b, scales, slots, rank=8)
    got = y.clone()
    LIBRARY.bgmv(got, x, table, scales, groups_of(slots))
    assert table.table[1, 1].item() == 4
    assert_close(got, want, BF16)


@pytest.mark.parametrize("pattern", ["distinct", "zipf", "with_base"])
def test_dispatch_takes_the_kernel_for_a_native_mapping(pattern):
    batch = make_batch(pattern, num_tokens=40, decode=False)
    a, b, scales = make_stacks(16, 16, dtype=BF16)
    x, y = make_inputs(batch.num_tokens, dtype=BF16, extra_cols=3)
    _, want = loop_lora(y, x, a, b, scales, batch.token_slots, rank=16, out_offset=3)
    mapping = LoraMapping.build(batch.token_slots, native=True)
    assert mapping.cpu.native is not None and mapping.cpu.segments == []
    # Runs of one slot anywhere in the batch join one group: its weights are read once.
    assert mapping.cpu.native.num_groups == len(set(batch.token_slots.tolist()) - {-1})
    got = y.clone()
    add_lora(got, x, a, b, scales, mapping, out_offset=3, native=native_slots(a, b))
    assert_close(got, want, BF16)
    with pytest.raises(ValueError, match="needs NativeSlots"):
        add_lora(got, x, a, b, scales, mapping, out_offset=3)


def test_kernel_refuses_what_would_read_or_write_out_of_bounds():
    a, b, scales = make_stacks(8, 16, dtype=BF16)
    slots = native_slots(a, b)
    x, y = make_inputs(2, dtype=BF16)
    two = groups_of(torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="the slots' dtype"):
        LIBRARY.bgmv(y.float(), x.float(), slots, scales, two)  # bf16 weights read as fp32
    with pytest.raises(ValueError, match="the slots' dtype"):
        LIBRARY.bgmv(y.float(), x, slots, scales, two)  # y in fp32: written as bf16
    with pytest.raises(ValueError, match="the kernel takes"):
        NativeSlots(2, IN_FEATURES, ((0, OUT_FEATURES),), torch.float16)
    with pytest.raises(ValueError, match="float32"):
        LIBRARY.bgmv(y, x, slots, scales.double(), two)
    bad = {
        "slot past the table": (y, x, groups_of(torch.tensor([0, 4]))),
        "row past the batch": (y[:1], x[:1], two),
        "wrong input width": (y, x[:, :-1], two),
        "columns past y": (y[:, :-1], x, two),
    }
    for y_, x_, groups in bad.values():
        with pytest.raises(ValueError, match="do not fit together"):
            LIBRARY.bgmv(y_, x_, slots, scales, groups)
