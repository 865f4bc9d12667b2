"""Weighted adapter mixes in the batched LoRA path (``switchboard_kernels/lora_mix.py``): base
rows, single-adapter rows and mixed rows of slots with different ranks in one call, through
every path (the native C kernel, the CPU torch paths with and without prepacked pairs, the
Triton kernels in the interpreter), against a float64 per-token loop. Single and base rows
must keep exactly the bits the same call without mixes gives them. The set-up of
``TRITON_INTERPRET`` is ``test_lora_kernels.py``'s (see its docstring)."""

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

import switchboard_kernels.lora_triton as tri  # noqa: E402
from lora_factories import (  # noqa: E402
    IN_FEATURES,
    NUM_SLOTS,
    OUT_FEATURES,
    assert_close,
    make_inputs,
)
from switchboard_kernels import lora_native  # noqa: E402
from switchboard_kernels.lora import (  # noqa: E402
    LoraMapping,
    MixRows,
    NativeSlots,
    SlotPairs,
    add_lora,
)

TRITON_HERE = CUDA or (
    type(tl.zeros).__name__ == "InterpretedFunction"
    and type(tri._bgmv_shrink_kernel).__name__ == "InterpretedFunction"
)
triton_here = pytest.mark.skipif(
    not TRITON_HERE, reason="triton imported without TRITON_INTERPRET=1; run in a fresh process"
)
ROOT = Path(__file__).resolve().parents[2]
LIBRARY = lora_native.native_library()
MAX_RANK = 16
RANKS = [2, 16, 5, 8]  # each slot's own rank: a mix's parts differ in rank
EXTRA = 3  # columns of y past the group's output, at its left: never touched

# A batch as (tokens, adapter) per sequence: None = base, an int = one slot, a list = a mix.
MIX_A = [(0, 0.7), (2, 0.3)]
MIX_B = [(1, 0.25), (3, 1.5), (0, 0.5)]  # three parts, a weight above 1
MIX_C = [(2, 0.6), (0, 0.4)]  # MIX_A's slots in another order, other weights
PREFILL = [(3, None), (2, 1), (4, MIX_A), (1, 3), (3, MIX_B), (1, MIX_C), (5, 0), (2, MIX_A)]
DECODE = [(1, a) for _, a in PREFILL] + [(1, MIX_B), (1, 2), (1, None)]
ONLY_MIXES = [(3, MIX_A), (1, MIX_C), (2, MIX_B)]
LONG = [(70, MIX_A), (80, 1), (65, MIX_C)]  # runs past SEGMENT_MIN_RUN: the CPU pairs path
BATCHES = {"prefill": PREFILL, "decode": DECODE, "only-mixes": ONLY_MIXES, "long": LONG}


def make_stacks(dtype: torch.dtype, *, seed: int = 0):
    """PEFT-shaped slots of RANKS padded to MAX_RANK; scale alpha/r differs per slot."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.zeros(NUM_SLOTS, MAX_RANK, IN_FEATURES)
    b = torch.zeros(NUM_SLOTS, OUT_FEATURES, MAX_RANK)
    for s, r in enumerate(RANKS):
        a[s, :r] = torch.randn(r, IN_FEATURES, generator=gen) / IN_FEATURES**0.5
        b[s, :, :r] = torch.randn(OUT_FEATURES, r, generator=gen) / r**0.5
    scales = torch.tensor([2.0 / r for r in RANKS])
    return a.to(dtype), b.to(dtype), scales


def layout(batch):
    """The primary mapping's token slots (mixed tokens -1) and the mix runs."""
    token_slots, runs, start = [], [], 0
    for n, adapter in batch:
        if isinstance(adapter, list):
            runs.append((start, start + n, adapter))
        token_slots += [adapter if isinstance(adapter, int) else -1] * n
        start += n
    return token_slots, runs


def loop_mix(y, x, a, b, scales, batch, *, out_offset: int) -> torch.Tensor:
    """The independent oracle: float64, token by token, sum of w * scale * x A^T B^T."""
    out = y.double().clone()
    cols = slice(out_offset, out_offset + OUT_FEATURES)
    t = 0
    for n, adapter in batch:
        parts = [] if adapter is None else [(adapter, 1.0)] if isinstance(adapter, int) else adapter
        for _ in range(n):
            for slot, weight in parts:
                delta = x[t].double() @ a[slot].double().T @ b[slot].double().T
                out[t, cols] += weight * float(scales[slot]) * delta
            t += 1
    return out


def native_slots(a, b) -> NativeSlots:
    slots = NativeSlots(NUM_SLOTS, IN_FEATURES, [(0, OUT_FEATURES)], a.dtype)
    for s in range(NUM_SLOTS):
        slots.refresh(s, a[s], b[s])
    return slots


def packed_pairs(a, b) -> SlotPairs:
    pairs = SlotPairs(NUM_SLOTS, a.dtype)
    for s in range(NUM_SLOTS):
        pairs.refresh(s, a, b)
    return pairs


