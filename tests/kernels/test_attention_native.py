"""The native CPU decode attention (switchboard_kernels/attention_cpu.c) against a float64 loop.

Block tables are shuffled block ids, so a kernel that read blocks in cache order would
fail; contexts end mid-block; speculative verification rows (k + 1 queries per sequence)
see only keys up to their own position. Each cache dtype runs both its vector loops
(bf16: AVX-512 where the CPU has it, else 8-wide; fp32: 8-wide) and the portable ones.
"""

from __future__ import annotations

import pytest
import torch

from factories import make_checkpoint, random_prompts
from switchboard_kernels.attention_native import NativeDecodes, native_attention
from worker.core.batch import ScheduledSequence
from worker.core.block_manager import BlockManager
from worker.core.sequence import Sequence
from worker.model.llama import LlamaModel
from worker.model.model_runner import ModelRunner

KERNEL = native_attention()
pytestmark = pytest.mark.skipif(KERNEL is None, reason="no C compiler: kernel not built")
BLOCK_SIZE = 4
# (dtype, portable loops forced, tolerance against float64)
VARIANTS = {
    "bf16-vector": (torch.bfloat16, False, 2e-2),
    "bf16-portable": (torch.bfloat16, True, 2e-2),
    "fp32-vector": (torch.float32, False, 1e-5),
    "fp32-portable": (torch.float32, True, 1e-5),
}


def make_cache(
    *, num_blocks=64, kv_heads=2, head_dim=40, seed=0, dtype=torch.bfloat16, block_size=BLOCK_SIZE
):
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    return (
        torch.randn(shape, generator=gen).to(dtype),
        torch.randn(shape, generator=gen).to(dtype),
    )


