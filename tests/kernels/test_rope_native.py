"""The native RoPE (switchboard_kernels/rope_cpu.c) against the torch path's ``apply_rope``,
bit for bit: the model's forward pass takes either."""

from __future__ import annotations

import pytest
import torch

from switchboard_kernels.rope_native import native_rope
from worker.model.rope import RopeTables, apply_rope

KERNEL = native_rope()
pytestmark = pytest.mark.skipif(KERNEL is None, reason="no C compiler: kernel not built")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize(("heads", "head_dim"), [(12, 64), (5, 128), (3, 10)])
def test_rotates_the_leading_heads_in_place_as_apply_rope(dtype, rows, heads, head_dim):
    """Fused rows [q heads | k heads | v]: the leading heads turn, the rest stay; large
    values, so that the bf16 roundings of the product and the sum both matter."""
    tables = RopeTables.build(head_dim, {"rope_theta": 10000.0}, 2048, dtype)
    gen = torch.Generator().manual_seed(rows + heads)
    fused = (torch.randn(rows, (heads + 2) * head_dim, generator=gen) * 30).to(dtype)
    positions = torch.randint(0, 2048, (rows,), generator=gen)
    cos, sin = tables.lookup(positions)
    width = heads * head_dim
    want = apply_rope(fused[:, :width].view(rows, heads, head_dim), cos, sin)
    got = fused.clone()
    KERNEL.rotate_(got, heads, head_dim, positions, tables.cos, tables.signed_sin)
    assert torch.equal(got[:, :width].view(rows, heads, head_dim), want)
    assert torch.equal(got[:, width:], fused[:, width:])


def test_positions_outside_the_tables_and_wrong_shapes_are_refused():
    tables = RopeTables.build(64, {}, 16, torch.float32)
    x = torch.zeros(2, 128)
    with pytest.raises(ValueError, match="outside the tables"):
        KERNEL.rotate_(x, 2, 64, torch.tensor([3, 16]), tables.cos, tables.signed_sin)
    with pytest.raises(ValueError, match="outside the tables"):
        KERNEL.rotate_(x, 2, 64, torch.tensor([-1, 0]), tables.cos, tables.signed_sin)
    with pytest.raises(ValueError, match="native rope"):
        KERNEL.rotate_(x, 3, 64, torch.tensor([0, 1]), tables.cos, tables.signed_sin)
    with pytest.raises(ValueError, match="native rope"):
        KERNEL.rotate_(x.bfloat16(), 2, 64, torch.tensor([0, 1]), tables.cos, tables.signed_sin)
