"""switchboard_kernels.activation_native: the fused silu(gate) * up against torch's two ops,
bit for bit in bf16 (torch rounds after each op, and so does the kernel), closely in fp32,
on each compiled loop, odd widths, strided rows and the values where e^x under- or
overflows."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from switchboard_kernels import native
from switchboard_kernels.activation_native import NativeActivation, native_activation, silu_mul

EDGES = [0.0, -0.0, 1e-30, -1e-30, 88.0, -88.0, 100.0, -100.0, 3e38, -3e38, float("inf")]


def _reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _inputs(rows: int, dim: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 2 * dim, generator=gen) * 4
    x[0, : len(EDGES)] = torch.tensor(EDGES)  # gates
    x[0, dim : dim + len(EDGES)] = 1.5  # their ups
    return x.to(dtype)


@pytest.fixture(scope="module")
def kernel():
    built = native_activation()
    if built is None:
        pytest.skip("no C compiler here")
    return built


def _loops(kernel) -> list[bool]:
    return [False, True] if kernel.has_vector_loop else [True]  # portable only where no vector loop


@pytest.mark.parametrize("dim", [16, 37, 1536])
def test_bf16_equals_torch_bit_for_bit(kernel, dim):
    x = _inputs(33, dim, torch.bfloat16)
    want = _reference(x)
    for portable in _loops(kernel):
        got = kernel.silu_mul(x, portable=portable)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), portable


@pytest.mark.parametrize("dim", [16, 37, 1536])
def test_fp32_matches_torch(kernel, dim):
    x = _inputs(33, dim, torch.float32)
    want = _reference(x)
    for portable in _loops(kernel):
        got = kernel.silu_mul(x, portable=portable)
        finite = want.isfinite()
        assert torch.equal(got.isfinite(), finite)
        torch.testing.assert_close(got[finite], want[finite], rtol=2e-6, atol=1e-30)


def test_rows_with_a_stride_and_the_dispatch(kernel):
    wide = _inputs(9, 40, torch.bfloat16, seed=3)
    rows = wide[:, :64]  # 9 rows of 2 x 32, each 80 elements apart
    assert rows.stride(0) == 80
    want = _reference(rows)
    for portable in _loops(kernel):
        assert torch.equal(kernel.silu_mul(rows, portable=portable), want)
    assert torch.equal(silu_mul(rows), want)
    batch = _inputs(6, 24, torch.bfloat16).view(2, 3, 48)  # not rows: torch's ops
    assert torch.equal(silu_mul(batch), _reference(batch))


def test_what_the_kernel_cannot_take_is_refused(kernel):
    with pytest.raises(ValueError):
        kernel.silu_mul(torch.zeros(2, 5))  # odd width
    with pytest.raises(ValueError):
        kernel.silu_mul(torch.zeros(2, 6, dtype=torch.float16))
    with pytest.raises(ValueError):
        kernel.silu_mul(torch.zeros(6, 2).t())  # columns not contiguous


def test_the_avx512_loop_without_avx512_bf16_rounds_as_torch(kernel):
    """On an AVX-512 CPU without BF16 instructions (a Xeon before Cooper Lake) the rounding
    to bf16 is done by hand (bf16.h's pack_bf16): built here with those instructions off."""
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if "avx512_bf16" not in flags.split():
        pytest.skip("without avx512_bf16 every other test here already runs this loop")
    source = Path(native.__file__).with_name("activation_cpu.c")
    built = NativeActivation(ctypes.CDLL(str(native.build(source, ("-mno-avx512bf16",)))))
    x = _inputs(33, 1536, torch.bfloat16, seed=5)
    want = _reference(x)
    assert torch.equal(built.silu_mul(x).view(torch.int16), want.view(torch.int16))


def test_the_avx2_loop_rounds_as_torch(kernel):
    """The AVX2 loop (CPUs without AVX-512: Zen 3 and older): on an AVX-512 CPU, built here
    with AVX-512 off; elsewhere every other test here already runs it."""
    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    if "avx512f" not in flags:
        pytest.skip("without AVX-512 every other test here already runs the AVX2 loop")
    source = Path(native.__file__).with_name("activation_cpu.c")
    built = NativeActivation(ctypes.CDLL(str(native.build(source, ("-mno-avx512f",)))))
    assert built.has_vector_loop and not built.has_avx512
    x = _inputs(33, 1536, torch.bfloat16, seed=5)
    want = _reference(x)
    assert torch.equal(built.silu_mul(x).view(torch.int16), want.view(torch.int16))
    x = _inputs(33, 1536, torch.float32, seed=5)
    got, want = built.silu_mul(x), _reference(x)
    finite = want.isfinite()
    assert torch.equal(got.isfinite(), finite)
    torch.testing.assert_close(got[finite], want[finite], rtol=2e-6, atol=1e-30)
