"""Multi-LoRA ops: Triton kernels and CPU paths vs the torch references.

The references themselves are checked against a per-token Python loop (lora_factories.py),
so they cannot share a mistake with the kernels. Adapter mixes follow Punica's test set
(distinct, uniform, zipf, identical, skewed) plus rows without an adapter.

Where the Triton kernels run: on a CUDA device if there is one (compiled), else in
Triton's CPU interpreter. ``TRITON_INTERPRET`` is read when ``@triton.jit`` decorates, and
that includes triton.language's own helpers (``tl.zeros``, ``tl.sum``), decorated when
``triton`` is first imported. So without CUDA the flag is set first thing here, and stays
set for the session (harmless: no compiled Triton kernel can launch without a GPU); with
CUDA it is never set, so other tests keep compiled kernels. ``switchboard_kernels.lora`` imports its
Triton module only on the first CUDA call. When an earlier test module already imported
triton without the flag (torch._dynamo does, e.g. under peft), the ``test_triton_*`` tests
cannot run in this process: they are skipped here and ``test_kernels_in_a_fresh_process``
runs them in a child pytest with the flag set from the start. Setting the flag in
tests/conftest.py (CPU-only machines) avoids the extra process.
"""

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

import switchboard_kernels.lora_fused_triton as fused  # noqa: E402
import switchboard_kernels.lora_reference as ref  # noqa: E402
import switchboard_kernels.lora_torch as lora_torch  # noqa: E402
import switchboard_kernels.lora_triton as tri  # noqa: E402
from lora_factories import (  # noqa: E402
    IN_FEATURES,
    OUT_FEATURES,
    PATTERNS,
    RANKS,
    Batch,
    assert_close,
    assert_untouched,
    loop_lora,
    make_batch,
    make_inputs,
    make_stacks,
)
from switchboard_kernels.lora import (  # noqa: E402
    FUSED_MAX_RANK,
    SEGMENT_MIN_RUN,
    LoraMapping,
    SlotPairs,
    add_lora,
    bucket_passes,
)

# The kernels and triton.language both in interpreter mode, or compiled for a GPU.
TRITON_HERE = CUDA or (
    type(tl.zeros).__name__ == "InterpretedFunction"
    and type(tri._bgmv_shrink_kernel).__name__ == "InterpretedFunction"
)
triton_here = pytest.mark.skipif(
    not TRITON_HERE,
    reason="triton was imported without TRITON_INTERPRET=1 before this module; "
    "test_kernels_in_a_fresh_process runs this test",
)

ROOT = Path(__file__).resolve().parents[2]
DEVICE = "cuda" if CUDA else "cpu"
# The interpreter computes bf16 wrongly (TOOLCHAIN.md): bf16 kernels only on a GPU.
TRITON_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])
# --- the references against the per-token loop -----------------------------------------


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize(("rank", "max_rank"), RANKS)
def test_references_match_a_per_token_loop(pattern, rank, max_rank):
    batch = make_batch(pattern, decode=False)
    a, b, scales = make_stacks(rank, max_rank)
    x, y = make_inputs(batch.num_tokens, extra_cols=9)
    slots = batch.token_slots
    want_h, want_y = loop_lora(y, x, a, b, scales, slots, rank=rank, out_offset=5)

    h = ref.bgmv_shrink(x, a, slots)
    y_bgmv = y.clone()
    ref.bgmv_expand(y_bgmv, h, b, slots, scales, out_offset=5)
    h_sgmv = ref.sgmv_shrink(x, a, batch.seg_starts, batch.seg_slots)
    y_sgmv = y.clone()
    ref.sgmv_expand(y_sgmv, h_sgmv, b, batch.seg_starts, batch.seg_slots, scales, out_offset=5)

    for got_h, got_y in ((h, y_bgmv), (h_sgmv, y_sgmv)):
        assert_close(got_h, want_h, torch.float32)
        assert_close(got_y, want_y, torch.float32)
        assert_untouched(got_y, y, slots, out_offset=5)