def run(path: str, batch, dtype: torch.dtype, *, with_mix: bool = True):
    """(y before, y after add_lora on ``path``, inputs) for ``batch``."""
    a, b, scales = make_stacks(dtype)
    num_tokens = sum(n for n, _ in batch)
    x, y = make_inputs(num_tokens, dtype=dtype, extra_cols=EXTRA)
    token_slots, runs = layout(batch)
    decode = all(n == 1 for n, _ in batch)
    native = path == "native"
    mapping = LoraMapping.build(token_slots, all_decode=decode, native=native)
    mix = MixRows.build(runs, all_decode=decode, native=native) if with_mix else None
    if path == "triton":  # as built for a CUDA device: the Triton dispatch
        mapping.cpu = None
        if mix is not None:
            mix.mapping.cpu = None
    kw = {}
    if native:
        kw["native"] = native_slots(a, b)
    elif path == "packed":
        kw["pairs"] = packed_pairs(a, b)
    got = y.clone()
    add_lora(got, x, a, b, scales, mapping, out_offset=EXTRA, mix=mix, **kw)
    return y, got, (x, a, b, scales)


def check(path: str, name: str, dtype: torch.dtype) -> None:
    batch = BATCHES[name]
    y, got, (x, a, b, scales) = run(path, batch, dtype)
    assert_close(got, loop_mix(y, x, a, b, scales, batch, out_offset=EXTRA), dtype)
    # Single and base rows: the bits of the same call without the mixes; mixed rows differ
    # from it only where they have parts; no column outside the group moves.
    _, alone, _ = run(path, batch, dtype, with_mix=False)
    token_slots, runs = layout(batch)
    mixed = torch.zeros(len(token_slots), dtype=torch.bool)
    for start, end, _ in runs:
        mixed[start:end] = True
    assert torch.equal(got[~mixed], alone[~mixed])
    assert torch.equal(alone[mixed], y[mixed])
    assert torch.equal(got[:, :EXTRA], y[:, :EXTRA])


DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(BATCHES))
@pytest.mark.parametrize("path", ["torch", "packed"])
def test_cpu_torch_paths_sum_the_weighted_deltas(path, name, dtype):
    check(path, name, dtype)


@pytest.mark.skipif(LIBRARY is None, reason="no C compiler: kernel not built")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(BATCHES))
def test_native_kernel_sums_the_weighted_deltas(name, dtype):
    check("native", name, dtype)


@triton_here
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", ["prefill", "decode", "only-mixes"])
def test_triton_sums_the_weighted_deltas(name, dtype):
    check("triton", name, dtype)


@pytest.mark.skipif(TRITON_HERE, reason="the Triton mix tests ran in this process")
def test_triton_mix_in_a_fresh_process():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "test_triton_"]
    done = subprocess.run(
        [*cmd, __file__], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_virtual_rows_run_part_by_part_in_contiguous_segments():
    """Each part of a run is one segment of its slot; each part's tokens are distinct."""
    mix = MixRows.build([(2, 5, MIX_A), (7, 8, MIX_B)])
    assert mix is not None
    assert mix.rows.tolist() == [2, 3, 4, 2, 3, 4, 7, 7, 7]
    assert mix.mapping.token_slots.tolist() == [0, 0, 0, 2, 2, 2, 1, 3, 0]
    assert mix.weights.squeeze(1).tolist() == pytest.approx(
        [0.7] * 3 + [0.3] * 3 + [0.25, 1.5, 0.5]
    )
    for positions, tokens in mix.parts:
        assert len(set(tokens.tolist())) == len(tokens)
        assert mix.rows[positions].tolist() == tokens.tolist()
    assert MixRows.build([]) is None


def test_a_mix_of_one_part_with_weight_one_equals_the_single_adapter():
    """fp32: the virtual row adds the very delta the slot's own row gets."""
    single = [(3, 2), (2, None)]
    as_mix = [(3, [(2, 1.0)]), (2, None)]
    _, want, _ = run("torch", single, torch.float32)
    _, got, _ = run("torch", as_mix, torch.float32)
    assert_close(got, want, torch.float32)


def test_the_native_form_calls_once_per_part_index_over_virtual_slots():
    """Part k of every mixed token in one call, grouped by (slot, weight): a slot taken with
    two weights is two virtual slots; no token twice in a call."""
    mix = MixRows.build([(2, 5, MIX_A), (7, 8, MIX_B), (9, 10, MIX_C)], native=True)
    assert mix is not None and mix.mapping is None
    first, second, third = mix.native
    assert first.sources.tolist() == [0, 1, 2]  # (0, 0.7), (1, 0.25), (2, 0.6)
    assert first.weights.tolist() == pytest.approx([0.7, 0.25, 0.6])
    assert second.sources.tolist() == [2, 3, 0]  # (2, 0.3), (3, 1.5), (0, 0.4)
    assert third.sources.tolist() == [0] and third.weights.tolist() == [0.5]
    for part in mix.native:
        rows = part.groups.rows.tolist()
        assert len(set(rows)) == len(rows)
    assert first.groups.rows.tolist() == [2, 3, 4, 7, 9]
    assert third.groups.rows.tolist() == [7]