def make_decodes(starts, queries, *, num_blocks=64, seed=0, block_size=BLOCK_SIZE):
    """Each sequence gets distinct blocks, drawn from a shuffled pool."""
    pool = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables = []
    for start, n in zip(starts, queries, strict=True):
        need = -(-(start + n) // block_size)
        tables.append([pool.pop() for _ in range(need)])
    return NativeDecodes.build(starts, queries, tables), tables


def loop_attention(
    query, key_cache, value_cache, starts, queries, tables, scale, window=None, softcap=None
):
    """Float64, one query row and head at a time; a query sees its last ``window`` keys,
    its scores soft-capped (``softcap * tanh(s / softcap)``) where asked."""
    heads, kv_heads = query.shape[1], key_cache.shape[2]
    out = torch.zeros(query.shape, dtype=torch.float64)
    row = 0
    for start, n, table in zip(starts, queries, tables, strict=True):
        keys = key_cache[table].flatten(0, 1).double()  # [blocks * size, kv_heads, dim]
        values = value_cache[table].flatten(0, 1).double()
        for i in range(n):
            visible = start + i + 1
            first = max(0, visible - window) if window else 0
            for h in range(heads):
                g = h // (heads // kv_heads)
                scores = keys[first:visible, g] @ query[row, h].double() * scale
                if softcap:
                    scores = softcap * torch.tanh(scores / softcap)
                out[row, h] = torch.softmax(scores, 0) @ values[first:visible, g]
            row += 1
    return out


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(
    ("starts", "queries", "heads", "kv_heads", "head_dim"),
    [
        ([0], [1], 4, 4, 16),  # first token, no grouping
        ([5, 17, 2, 40], [1, 1, 1, 1], 6, 2, 40),  # grouped heads, odd head_dim
        ([3, 30], [4, 2], 6, 2, 64),  # verification rows: k + 1 queries each
        ([3, 45], [17, 6], 9, 3, 64),  # more queries than one work item takes: split
        ([199], [1], 3, 1, 64),  # a long context: scores past one vector tile
        ([7, 50], [1, 3], 8, 2, 128),  # head_dim 128: rows two at a time
    ],
)
def test_kernel_matches_a_float64_loop(starts, queries, heads, kv_heads, head_dim, variant):
    dtype, portable, tol = VARIANTS[variant]
    key_cache, value_cache = make_cache(kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
    decodes, tables = make_decodes(starts, queries)
    rows = sum(queries)
    gen = torch.Generator().manual_seed(1)
    query = torch.randn(rows + 2, heads, head_dim, generator=gen).to(dtype)  # 2 other rows
    out = torch.full_like(query, 7.0)
    scale = head_dim**-0.5
    KERNEL.decode(query, out, key_cache, value_cache, decodes, scale, portable=portable)
    want = loop_attention(query, key_cache, value_cache, starts, queries, tables, scale)
    torch.testing.assert_close(out[:rows].double(), want[:rows], atol=tol, rtol=tol)
    assert torch.all(out[rows:] == 7.0)  # rows that are not decodes stay as they were


def check_sharp_decodes(caches, decoded, starts, queries, heads, variant, seed, window, softcap):
    """Random queries at twice the usual scale (sharper scores, so that a cap bends them)
    through the kernel, against the float64 loop."""
    (key_cache, value_cache), (decodes, tables) = caches, decoded
    dtype, portable, tol = variant
    head_dim = key_cache.shape[-1]
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(sum(queries), heads, head_dim, generator=gen).to(dtype)
    out = torch.empty_like(query)
    scale = 2 * head_dim**-0.5
    args = (query, out, key_cache, value_cache, decodes, scale)
    KERNEL.decode(*args, portable=portable, window=window, softcap=softcap)
    want = loop_attention(
        query, key_cache, value_cache, starts, queries, tables, scale, window, softcap
    )
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(("window", "softcap"), [(5, None), (1, None), (None, 2.0), (9, 0.5)])
def test_a_sliding_window_and_a_softcap_match_a_float64_loop(variant, window, softcap):
    """Windows ending mid-block and longer than some contexts, verification rows each with
    their own window, head_dim 64 (AVX-512's register-blocked rows) and 40."""
    dtype = VARIANTS[variant][0]
    for starts, queries, heads, head_dim in (
        ([2, 17, 45, 70], [1, 1, 3, 6], 6, 64),
        ([3, 38], [1, 5], 4, 40),
    ):
        caches = make_cache(kv_heads=2, head_dim=head_dim, dtype=dtype)
        decoded = make_decodes(starts, queries)
        check_sharp_decodes(
            caches, decoded, starts, queries, heads, VARIANTS[variant], 2, window, softcap
        )


@pytest.mark.parametrize("variant", VARIANTS)
def test_sharp_scores_keep_their_winner(variant):
    """Scores hundreds apart: the exp of the far ones underflows, the top key takes it all."""
    dtype, portable, tol = VARIANTS[variant]
    key_cache, value_cache = make_cache(dtype=dtype)
    decodes, tables = make_decodes([30], [1])
    query = torch.randn(1, 4, 40, generator=torch.Generator().manual_seed(3)).to(dtype)
    out = torch.empty_like(query)
    KERNEL.decode(query, out, key_cache, value_cache, decodes, 60.0, portable=portable)
    want = loop_attention(query, key_cache, value_cache, [30], [1], tables, 60.0)
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)


SPLIT_KEYS = 1024  # as in attention_cpu.c: a longer context is read in parts, then merged


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(
    ("starts", "queries", "window", "softcap"),
    [
        ([2500], [1], None, None),  # a lone long sequence: three parts
        ([1023, 1024, 2047], [1, 1, 1], None, None),  # ends at, just past, a part's end
        ([1021, 3000], [5, 1], None, None),  # verification rows that straddle a part's end
        ([2100, 1030], [2, 1], 1200, None),  # windows that start in a later part
        ([2100, 40], [1, 3], 60, 0.5),  # a window inside one part, a soft-cap
    ],
)
def test_long_contexts_in_parts_match_a_float64_loop(starts, queries, window, softcap, variant):
    """Contexts past SPLIT_KEYS: each part's rows normalized over its own keys, merged by
    their largest scores and sums of exps (rows that see none of a part's keys weigh 0)."""
    dtype = VARIANTS[variant][0]
    head_dim = 64
    num_blocks = sum(-(-(s + n) // BLOCK_SIZE) for s, n in zip(starts, queries, strict=True))
    caches = make_cache(num_blocks=num_blocks, kv_heads=3, head_dim=head_dim, dtype=dtype)
    decoded = make_decodes(starts, queries, num_blocks=num_blocks)
    check_sharp_decodes(caches, decoded, starts, queries, 9, VARIANTS[variant], 6, window, softcap)


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_row_in_parts_does_not_depend_on_the_rows_beside_it(variant):
    """Batch invariance: the parts are fixed by key positions, so a verification row whose
    chunk straddles a part's end gives the same bits as the same query decoded alone."""
    dtype, portable, _ = VARIANTS[variant]
    key_cache, value_cache = make_cache(num_blocks=300, kv_heads=1, head_dim=64, dtype=dtype)
    _, tables = make_decodes([1022], [4], num_blocks=300)
    query = torch.randn(4, 2, 64, generator=torch.Generator().manual_seed(7)).to(dtype)
    together = torch.empty_like(query)
    decodes = NativeDecodes.build([1022], [4], tables)
    KERNEL.decode(query, together, key_cache, value_cache, decodes, 0.2, portable=portable)
    for i in range(4):
        alone = torch.empty_like(query[i : i + 1])
        decodes = NativeDecodes.build([1022 + i], [1], tables)
        KERNEL.decode(
            query[i : i + 1], alone, key_cache, value_cache, decodes, 0.2, portable=portable
        )
        assert torch.equal(alone[0], together[i])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "starts",
    [list(range(8)), [1030, 2100, 5, 1500, 40, 3000]],  # the second: contexts read in parts
)
def test_a_decode_gives_the_same_bits_alone_and_in_a_batch(dtype, starts):
    """Scores are summed four keys at a time by position: contexts ending at each place in a
    group of four (1 to 8 keys, blocks of 16, the default model's heads) give one row the
    same bits decoded alone and beside the others. A batch walks every KV head of a token
    in one work item where the 8-wide loops run (a lone sequence, each KV head apart):
    the same bits either way, long contexts' parts and their merge included."""
    num_blocks = sum(-(-(s + 1) // 16) for s in starts) + 4
    key_cache, value_cache = make_cache(
        num_blocks=num_blocks, kv_heads=3, head_dim=64, block_size=16, dtype=dtype
    )
    decodes, tables = make_decodes(starts, [1] * len(starts), num_blocks=num_blocks, block_size=16)
    query = torch.randn(len(starts), 9, 64, generator=torch.Generator().manual_seed(3)).to(dtype)
    together = torch.empty_like(query)
    KERNEL.decode(query, together, key_cache, value_cache, decodes, 0.125)
    for i, start in enumerate(starts):
        alone = torch.empty_like(query[i : i + 1])
        one = NativeDecodes.build([start], [1], [tables[i]])
        KERNEL.decode(query[i : i + 1], alone, key_cache, value_cache, one, 0.125)
        assert torch.equal(alone[0], together[i]), start
    want = loop_attention(query, key_cache, value_cache, starts, [1] * len(starts), tables, 0.125)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(together.double(), want, atol=tol, rtol=tol)


def test_query_may_be_a_strided_view():
    """q as it comes out of the fused qkv projection: a view with a wider row stride."""
    key_cache, value_cache = make_cache()
    decodes, tables = make_decodes([9, 2], [1, 1])
    qkv = torch.randn(2, 6 * 40 + 2 * 2 * 40).bfloat16()
    query = qkv[:, : 6 * 40].view(2, 6, 40)
    out = torch.empty(2, 6, 40, dtype=torch.bfloat16)
    KERNEL.decode(query, out, key_cache, value_cache, decodes, 0.2)
    want = loop_attention(query, key_cache, value_cache, [9, 2], [1, 1], tables, 0.2)
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize(
    ("starts", "queries", "heads", "kv_heads", "head_dim", "window", "softcap"),
    [
        ([0, 5, 16, 40, 130], [1, 1, 1, 1, 1], 9, 3, 64, None, None),  # mid-block ends
        ([3, 45], [17, 6], 9, 3, 64, None, None),  # verification rows in chunks of 4
        ([31, 70], [4, 1], 16, 1, 64, None, None),  # 64 rows an item: four tiles of queries
        ([7, 50], [1, 3], 8, 2, 128, None, None),  # head_dim 128: four tiles of features
        ([2, 45, 70], [1, 3, 6], 6, 2, 64, 9, 0.5),  # windows, a soft-cap
        ([2500, 1021], [1, 5], 9, 3, 64, None, None),  # parts of SPLIT_KEYS, merged
    ],
)
def test_bf16_blocks_of_whole_tiles_match_a_float64_loop(
    block_size, starts, queries, heads, kv_heads, head_dim, window, softcap
):
    """bf16 in the engine's block sizes (16 by default, 64), contexts ending mid-block, items
    of 64 query rows, head_dim 128, windows and parts."""
    num_blocks = sum(-(-(s + n) // block_size) for s, n in zip(starts, queries, strict=True)) + 4
    caches = make_cache(
        num_blocks=num_blocks, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size
    )
    decoded = make_decodes(starts, queries, num_blocks=num_blocks, block_size=block_size)
    variant = VARIANTS["bf16-vector"]
    check_sharp_decodes(caches, decoded, starts, queries, heads, variant, 8, window, softcap)


def test_an_own_slot_in_blocks_of_whole_tiles_stands_in_for_the_last_key():
    """As below, in blocks of 16 keys and 9 heads over 3 (the default model's shape)."""
    key_cache, value_cache = make_cache(kv_heads=3, head_dim=64, block_size=16)
    _, tables = make_decodes([21], [1], block_size=16)
    slot = 63 * 16 + 5
    decodes = NativeDecodes.build([21], [1], tables, [slot])
    query = torch.randn(1, 9, 64, generator=torch.Generator().manual_seed(4)).bfloat16()
    out = torch.empty_like(query)
    KERNEL.decode(query, out, key_cache, value_cache, decodes, 0.3)
    flat_keys, flat_values = key_cache.flatten(0, 1), value_cache.flatten(0, 1)
    keys = torch.cat([key_cache[tables[0]].flatten(0, 1)[:21], flat_keys[slot : slot + 1]])
    values = torch.cat([value_cache[tables[0]].flatten(0, 1)[:21], flat_values[slot : slot + 1]])
    for h in range(9):
        scores = keys[:, h // 3].double() @ query[0, h].double() * 0.3
        expected = torch.softmax(scores, 0) @ values[:, h // 3].double()
        torch.testing.assert_close(out[0, h].double(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("variant", VARIANTS)
def test_an_own_slot_stands_in_for_the_last_key(variant):
    """An alternative draft: a one-query sequence over another's blocks whose last key and
    value (at its own position) come from a slot elsewhere in the cache."""
    dtype, portable, tol = VARIANTS[variant]
    key_cache, value_cache = make_cache(dtype=dtype)
    _, tables = make_decodes([13], [3])  # the sequence: 13 cached, 3 rows fed
    table = tables[0]
    elsewhere = 63 * BLOCK_SIZE + 2  # any slot: where the alternatives were written
    starts, queries = [13, 14, 13], [3, 1, 1]  # the chain, then alternatives at index 1, 0
    decodes = NativeDecodes.build(starts, queries, [table] * 3, [-1, elsewhere, elsewhere - 1])
    query = torch.randn(5, 4, 40, generator=torch.Generator().manual_seed(4)).to(dtype)
    out = torch.empty_like(query)
    KERNEL.decode(query, out, key_cache, value_cache, decodes, 0.3, portable=portable)
    want = loop_attention(query[:3], key_cache, value_cache, [13], [3], tables, 0.3)
    torch.testing.assert_close(out[:3].double(), want, atol=tol, rtol=tol)
    flat_keys, flat_values = key_cache.flatten(0, 1), value_cache.flatten(0, 1)
    for row, start, slot in ((3, 14, elsewhere), (4, 13, elsewhere - 1)):
        keys = torch.cat([key_cache[table].flatten(0, 1)[:start], flat_keys[slot : slot + 1]])
        values = torch.cat([value_cache[table].flatten(0, 1)[:start], flat_values[slot : slot + 1]])
        for h in range(4):
            g = h // 2
            scores = keys[:, g].double() @ query[row, h].double() * 0.3
            expected = torch.softmax(scores, 0) @ values[:, g].double()
            torch.testing.assert_close(out[row, h].double(), expected, atol=tol, rtol=tol)
    with pytest.raises(ValueError, match="only for one-query sequences"):
        NativeDecodes.build([13], [3], [table], [elsewhere])


def test_mismatched_inputs_are_refused():
    key_cache, _ = make_cache()
    decodes, _ = make_decodes([3], [1])
    query = torch.randn(1, 4, 40).bfloat16()
    bad = {
        "fp32 query, bf16 cache": (query.float(), key_cache),
        "fp16": (query.half(), key_cache.half()),
        "head_dim differs": (query[..., :32], key_cache),
        "heads not a multiple of kv heads": (query[:, :3], key_cache),
        "block past the cache": (query, key_cache[:1]),
    }
    for q, cache in bad.values():
        with pytest.raises(ValueError, match="do not fit together"):
            KERNEL.decode(q, torch.empty_like(q), cache, cache, decodes, 0.1)


# bf16 logits of a random model are O(1); a wrong key or block moves them by that much,
# while bf16 rounding moves a few by ~0.05 (more where oneDNN lacks native bf16).
MODEL_TOLERANCE = {torch.bfloat16: (0.1, 0.03), torch.float32: (1e-4, 1e-5)}  # max, mean


@pytest.mark.parametrize("dtype", MODEL_TOLERANCE, ids=str)
def test_model_steps_match_the_gathered_sdpa_path(tmp_path, dtype):
    """A model run step by step twice, decodes through the kernel and through the torch
    path (block gather + SDPA, checked against transformers in fp32 elsewhere): contexts
    of 1 to 45 tokens in blocks of 4, then a step where one sequence verifies two draft
    tokens and three alternatives while another one's prompt is prefilled."""
    path = make_checkpoint(tmp_path, arch="llama", num_heads=4, num_kv_heads=2)
    model = LlamaModel.from_pretrained(path, dtype=dtype)
    runners = {on: ModelRunner(model, num_blocks=96, block_size=4) for on in (True, False)}
    runners[False].native_decodes = False
    assert runners[True].native_decodes
    pool = BlockManager(num_blocks=96, block_size=4)
    prompts = random_prompts(5, min_len=1, max_len=40, seed=2)
    seqs = [Sequence(f"r{i}", p, None, i) for i, p in enumerate(prompts)]
    step = []
    for seq in seqs[:4]:
        pool.allocate(seq.block_table, seq.num_tokens)
        step.append(ScheduledSequence(seq, 0, seq.num_tokens))
    for n in range(6):
        logits = {on: runner.execute(step)[1].float() for on, runner in runners.items()}
        most, mean = MODEL_TOLERANCE[dtype]
        torch.testing.assert_close(logits[True], logits[False], atol=most, rtol=0.05)
        assert (logits[True] - logits[False]).abs().mean() < mean
        if n == 5:
            break
        for seq, token in zip(seqs, logits[False].argmax(-1).tolist(), strict=False):
            seq.append_token(token)
            pool.allocate(seq.block_table, seq.num_tokens)
        step = [ScheduledSequence(seq, seq.num_tokens - 1, 1) for seq in seqs[:4]]
        if n == 4:  # the last step: drafts to verify, and a prompt beside the decodes;
            # the chain 5, 9 has alternatives 7 and 11 for the 5 and 3 for the 9 (the kernel
            # attends each as a sequence of its own, the torch path the tree as a chunk)
            seqs[0].spec_token_ids = [5, 9, 7, 11, 3]
            seqs[0].spec_offsets = [0, 1, 0, 0, 1]
            pool.allocate(seqs[0].block_table, seqs[0].num_tokens + 5)
            step[0] = ScheduledSequence(seqs[0], seqs[0].num_tokens - 1, 1, num_spec=5)
            pool.allocate(seqs[4].block_table, seqs[4].num_tokens)
            step.append(ScheduledSequence(seqs[4], 0, seqs[4].num_tokens))