def test_reference_keeps_half_precision_dtypes():
    a, b, scales = make_stacks(8, 16, dtype=torch.bfloat16)
    x, y = make_inputs(3, dtype=torch.bfloat16)
    slots = torch.tensor([0, -1, 2])
    h = ref.bgmv_shrink(x, a, slots)
    assert h.dtype == torch.bfloat16 and h.shape == (3, 16)
    assert torch.equal(h[1], torch.zeros(16, dtype=torch.bfloat16))
    _, want = loop_lora(y, x, a, b, scales, slots, rank=8)
    ref.bgmv_expand(y, h, b, slots, scales)
    assert y.dtype == torch.bfloat16
    assert_close(y, want, torch.bfloat16)


# --- Triton kernels (interpreter) against the references --------------------------------


def run_triton(kind: str, batch: Batch, x, y, a, b, scales, *, out_offset: int, blocks=None):
    """The Triton kernels on DEVICE; y is updated in place and the shrink output returned
    (None from the fused kernel, which keeps it in registers)."""
    x_d, y_d, a_d, b_d, scales_d = (t.to(DEVICE) for t in (x, y, a, b, scales))
    if kind == "fused":
        slots = batch.token_slots.to(DEVICE)
        fused.bgmv_fused(y_d, x_d, a_d, b_d, slots, scales_d, out_offset=out_offset, blocks=blocks)
        y.copy_(y_d)
        return None
    if kind == "bgmv":
        slots = batch.token_slots.to(DEVICE)
        h = tri.bgmv_shrink(x_d, a_d, slots, blocks=blocks)
        tri.bgmv_expand(y_d, h, b_d, slots, scales_d, out_offset=out_offset, blocks=blocks)
    else:
        starts, slots = batch.seg_starts.to(DEVICE), batch.seg_slots.to(DEVICE)
        longest = max(batch.seq_lens)
        h = tri.sgmv_shrink(x_d, a_d, starts, slots, max_seg_len=longest)
        tri.sgmv_expand(
            y_d, h, b_d, starts, slots, scales_d, out_offset=out_offset, max_seg_len=longest
        )
    y.copy_(y_d)
    return h.cpu()


def run_reference(batch: Batch, x, y, a, b, scales, *, out_offset: int):
    h = ref.bgmv_shrink(x, a, batch.token_slots)
    ref.bgmv_expand(y, h, b, batch.token_slots, scales, out_offset=out_offset)
    return h


def check_triton(kind, pattern, rank, max_rank, dtype, num_tokens, blocks=None):
    batch = make_batch(pattern, num_tokens=num_tokens, decode=kind != "sgmv")
    a, b, scales = make_stacks(rank, max_rank, dtype=dtype)
    x, y = make_inputs(num_tokens, dtype=dtype, extra_cols=7)
    y_ref, y_tri = y.clone(), y.clone()
    h_ref = run_reference(batch, x, y_ref, a, b, scales, out_offset=3)
    h_tri = run_triton(kind, batch, x, y_tri, a, b, scales, out_offset=3, blocks=blocks)
    if h_tri is not None:
        assert h_tri.dtype == dtype
        assert_close(h_tri, h_ref, dtype)
    assert y_tri.dtype == dtype
    assert_close(y_tri, y_ref, dtype)
    assert_untouched(y_tri, y, batch.token_slots, out_offset=3)


@triton_here
@pytest.mark.parametrize("dtype", TRITON_DTYPES)
@pytest.mark.parametrize(("rank", "max_rank"), RANKS)
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("kind", ["bgmv", "sgmv"])
def test_triton_matches_reference(kind, pattern, rank, max_rank, dtype):
    check_triton(kind, pattern, rank, max_rank, dtype, num_tokens=17)


@triton_here
@pytest.mark.parametrize("dtype", TRITON_DTYPES)
@pytest.mark.parametrize(("rank", "max_rank"), [(1, 16), (8, 16), (64, 64)])
@pytest.mark.parametrize("pattern", ["distinct", "zipf", "with_base"])
def test_triton_fused_matches_reference(pattern, rank, max_rank, dtype):
    """The fused kernel on the mixes and ranks that differ for it: a slot per token, a
    skewed draw, rows without an adapter; a rank padded in its stack, and a full one."""
    check_triton("fused", pattern, rank, max_rank, dtype, num_tokens=17)


