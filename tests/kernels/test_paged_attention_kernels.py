"""Paged attention in Triton (decode with split-K, prefill over cached context, the K/V
write) against the torch references, and the references against a per-row loop.

The kernels run on a CUDA device if there is one, else in Triton's CPU interpreter (set up
as in test_lora_kernels.py: the flag before triton is imported). Shapes stay tiny: the
interpreter costs milliseconds per program. Every batch has its blocks shuffled (tables
that are not contiguous), contexts that end mid-block, k + 1 verification rows and a draft
row off its chain (it sees its chain's keys up to a point, then only itself).
"""

import os

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import triton.language as tl  # noqa: E402

import switchboard_kernels.paged_attention_reference as ref  # noqa: E402
import switchboard_kernels.paged_attention_triton as tri  # noqa: E402
from switchboard_kernels.paged_layout import DECODE_MAX_ROWS, PagedLayout, PagedSequence  # noqa: E402

TRITON_HERE = CUDA or (
    type(tl.zeros).__name__ == "InterpretedFunction"
    and type(tri._attention_kernel).__name__ == "InterpretedFunction"
)
triton_here = pytest.mark.skipif(
    not TRITON_HERE, reason="triton was imported without TRITON_INTERPRET=1 before this module"
)
DEVICE = "cuda" if CUDA else "cpu"
TOLERANCE = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}
BLOCK_SIZE, NUM_BLOCKS, KV_HEADS, HEAD_DIM, SCALE = 4, 64, 2, 16, 0.3


