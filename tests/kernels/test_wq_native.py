"""switchboard_kernels/wq_cpu.c: a quantized base's projections, every compiled loop (AVX-512,
AVX2, portable) against the torch reference (``QuantizedReference``: the weight dequantized to
fp32, the rows unrounded) over odd shapes, 1..N rows, both bit widths, group sizes, symmetric and
not, act-order, bias, residual and fp32 out."""

from __future__ import annotations

import pytest
import torch

from switchboard_kernels.quantized_linear import QuantizedReference
from switchboard_kernels.quantized_weight import QuantizedWeight, quantize
from switchboard_kernels.wq_native import WqLinear, WqPath, fits, native_wq

pytestmark = pytest.mark.skipif(native_wq() is None, reason="no C compiler here")

PATHS = {WqPath.BEST: "best", WqPath.AVX2: "avx2", WqPath.PORTABLE: "portable"}


def compiled_paths() -> list[int]:
    return native_wq().paths if native_wq() is not None else []


def weight(out_features: int, in_features: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(out_features, in_features, generator=gen) / in_features**0.5


def act_order(q: QuantizedWeight, seed: int) -> QuantizedWeight:
    order = torch.randperm(q.shape[1], generator=torch.Generator().manual_seed(seed))
    return QuantizedWeight(q.levels, q.scales, q.zeros, q.bits, q.group_size, order)


def fp16_params(q: QuantizedWeight) -> QuantizedWeight:
    """``q`` with its scales and zeros rounded to fp16 values: the kernel holds them in 2 bytes."""
    scales, zeros = q.scales.half().float(), q.zeros.half().float()
    return QuantizedWeight(q.levels, scales, zeros, q.bits, q.group_size, q.input_order)


def check(q, bias, x, residual, fp32_out, path):
    got = WqLinear(q, bias, fp32_out=fp32_out)(x, residual, path=path)
    want = QuantizedReference(q, bias, fp32_out=fp32_out)(x, residual)
    assert got.dtype == want.dtype and got.shape == want.shape
    # fp32 sums in another order, the zero's share subtracted per group (sum q x - z sum x):
    # within a few fp32 ulps of the largest partial sum, sum |x| |q| s; bf16 rows multiply
    # levels offset by up to 128 + 16 * 128 (wq_cpu.c's VDPBF16PS loop), which the zero takes
    # back; bf16 outputs may round a half-ulp apart
    offset = 2304.0 if x.dtype == torch.bfloat16 else 0.0
    partial = x.float().abs() @ ((q.levels.float() + offset) * q.scales.max()).T
    atol = 4e-7 * float(partial.max())
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=atol, rtol=1e-5)
    else:
        torch.testing.assert_close(got.float(), want.float(), atol=atol + 8e-3, rtol=8e-3)


@pytest.mark.parametrize("path", [p for p in PATHS if p in compiled_paths()], ids=PATHS.get)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128, None], ids=lambda g: f"g{g or 'channel'}")
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("half", [False, True], ids=["fp32-params", "fp16-params"])
def test_every_loop_matches_the_reference(path, bits, group, symmetric, half):
    # one row, a tile and what is left of it, a partial last panel
    for rows, out_features, in_features in [(1, 16, 128), (3, 33, 256), (11, 50, 384)]:
        seed = rows * 7 + bits + (group or 0)
        w = weight(out_features, in_features, seed)
        q = quantize(w, bits=bits, group_size=group or in_features, symmetric=symmetric)
        if half:
            q = fp16_params(q)
        # the layout follows the values: 2-byte scales and zeros only where all are fp16 values
        assert WqLinear(q)._desc.half_params == half
        gen = torch.Generator().manual_seed(seed + 1)
        bias = torch.randn(out_features, generator=gen)
        x = 3 * torch.randn(rows, in_features, generator=gen)
        res = torch.randn(rows, out_features, generator=gen)
        check(q, None, x, None, False, path)
        check(q, bias, x, res, False, path)
        check(q, bias, x.bfloat16(), res.bfloat16(), False, path)
        check(q, None, x.bfloat16(), res, True, path)  # an output layer's fp32 logits
        check(act_order(q, seed), bias, x, None, False, path)


@pytest.mark.parametrize("rows", [1, 2, 4, 5, 8, 9, 17, 40])
def test_every_row_count_of_a_call(rows):
    """Tiles of 8 (4 on AVX2) rows and what is left of them; a row's result does not depend
    on the others (up to the summation order of its tile)."""
    q = quantize(weight(40, 192, rows), bits=4, group_size=64, symmetric=False)
    x = torch.randn(rows, 192, generator=torch.Generator().manual_seed(rows))
    for path in compiled_paths():
        check(q, None, x, None, False, path)
    one = WqLinear(q)
    together = one(x)
    alone = torch.cat([one(x[i : i + 1]) for i in range(rows)])
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-5)  # chains differ by tile


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, None], ids=lambda g: f"g{g or 'channel'}")
@pytest.mark.parametrize("rows", [16, 21, 40])
@pytest.mark.parametrize("out_features", [64, 40], ids=["4-panels", "3-panels"])
def test_bf16_calls_of_many_rows_unpack_the_levels_once(bits, group, rows, out_features):
    """bf16 rows, 16 and more (8-bit: 8): each pair of panels unpacked once a call, tiles of up
    to 8 rows (an odd last panel beside zeros) against the reference with bias, residual and
    fp32 out; 4-bit rows carry the bits of the same rows called 8 at a time (the loop that
    unpacks a step's levels per tile, one panel at a time: the same sums in the same order)."""
    q = quantize(
        weight(out_features, 192, rows), bits=bits, group_size=group or 192, symmetric=False
    )
    q = fp16_params(q) if bits == 4 else q
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 192, generator=gen).bfloat16()
    bias = torch.randn(out_features, generator=gen)
    res = torch.randn(rows, out_features, generator=gen)
    check(q, bias, x, res.bfloat16(), False, WqPath.BEST)
    check(q, None, x, res, True, WqPath.BEST)
    if bits == 4:
        linear = WqLinear(q, bias)
        together = linear(x)
        for m0 in range(0, rows - 7, 8):
            assert torch.equal(together[m0 : m0 + 8], linear(x[m0 : m0 + 8])), m0


def test_the_layout_holds_whole_steps_only():
    q = quantize(weight(16, 36, 0), bits=8, group_size=12, symmetric=True)
    assert fits(q)
    check(q, None, torch.randn(2, 36), None, False, WqPath.BEST)
    q4 = quantize(weight(16, 36, 0), bits=4, group_size=12, symmetric=True)
    assert not fits(q4)
    with pytest.raises(ValueError, match="do not fit"):
        WqLinear(q4)


def test_bad_rows_are_refused_by_name():
    linear = WqLinear(quantize(weight(16, 64, 0), bits=4, group_size=32, symmetric=False))
    with pytest.raises(ValueError, match="native quantized linear"):
        linear(torch.randn(2, 63))
    with pytest.raises(ValueError, match="residual"):
        linear(torch.randn(2, 64), torch.randn(3, 16))