@triton_here
@pytest.mark.parametrize("dtype", TRITON_DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 3])
@pytest.mark.parametrize("kind", ["bgmv", "sgmv", "fused"])
def test_triton_odd_small_batches(kind, num_tokens, dtype):
    check_triton(kind, "uniform", 8, 16, dtype, num_tokens)


@triton_here
@pytest.mark.parametrize(
    "blocks",
    [tri.GPU_BGMV, tri.INTERPRETER_BGMV, tri.BgmvBlocks(block_m=2, tile=512, shrink_rank_block=16)],
    ids=["gpu", "interpreter", "two-tokens-small-tiles"],
)
@pytest.mark.parametrize(("rank", "max_rank"), [(8, 16), (64, 64)])
def test_triton_bgmv_program_sizes(blocks, rank, max_rank):
    """Every BGMV program size gives the reference's result: tokens per program, tiles that
    cover the input in one step or several, the rank in one shrink block or split."""
    check_triton("bgmv", "with_base", rank, max_rank, torch.float32, 7, blocks=blocks)


@triton_here
@pytest.mark.parametrize(
    "blocks",
    [
        fused.INTERPRETER_FUSED,
        fused.FusedBlocks(block_m=1, tile=512, target_programs=64),  # a share per column block
        fused.FusedBlocks(block_m=2, tile=1024, target_programs=6),  # shares of two blocks
        fused.FusedBlocks(block_m=8, tile=4096, target_programs=1),  # one program, all columns
    ],
    ids=["interpreter", "share-per-block", "shares-of-two-blocks", "one-program"],
)
@pytest.mark.parametrize(("rank", "max_rank"), [(8, 16), (64, 64)])
def test_triton_fused_program_sizes(blocks, rank, max_rank):
    """The fused kernel gives the reference's result however the output columns are shared
    among programs (each share recomputes the shrink) and however many tokens a program
    takes, including shares that end past the last column."""
    check_triton("fused", "with_base", rank, max_rank, torch.float32, 7, blocks=blocks)


@triton_here
def test_triton_fused_group_rank_up_to_its_limit_and_refused_past_it():
    """A fused q/k/v group stacks three ranks: the whole of it is one register block."""
    check_triton("fused", "zipf", 40, 192, torch.float32, 5)  # 3 modules x max_rank 64
    batch = make_batch("uniform", num_tokens=2, decode=True)
    a, b, scales = make_stacks(4, FUSED_MAX_RANK + 1)
    x, y = make_inputs(2)
    with pytest.raises(ValueError, match="rank 257"):
        fused.bgmv_fused(y, x, a, b, batch.token_slots, scales)


@triton_here
def test_add_lora_on_a_gpu_mapping_takes_the_fused_kernel_for_decode(monkeypatch):
    """The GPU dispatch (a mapping without a CPU plan), run in the interpreter: a decode
    step goes through the fused kernel, anything else through SGMV, both as the reference."""
    calls = []
    real = fused.bgmv_fused
    monkeypatch.setattr(fused, "bgmv_fused", lambda *a, **k: calls.append(1) or real(*a, **k))
    a, b, scales = make_stacks(8, 16)
    for decode in (True, False):
        batch = make_batch("zipf", num_tokens=9, decode=decode)
        x, y = make_inputs(9, extra_cols=2)
        mapping = LoraMapping.build(batch.token_slots, all_decode=decode)
        mapping.cpu = None  # as built for a CUDA device
        want, got = y.clone(), y.clone()
        run_reference(batch, x, want, a, b, scales, out_offset=2)
        add_lora(got, x, a, b, scales, mapping, out_offset=2)
        assert_close(got, want, torch.float32)
    assert calls == [1]


def test_bgmv_program_sizes_follow_the_device():
    assert tri.BgmvBlocks.for_device(torch.device("cuda", 0)) is tri.GPU_BGMV
    assert tri.BgmvBlocks.for_device(torch.device("cpu")) is tri.INTERPRETER_BGMV


