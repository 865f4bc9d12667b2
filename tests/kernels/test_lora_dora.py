"""DoRA's rescale in the batched LoRA path: the torch reference against a float64 per-token
loop, and the Triton kernel (interpreter on CPU), the native C kernel and the CPU torch path
against it, over Punica's adapter mixes with rows of plain-LoRA slots and rows without an
adapter (which must keep their bits), with no base, a bias, or a residual left unscaled.
The set-up of ``TRITON_INTERPRET`` is ``test_lora_kernels.py``'s (see its docstring)."""

import os

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import triton.language as tl  # noqa: E402

import switchboard_kernels.lora_reference as ref  # noqa: E402
import switchboard_kernels.lora_triton as tri  # noqa: E402
from lora_factories import (  # noqa: E402
    NUM_SLOTS,
    OUT_FEATURES,
    PATTERNS,
    assert_close,
    loop_lora,
    make_batch,
    make_inputs,
    make_stacks,
)
from switchboard_kernels import lora_native  # noqa: E402
from switchboard_kernels.lora import DoraScales, LoraMapping, add_lora  # noqa: E402
from switchboard_kernels.lora_dora import dora_slot_rows  # noqa: E402
from switchboard_kernels.lora_native import NativeGroups, NativeSlots  # noqa: E402

TRITON_HERE = CUDA or (
    type(tl.zeros).__name__ == "InterpretedFunction"
    and type(tri._dora_rescale_kernel).__name__ == "InterpretedFunction"
)
triton_here = pytest.mark.skipif(
    not TRITON_HERE, reason="triton imported without TRITON_INTERPRET=1; run in a fresh process"
)
ROOT = Path(__file__).resolve().parents[2]
DEVICE = "cuda" if CUDA else "cpu"
LIBRARY = lora_native.native_library()
native_here = pytest.mark.skipif(LIBRARY is None, reason="no C compiler: kernel not built")
BASES = ["none", "bias", "residual"]
ENABLED = [1, 0, 1, 1]  # slot 1 holds a plain LoRA adapter: its rows are not rescaled
EXTRA = 5  # columns of y past the group's output: never touched


def make_dora(*, seed: int = 2) -> DoraScales:
    gen = torch.Generator().manual_seed(seed)
    dora = DoraScales.allocate(NUM_SLOTS, OUT_FEATURES, torch.device("cpu"))
    for slot, on in enumerate(ENABLED):
        scale = 0.5 + torch.rand(OUT_FEATURES, generator=gen)
        dora.set(slot, scale if on else None)
    return dora


def make_base(kind: str, num_tokens: int, dtype: torch.dtype) -> torch.Tensor | None:
    gen = torch.Generator().manual_seed(3)
    if kind == "none":
        return None
    shape = (OUT_FEATURES,) if kind == "bias" else (num_tokens, OUT_FEATURES)
    return torch.randn(shape, generator=gen).to(dtype)


def loop_dora(y, dora: DoraScales, token_slots, base) -> torch.Tensor:
    """The independent oracle: a float64 loop, z + g * (y - z) per DoRA row."""
    out = y.double().clone()
    for t, s in enumerate(token_slots.tolist()):
        if s >= 0 and dora.host[s]:
            z = 0.0 if base is None else (base if base.dim() == 1 else base[t]).double()
            g = dora.scales[s].double()
            out[t, :OUT_FEATURES] = z + g * (out[t, :OUT_FEATURES] - z)
    return out


def assert_only_dora_rows_changed(got, y, token_slots, dora) -> None:
    """Rows of plain-LoRA slots or without an adapter, and columns past the output, keep
    their bits."""
    for t, s in enumerate(token_slots.tolist()):
        if s < 0 or not dora.host[s]:
            assert torch.equal(got[t], y[t]), t
    assert torch.equal(got[:, OUT_FEATURES:], y[:, OUT_FEATURES:])


def cases():
    for pattern in PATTERNS:
        for num_tokens, decode in [(1, True), (9, True), (17, False)]:
            yield pytest.param(pattern, num_tokens, decode, id=f"{pattern}-{num_tokens}")


@pytest.mark.parametrize("kind", BASES)
@pytest.mark.parametrize(("pattern", "num_tokens", "decode"), cases())
def test_reference_matches_a_per_token_loop(pattern, num_tokens, decode, kind):
    slots = make_batch(pattern, num_tokens=num_tokens, decode=decode).token_slots
    dora = make_dora()
    _, y = make_inputs(num_tokens, extra_cols=EXTRA)
    base = make_base(kind, num_tokens, y.dtype)
    got = y.clone()
    ref.dora_rescale(got, dora.scales, dora.enabled, slots, base=base)
    assert_close(got, loop_dora(y, dora, slots, base), torch.float32)
    assert_only_dora_rows_changed(got, y, slots, dora)