def make_sequences(spans: list[tuple[int, int]], *, seed: int = 0) -> list[PagedSequence]:
    """(context, rows) per sequence, each on blocks drawn from a shuffled pool."""
    pool = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(seed)).tolist()
    sequences = []
    for context, rows in spans:
        count = -(-(context + rows) // BLOCK_SIZE)
        table, pool = pool[:count], pool[count:]
        sequences.append(PagedSequence(context, rows, table))
    return sequences


def with_draft_off_its_chain(s: PagedSequence) -> PagedSequence:
    """The last row is a draft at offset 1 of the row before the previous: it sees the keys
    up to that row's predecessor and its own key, not the row right before it."""
    last = list(range(s.context, s.context + s.rows))
    last[-1] = s.context + s.rows - 3
    return PagedSequence(s.context, s.rows, s.block_table, last)


def make_caches(dtype: torch.dtype, *, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)


def make_query(layout: PagedLayout, group: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(2)
    rows = layout.row_self.shape[0]
    return torch.randn(rows, KV_HEADS * group, HEAD_DIM, generator=g).to(dtype)


def loop_attention(
    query, key_cache, value_cache, sequences, window=None, softcap=None
) -> torch.Tensor:
    """The semantics one row and head at a time, slot by slot, in float64; with a window W a
    row at position p sees its chain's keys after p - W (a draft off its chain sits one past
    its last key), with a soft-cap its scores s become softcap * tanh(s / softcap)."""
    out = torch.zeros(query.shape, dtype=torch.float64)
    group = query.shape[1] // key_cache.shape[2]
    row = 0
    for s in sequences:
        lasts = s.last_keys or range(s.context, s.context + s.rows)
        for i, last in enumerate(lasts):
            own = s.context + i
            position = own if last == own else last + 1
            after = position - window if window else -1
            keys = [j for j in range(own + 1) if after < j <= last or j == own]
            slots = [(s.block_table[j // BLOCK_SIZE], j % BLOCK_SIZE) for j in keys]
            for h in range(query.shape[1]):
                k = torch.stack([key_cache[b, o, h // group] for b, o in slots]).double()
                v = torch.stack([value_cache[b, o, h // group] for b, o in slots]).double()
                scores = SCALE * k @ query[row + i, h].double()
                if softcap:
                    scores = softcap * torch.tanh(scores / softcap)
                weights = scores.softmax(0)
                out[row + i, h] = weights @ v
        row += s.rows
    return out


def reference(query, key_cache, value_cache, layout, **masking) -> torch.Tensor:
    out = torch.full(query.shape, float("nan"), dtype=torch.float64)
    args = (query.double(), key_cache.double(), value_cache.double(), layout, SCALE, out)
    ref.decode(*args, **masking)
    ref.prefill(*args, **masking)
    return out


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(actual.double().cpu(), expected, **TOLERANCE[dtype])


# Decodes (1 row, k + 1 = 4 rows, one past a block edge, one long enough to split), a short
# chunk without context, a chunk over cached context and one from zero, both mid-block ends.
SPANS = [(5, 1), (13, 4), (95, 1), (0, 3), (9, 11), (0, 19), (70, 2)]


def test_layout_tiles_decodes_and_chunks():
    sequences = make_sequences(SPANS)
    layout = PagedLayout.build(sequences, num_kv_heads=2, group=3, device_type="cpu")
    # (sequence, first row, rows, keys read); prefill tiles of 16 // 3 -> 4 rows
    assert layout.decode.table.tolist() == [
        [0, 0, 1, 6], [1, 1, 4, 17], [2, 5, 1, 96], [3, 6, 3, 3], [6, 39, 2, 72],
    ]  # fmt: skip
    assert layout.decode.block_q == 4 and layout.decode.num_splits == 1
    assert layout.prefill.table[:4].tolist() == [
        [4, 9, 4, 13], [4, 13, 4, 17], [4, 17, 3, 20], [5, 20, 4, 4],
    ]  # fmt: skip
    assert layout.prefill.table[-1].tolist() == [5, 36, 3, 19]
    assert layout.block_tables.shape == (7, 24)
    assert layout.row_self[5:10].tolist() == [95, 0, 1, 2, 9]
    # Split-K only where decode programs are few and a context long.
    long = make_sequences([(900, 1), (3, 1)])
    assert PagedLayout.build(long, num_kv_heads=2, group=1).decode.num_splits == 3
    assert PagedLayout.build(long, num_kv_heads=200, group=1).decode.num_splits == 1
    assert max(s.rows for s in sequences[:4]) <= DECODE_MAX_ROWS


@pytest.mark.parametrize("group", [1, 3])
def test_reference_matches_a_per_row_loop(group):
    sequences = make_sequences(SPANS)
    sequences[1] = with_draft_off_its_chain(sequences[1])
    sequences[4] = with_draft_off_its_chain(sequences[4])
    layout = PagedLayout.build(sequences, num_kv_heads=KV_HEADS, group=group, device_type="cpu")
    key_cache, value_cache = make_caches(torch.float32)
    query = make_query(layout, group, torch.float32)
    got = reference(query, key_cache, value_cache, layout)
    torch.testing.assert_close(got, loop_attention(query, key_cache, value_cache, sequences))


def run_triton(kind: str, query, key_cache, value_cache, layout, **masking) -> torch.Tensor:
    out = torch.full(query.shape, float("nan"), dtype=query.dtype, device=DEVICE)
    kernel = tri.decode if kind == "decode" else tri.prefill
    caches = key_cache.to(DEVICE), value_cache.to(DEVICE)
    kernel(query.to(DEVICE), *caches, layout.to(torch.device(DEVICE)), SCALE, out, **masking)
    return out.cpu()


def tile_rows(tiles) -> torch.Tensor:
    return torch.cat([torch.arange(r, r + n) for _, r, n, _ in tiles.table.tolist()])


@triton_here
@pytest.mark.parametrize(
    ("group", "splits", "dtype"),
    [(1, 1, torch.float32), (3, 3, torch.float32), (3, 1, torch.float16), (1, 4, torch.float16)],
)
def test_triton_decode_matches_the_reference(group, splits, dtype):
    """Split-K slices of 32 keys: the 95-token context spans three, some splits see none."""
    sequences = make_sequences(SPANS, seed=splits)
    sequences[1] = with_draft_off_its_chain(sequences[1])
    layout = PagedLayout.build(
        sequences, num_kv_heads=KV_HEADS, group=group, device_type="cpu", num_splits=splits
    )
    key_cache, value_cache = make_caches(dtype)
    query = make_query(layout, group, dtype)
    got = run_triton("decode", query, key_cache, value_cache, layout)
    want = reference(query, key_cache, value_cache, layout)
    rows = tile_rows(layout.decode)
    assert_close(got[rows], want[rows], dtype)
    untouched = torch.ones(query.shape[0], dtype=torch.bool)
    untouched[rows] = False
    assert got[untouched].isnan().all()  # the prefill rows are left alone


@triton_here
@pytest.mark.parametrize(("group", "dtype"), [(1, torch.float32), (3, torch.float16)])
def test_triton_prefill_matches_the_reference(group, dtype):
    """Chunks from zero and over cached context (a prefix hit, a later chunk), causal
    within the chunk, one with a draft row off its chain."""
    sequences = make_sequences([(0, 19), (9, 11), (22, 9)], seed=group)
    sequences[1] = with_draft_off_its_chain(sequences[1])
    layout = PagedLayout.build(sequences, num_kv_heads=KV_HEADS, group=group, device_type="cpu")
    assert layout.decode.count == 0
    key_cache, value_cache = make_caches(dtype)
    query = make_query(layout, group, dtype)
    got = run_triton("prefill", query, key_cache, value_cache, layout)
    assert_close(got, reference(query, key_cache, value_cache, layout), dtype)


# Sliding windows (ending mid-block, of one key, longer than some contexts) and soft-caps.
MASKINGS = [{"window": 6}, {"window": 1, "softcap": 0.5}, {"softcap": 0.8}]


@pytest.mark.parametrize("masking", MASKINGS, ids=str)
def test_windowed_reference_matches_a_per_row_loop(masking):
    sequences = make_sequences(SPANS)
    sequences[1] = with_draft_off_its_chain(sequences[1])
    sequences[4] = with_draft_off_its_chain(sequences[4])
    layout = PagedLayout.build(sequences, num_kv_heads=KV_HEADS, group=3, device_type="cpu")
    key_cache, value_cache = make_caches(torch.float32)
    query = make_query(layout, 3, torch.float32)
    got = reference(query, key_cache, value_cache, layout, **masking)
    want = loop_attention(query, key_cache, value_cache, sequences, **masking)
    torch.testing.assert_close(got, want)


@triton_here
@pytest.mark.parametrize("masking", MASKINGS, ids=str)
def test_windowed_triton_kernels_match_the_reference(masking):
    """Both launches, the decode one split over 3 programs, drafts off their chains."""
    sequences = make_sequences(SPANS, seed=5)
    sequences[1] = with_draft_off_its_chain(sequences[1])
    sequences[4] = with_draft_off_its_chain(sequences[4])
    layout = PagedLayout.build(
        sequences, num_kv_heads=KV_HEADS, group=3, device_type="cpu", num_splits=3
    )
    key_cache, value_cache = make_caches(torch.float32)
    query = make_query(layout, 3, torch.float32)
    want = reference(query, key_cache, value_cache, layout, **masking)
    for kind in ("decode", "prefill"):
        got = run_triton(kind, query, key_cache, value_cache, layout, **masking)
        rows = tile_rows(getattr(layout, kind))
        assert_close(got[rows], want[rows], torch.float32)


@triton_here
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_write_kv_matches_the_reference(dtype):
    """Fresh keys and values as the model has them (views into a fused projection), scattered
    to shuffled slots; padding rows (slot -1) write nothing."""
    g = torch.Generator().manual_seed(3)
    fused = torch.randn(7, 3 * KV_HEADS * HEAD_DIM, generator=g).to(dtype)
    key, value, _ = fused.view(7, 3 * KV_HEADS, HEAD_DIM).split(KV_HEADS, dim=1)
    slots = torch.tensor([13, -1, 2, 190, 57, -1, 100])
    want_k, want_v = make_caches(dtype)
    got_k, got_v = want_k.to(DEVICE), want_v.to(DEVICE)
    ref.write_kv(key, value, want_k, want_v, slots)
    tri.write_kv(key.to(DEVICE), value.to(DEVICE), got_k, got_v, slots.to(DEVICE))
    assert torch.equal(got_k.cpu(), want_k) and torch.equal(got_v.cpu(), want_v)