@triton_here
def test_triton_sgmv_skips_empty_and_adapterless_segments():
    batch = Batch(seq_lens=[0, 5, 0, 0, 3, 1, 0, 8, 0], seq_slots=[1, 2, 0, -1, -1, 3, 2, 0, 3])
    a, b, scales = make_stacks(16, 16)
    x, y = make_inputs(batch.num_tokens, extra_cols=4)
    _, want = loop_lora(y, x, a, b, scales, batch.token_slots, rank=16, out_offset=4)
    starts, slots = batch.seg_starts, batch.seg_slots
    got = y.clone()
    h = ref.sgmv_shrink(x, a, starts, slots)
    assert torch.equal(h[5:8], torch.zeros(3, 16))  # the adapterless segment
    ref.sgmv_expand(got, h, b, starts, slots, scales, out_offset=4)
    assert_close(got, want, torch.float32)
    assert_untouched(got, y, batch.token_slots, out_offset=4)

    x_d, y_d, a_d, b_d = x.to(DEVICE), y.to(DEVICE), a.to(DEVICE), b.to(DEVICE)
    starts, slots = starts.to(DEVICE), slots.to(DEVICE)
    h = tri.sgmv_shrink(x_d, a_d, starts, slots)  # no max_seg_len: the op finds it
    assert torch.equal(h[5:8].cpu(), torch.zeros(3, 16))
    tri.sgmv_expand(y_d, h, b_d, starts, slots, scales.to(DEVICE), out_offset=4)
    assert_close(y_d.cpu(), want, torch.float32)
    assert_untouched(y_d.cpu(), y, batch.token_slots, out_offset=4)


@triton_here
def test_triton_accepts_strided_inputs():
    batch = make_batch("uniform", num_tokens=5, decode=True)
    a, b, scales = make_stacks(8, 16)
    x_wide, y = make_inputs(5)
    x = torch.stack([x_wide, -x_wide], dim=2).flatten(1)[:, ::2]  # same values, column stride 2
    assert not x.is_contiguous() and torch.equal(x, x_wide)
    want, got = y.clone(), y.clone()
    run_reference(batch, x_wide, want, a, b, scales, out_offset=0)
    run_triton("bgmv", batch, x, got, a, b, scales, out_offset=0)
    assert_close(got, want, torch.float32)


@triton_here
@pytest.mark.skipif(CUDA, reason="compiled kernels on this machine")
def test_triton_runs_in_the_interpreter_without_cuda():
    assert os.environ["TRITON_INTERPRET"] == "1"
    assert type(tri._sgmv_expand_kernel).__name__ == "InterpretedFunction"


@pytest.mark.skipif(TRITON_HERE, reason="the test_triton_* tests ran in this process")
def test_kernels_in_a_fresh_process():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "test_triton_"]
    done = subprocess.run(
        [*cmd, __file__], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout.splitlines()[-1]


# --- CPU torch paths and the dispatch ----------------------------------------------------

# (activations, adapter stacks): the CPU dispatch accepts fp32 stacks for a bf16 model too.
MODEL_AND_STACK_DTYPES = [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.bfloat16, torch.float32),
]


def packed_pairs(a: torch.Tensor, b: torch.Tensor) -> SlotPairs:
    """Every slot of the stacks prepacked (a plain-weight Linear for fp32 stacks)."""
    pairs = SlotPairs(a.shape[0], a.dtype)
    for slot in range(a.shape[0]):
        pairs.refresh(slot, a, b)
    return pairs


def cpu_candidates(token_slots: torch.Tensor):
    """Each CPU path over the whole batch: one matmul pair per run (plain or prepacked), or
    every token bucketed (passes of the busiest slot's width, and of width 1, which takes
    one pass per ordinal)."""
    mapping = LoraMapping.build(token_slots)
    bounds, run_slots = mapping.seg_starts.tolist(), mapping.seg_slots.tolist()
    runs = [(bounds[k], bounds[k + 1], s) for k, s in enumerate(run_slots) if s >= 0]
    rows = (token_slots >= 0).nonzero().squeeze(1)
    passes = bucket_passes(rows.tolist(), token_slots[rows].tolist())
    narrow = bucket_passes(rows.tolist(), token_slots[rows].tolist(), width=1)
    return {
        "segments": lambda *args, **kw: lora_torch.lora_segments(
            *args, runs, compute_dtype=args[2].dtype, **kw
        ),
        "packed-pairs": lambda y, x, a, b, scales, **kw: lora_torch.lora_packed_segments(
            y, x, packed_pairs(a, b), scales, runs, **kw
        ),
        "fp32-pairs": lambda y, x, a, b, scales, **kw: lora_torch.lora_packed_segments(
            y, x, packed_pairs(a, b), scales, runs, **kw, fp32=True
        ),
        "bucketed": lambda *args, **kw: lora_torch.lora_bucketed(*args, passes, **kw),
        "bucketed-narrow": lambda *args, **kw: lora_torch.lora_bucketed(*args, narrow, **kw),
    }