@triton_here
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, *([torch.bfloat16] if CUDA else [])]
)
@pytest.mark.parametrize("kind", BASES)
@pytest.mark.parametrize(("pattern", "num_tokens", "decode"), cases())
def test_triton_dora_matches_the_reference(pattern, num_tokens, decode, kind, dtype):
    slots = make_batch(pattern, num_tokens=num_tokens, decode=decode).token_slots
    dora = make_dora()
    _, y = make_inputs(num_tokens, dtype=dtype, extra_cols=EXTRA)
    base = make_base(kind, num_tokens, dtype)
    want = y.clone()
    ref.dora_rescale(want, dora.scales, dora.enabled, slots, base=base)
    on = {"device": DEVICE}
    got = y.to(**on)
    tri.dora_rescale(
        got, dora.scales.to(**on), dora.enabled.to(**on), slots.to(**on),
        base=None if base is None else base.to(**on),
    )  # fmt: skip
    assert_close(got.cpu(), want, dtype)
    assert_only_dora_rows_changed(got.cpu(), y, slots, dora)


@pytest.mark.skipif(TRITON_HERE, reason="the Triton DoRA tests ran in this process")
def test_triton_dora_in_a_fresh_process():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "test_triton_"]
    done = subprocess.run(
        [*cmd, __file__], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


@native_here
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", BASES)
@pytest.mark.parametrize(("pattern", "num_tokens", "decode"), cases())
def test_native_dora_matches_a_per_token_loop(pattern, num_tokens, decode, kind, dtype):
    slots = make_batch(pattern, num_tokens=num_tokens, decode=decode).token_slots
    dora = make_dora()
    _, y = make_inputs(num_tokens, dtype=dtype, extra_cols=EXTRA)
    base = make_base(kind, num_tokens, dtype)
    got = y.clone()
    groups = NativeGroups.from_runs([(t, t + 1, s) for t, s in enumerate(slots.tolist())])
    LIBRARY.dora(got, dora, groups, base)
    assert_close(got, loop_dora(y, dora, slots, base), dtype)
    assert_only_dora_rows_changed(got, y, slots, dora)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", BASES)
@pytest.mark.parametrize(("pattern", "num_tokens", "decode"), cases())
def test_torch_dora_matches_a_per_token_loop(pattern, num_tokens, decode, kind, dtype):
    slots = make_batch(pattern, num_tokens=num_tokens, decode=decode).token_slots
    dora = make_dora()
    _, y = make_inputs(num_tokens, dtype=dtype, extra_cols=EXTRA)
    base = make_base(kind, num_tokens, dtype)
    got = y.clone()
    slot_rows = [(s, (slots == s).nonzero().squeeze(1)) for s in sorted(set(slots.tolist()) - {-1})]
    dora_slot_rows(got, dora, slot_rows, base)
    assert_close(got, loop_dora(y, dora, slots, base), dtype)
    assert_only_dora_rows_changed(got, y, slots, dora)


@pytest.mark.parametrize("path", ["native", "torch"])
@pytest.mark.parametrize("kind", BASES)
@pytest.mark.parametrize("pattern", PATTERNS)
def test_add_lora_with_dora_is_the_delta_then_the_rescale(pattern, kind, path):
    """The CPU dispatch end to end: ``y = z + g ⊙ (y + delta - z)`` for DoRA rows, ``y +
    delta`` for plain rows, nothing for base rows (fp32)."""
    if path == "native" and LIBRARY is None:
        pytest.skip("no C compiler: kernel not built")
    rank, max_rank = 8, 16
    batch = make_batch(pattern, num_tokens=17, decode=False)
    slots = batch.token_slots
    a, b, scales = make_stacks(rank, max_rank)
    x, y = make_inputs(17, extra_cols=0)
    base = make_base(kind, 17, y.dtype)
    dora = make_dora()
    _, with_delta = loop_lora(y, x, a, b, scales, slots, rank=rank)
    want = loop_dora(with_delta, dora, slots, base)
    native = None
    if path == "native":
        native = NativeSlots(NUM_SLOTS, a.shape[2], [(0, OUT_FEATURES)], a.dtype)
        for slot in range(NUM_SLOTS):
            native.refresh(slot, a[slot], b[slot])
    mapping = LoraMapping.build(slots, native=path == "native")
    got = y.clone()
    add_lora(got, x, a, b, scales, mapping, native=native, dora=dora, dora_base=base)
    assert_close(got, want, torch.float32)
    assert torch.equal(got[slots < 0], y[slots < 0])