@pytest.mark.parametrize(("dtype", "stacks"), MODEL_AND_STACK_DTYPES)
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize(
    "candidate", ["segments", "packed-pairs", "fp32-pairs", "bucketed", "bucketed-narrow"]
)
def test_cpu_paths_match_reference(candidate, pattern, dtype, stacks):
    """Each path computes in the stacks' dtype, whatever the activations'."""
    batch = make_batch(pattern, decode=False)
    a, b, scales = make_stacks(8, 16, dtype=stacks)
    x, y = make_inputs(batch.num_tokens, dtype=dtype, extra_cols=6)
    want = y.clone()
    run_reference(batch, x, want, a, b, scales, out_offset=2)
    got = y.clone()
    fn = cpu_candidates(batch.token_slots)[candidate]
    fn(got, x, a, b, scales, out_offset=2)
    assert got.dtype == dtype
    assert_close(got, want, dtype)
    assert_untouched(got, y, batch.token_slots, out_offset=2)


@pytest.mark.parametrize(("dtype", "stacks"), MODEL_AND_STACK_DTYPES)
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize(
    ("num_tokens", "decode"),
    [(1, True), (3, True), (17, True), (17, False), (100, False), (300, False)],
)
@pytest.mark.parametrize("packed", [False, True], ids=["stacks", "packed"])
def test_add_lora_on_cpu_matches_reference(num_tokens, decode, pattern, dtype, stacks, packed):
    """Covers every branch of the CPU dispatch (runs, one-hot, gathered, long runs, grouped),
    with and without the slots prepacked."""
    batch = make_batch(pattern, num_tokens=num_tokens, decode=decode)
    a, b, scales = make_stacks(16, 16, dtype=stacks)
    x, y = make_inputs(num_tokens, dtype=dtype, extra_cols=5)
    want, got = y.clone(), y.clone()
    run_reference(batch, x, want, a, b, scales, out_offset=5)
    pairs = packed_pairs(a, b) if packed else None
    mapping = LoraMapping.build(batch.token_slots)
    add_lora(got, x, a, b, scales, mapping, out_offset=5, pairs=pairs)
    assert_close(got, want, dtype)
    assert_untouched(got, y, batch.token_slots, out_offset=5)


@pytest.mark.parametrize(("dtype", "stacks"), MODEL_AND_STACK_DTYPES)
@pytest.mark.parametrize(
    "token_slots",
    [
        [0, 1, 0, 2, 3],  # nearly one token per adapter, not contiguous: gathered
        [3, -1, 1, 3, 2, -1],
        [0] * 16 + [1] * 16 + [0] * 16 + [2] * 16,  # long runs, an adapter twice
        [2] * 40 + [-1] * 5 + [2] * 40,  # one adapter around base rows
    ],
    ids=["mostly-distinct", "distinct-with-base", "long-runs", "split-run"],
)
@pytest.mark.parametrize("packed", [False, True], ids=["stacks", "packed"])
def test_add_lora_on_cpu_scripted_mixes(token_slots, dtype, stacks, packed):
    slots = torch.tensor(token_slots)
    a, b, scales = make_stacks(8, 16, dtype=stacks)
    x, y = make_inputs(len(token_slots), dtype=dtype)
    _, want = loop_lora(y, x, a, b, scales, slots, rank=8)
    got = y.clone()
    pairs = packed_pairs(a, b) if packed else None
    add_lora(got, x, a, b, scales, LoraMapping.build(token_slots), pairs=pairs)
    assert_close(got, want, dtype)
    assert_untouched(got, y, slots, out_offset=0)


def test_slot_pairs_are_cut_to_the_rank_each_slot_holds():
    """make_stacks fills rank 8 of 16; a slot left at zero (an adapter without this
    module) gets no pair at all, and its tokens stay untouched."""
    a, b, scales = make_stacks(8, 16, dtype=torch.bfloat16)
    a[2].zero_()
    b[2].zero_()
    pairs = packed_pairs(a, b)
    assert [p is None for p in pairs.pairs] == [False, False, True, False]
    assert pairs.pairs[0].a32.shape == (8, IN_FEATURES)
    assert pairs.pairs[0].b32.shape == (OUT_FEATURES, 8)
    slots = torch.tensor([0, 2, 2, 1, 3])
    x, y = make_inputs(len(slots), dtype=torch.bfloat16)
    _, want = loop_lora(y, x, a, b, scales, slots, rank=8)
    for fp32 in (False, True):
        got = y.clone()
        runs = [(0, 1, 0), (1, 3, 2), (3, 4, 1), (4, 5, 3)]
        lora_torch.lora_packed_segments(got, x, pairs, scales, runs, fp32=fp32)
        assert_close(got, want, torch.bfloat16)
        assert torch.equal(got[1:3], y[1:3])


def test_add_lora_without_adapters_is_a_no_op():
    a, b, scales = make_stacks(8, 8)
    x, y = make_inputs(4)
    got = y.clone()
    add_lora(got, x, a, b, scales, LoraMapping.build([-1, -1, -1, -1]))
    assert torch.equal(got, y)


def test_mapping_describes_runs_and_flags():
    m = LoraMapping.build([2, 2, -1, 0, 0, 0, 2, -1, 1], all_decode=False)
    assert m.token_slots.tolist() == [2, 2, -1, 0, 0, 0, 2, -1, 1]
    assert m.seg_starts.tolist() == [0, 2, 3, 6, 7, 8, 9]
    assert m.seg_slots.tolist() == [2, -1, 0, 2, -1, 1]
    assert (m.max_seg_len, m.any_lora, m.all_decode, m.num_tokens) == (3, True, False, 9)


def test_cpu_plan_runs_long_segments_alone_and_buckets_the_rest():
    # One long run of slot 1 (a prefill chunk), then decodes of slots 2, 0, 2, 0.
    slots = [1] * SEGMENT_MIN_RUN + [2, 0, -1, 2, 0]
    plan = LoraMapping.build(slots).cpu
    assert (plan.segments, plan.fp32_segments) == ([(0, SEGMENT_MIN_RUN, 1)], [])
    (only,) = plan.passes
    t = SEGMENT_MIN_RUN
    assert (only.lo, only.hi, only.width) == (0, 2, 2)
    # Slot 2's tokens fill cells 4, 5 ((2 - 0) * 2 + ordinal), slot 0's cells 0, 1.
    assert only.rows.tolist() == [t, t + 3, t + 1, t + 4]
    assert only.cells.tolist() == [4, 5, 0, 1]


def test_cpu_plan_runs_a_few_short_runs_as_pairs_short_ones_in_fp32():
    # A decode batch on one adapter (one run of 32), then a run of 4 and a single decode.
    plan = LoraMapping.build([4] * 32 + [-1, 3, 3, 3, 3, 5]).cpu
    assert plan.segments == [(0, 32, 4)]
    assert plan.fp32_segments == [(33, 37, 3), (37, 38, 5)]
    assert plan.passes == []
    # FP32_MAX_RUN (16) tokens still in fp32, one more in the stacks' dtype.
    plan = LoraMapping.build([6] * 16 + [7] * 17).cpu
    assert (plan.segments, plan.fp32_segments) == ([(16, 33, 7)], [(0, 16, 6)])


def test_bucket_passes_split_a_busy_slot_when_one_pass_would_pad_too_much():
    # Slot 0 has 100 tokens and slot 31 one: one pass would pad 32 slots x 100 cells for
    # 101 tokens, so passes are 51 wide (101 tokens / 2 slots): slots 0..31, then slot 0.
    rows, slots = list(range(101)), [0] * 100 + [31]
    first, second = bucket_passes(rows, slots)
    assert (first.lo, first.hi, first.width) == (0, 31, 51)
    assert first.rows.tolist() == [*range(51), 100]
    assert first.cells.tolist() == [*range(51), 31 * 51]
    assert (second.lo, second.hi, second.width) == (0, 0, 51)
    assert second.rows.tolist() == list(range(51, 100))
    assert second.cells.tolist() == list(range(49))
    # Twelve tokens of slot 0 and one of slot 31 pad 384 cells: one pass.
    assert len(bucket_passes(list(range(13)), [0] * 12 + [31])) == 1


@pytest.mark.parametrize("stacks", [torch.float32, torch.bfloat16])
def test_a_dense_pass_takes_rows_in_cell_order_without_padding(stacks):
    """Decodes whose slots fill the range evenly (here two tokens each, in scrambled order)
    need no zero padding: the pass is x's rows in cell order, and matches the oracle."""
    token_slots = [3, 1, 0, 2, 1, 3, 2, 0]
    (only,) = bucket_passes(list(range(8)), token_slots)
    assert (only.lo, only.hi, only.width, only.dense) == (0, 3, 2, True)
    assert only.rows.tolist() == [2, 7, 1, 4, 3, 6, 0, 5]  # slot 0's tokens, slot 1's, ...
    a, b, scales = make_stacks(8, 16, dtype=stacks)
    x, y = make_inputs(len(token_slots), dtype=stacks, extra_cols=3)
    _, want = loop_lora(y, x, a, b, scales, torch.tensor(token_slots), rank=8, out_offset=1)
    got = y.clone()
    lora_torch.lora_bucketed(got, x, a, b, scales, [only], out_offset=1)
    assert_close(got, want, stacks)
    # A slot with fewer tokens than the width leaves padding: not dense.
    (padded,) = bucket_passes(list(range(3)), [0, 0, 1])
    assert not padded.dense


def test_mapping_of_an_empty_or_adapterless_batch():
    empty = LoraMapping.build([])
    assert (empty.num_tokens, empty.seg_starts.tolist(), empty.any_lora) == (0, [0], False)
    base = LoraMapping.build([-1, -1], all_decode=True)
    assert (base.any_lora, base.all_decode, base.cpu.segments, base.cpu.passes) == (
        False,
        True,
        [],
        [],
    )
    assert base.cpu.fp32_segments == []


def check_shape_errors(module):
    a, b, scales = make_stacks(8, 8)
    x, y = make_inputs(3)
    slots = torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match="does not match"):
        module.bgmv_shrink(x[:, :10], a, slots)
    with pytest.raises(ValueError, match="outside y"):
        module.bgmv_expand(y, torch.zeros(3, 8), b, slots, scales, out_offset=1)
    with pytest.raises(ValueError, match="differ in tokens"):
        module.sgmv_expand(y[:2], torch.zeros(3, 8), b, torch.tensor([0, 3]), slots[:1], scales)


def test_reference_shape_mismatches_raise():
    check_shape_errors(ref)


def test_triton_shape_mismatches_raise():
    check_shape_errors(tri)  # checked before any launch: needs no interpreter


def test_cpu_dispatch_never_imports_triton():
    code = (
        "import sys, torch\n"
        "from switchboard_kernels.lora import LoraMapping, add_lora\n"
        "y = torch.zeros(2, 4)\n"
        "add_lora(y, torch.ones(2, 3), torch.ones(1, 2, 3), torch.ones(1, 4, 2), torch.ones(1),\n"
        "         LoraMapping.build([0, -1]))\n"
        "assert y[0].tolist() == [6.0] * 4 and y[1].tolist() == [0.0] * 4, y\n"
        "assert 'triton' not in sys.modules\n"
        "assert 'switchboard_kernels.lora_triton' not in sys.modules\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True, timeout=120)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("all_decode", [True, False])
def test_add_lora_on_cuda_matches_reference(all_decode, dtype):
    batch = make_batch("with_base", num_tokens=40, decode=all_decode)
    a, b, scales = make_stacks(16, 16, dtype=dtype)
    x, y = make_inputs(batch.num_tokens, dtype=dtype, extra_cols=8)
    want = y.clone()
    run_reference(batch, x, want, a, b, scales, out_offset=8)
    got = y.cuda()
    mapping = LoraMapping.build(batch.token_slots, device="cuda", all_decode=all_decode)
    add_lora(got, x.cuda(), a.cuda(), b.cuda(), scales.cuda(), mapping, out_offset=8)
    assert_close(got.cpu(), want, dtype)
    assert_untouched(got.cpu(), y, batch.token_slots, out_offset=8)
