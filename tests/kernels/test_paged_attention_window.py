"""The torch attention path's sliding window and soft-cap against a float64 loop.

One step as the runner plans it for the torch path (decode groups gathered for SDPA, fresh
prefill chunks, a chunk over cached context, plain verification rows), every row checked
against its sequence's keys inside the window, scores soft-capped where asked.
"""

from __future__ import annotations

import pytest
import torch

from switchboard_kernels.paged_attention import paged_attention
from worker.core.batch import ScheduledSequence
from worker.core.block_manager import BlockManager
from worker.core.sequence import Sequence
from worker.model.step_inputs import prepare_step

HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 8, 4


def plan(seed: int = 0):
    """Decodes at several contexts, one verifying 2 drafts in line, a chunk over cached
    context, and two fresh prompts of one length (merged into one call)."""
    pool = BlockManager(num_blocks=128, block_size=BLOCK)
    g = torch.Generator().manual_seed(seed)
    scheduled = []
    shapes = [(3, 1, 0), (13, 1, 0), (30, 1, 0), (21, 1, 2), (22, 9, 0), (0, 11, 0), (0, 11, 0)]
    for i, (cached, fed, drafts) in enumerate(shapes):
        tokens = torch.randint(3, 200, (cached + fed,), generator=g).tolist()
        seq = Sequence(f"s{i}", tokens, None, i)
        if drafts:
            seq.spec_token_ids = [5] * drafts
        pool.allocate(seq.block_table, seq.num_tokens + drafts)
        scheduled.append(ScheduledSequence(seq, cached, fed, num_spec=drafts))
    return prepare_step(
        scheduled,
        block_size=BLOCK,
        native_decodes=False,
        triton_attention=False,
        num_kv_heads=KV_HEADS,
        heads_per_kv_head=HEADS // KV_HEADS,
        device_type="cpu",
    )


def reference(query, key_cache, value_cache, step, scale, window, softcap):
    """[rows, heads, dim] float64: row at position p sees keys max(0, p - W + 1) .. p."""
    out = torch.empty(query.shape, dtype=torch.float64)
    group = HEADS // KV_HEADS
    row = 0
    for s in step.order:
        table = list(s.seq.block_table)
        keys = key_cache[table].flatten(0, 1).double().repeat_interleave(group, 1)
        values = value_cache[table].flatten(0, 1).double().repeat_interleave(group, 1)
        for _ in range(s.num_fed):
            p = int(step.positions[row])
            first = max(0, p - window + 1) if window else 0
            scores = torch.einsum("hd,khd->hk", query[row].double(), keys[first : p + 1]) * scale
            if softcap:
                scores = softcap * torch.tanh(scores / softcap)
            out[row] = torch.einsum("hk,khd->hd", scores.softmax(-1), values[first : p + 1])
            row += 1
    return out


@pytest.mark.parametrize(("window", "softcap"), [(6, None), (1, None), (None, 1.5), (5, 0.7)])
def test_window_and_softcap_on_every_torch_path_match_a_float64_loop(window, softcap):
    step = plan()
    assert step.meta.decode_groups and len(step.meta.prefills) == 3
    rows = len(step.positions)
    g = torch.Generator().manual_seed(1)
    key_cache = torch.randn(128, BLOCK, KV_HEADS, DIM, generator=g)
    value_cache = torch.randn(128, BLOCK, KV_HEADS, DIM, generator=g)
    query = torch.randn(rows, HEADS, DIM, generator=g)
    flat = step.meta.slot_mapping
    key = key_cache.flatten(0, 1)[flat]  # this step's fresh keys, already in their slots
    value = value_cache.flatten(0, 1)[flat]
    scale = 2 * DIM**-0.5
    out = paged_attention(
        query,
        key,
        value,
        key_cache,
        value_cache,
        step.meta,
        scale,
        window=window,
        softcap=softcap,
        positions=step.positions,
    )
    want = reference(query, key_cache, value_cache, step, scale, window, softcap)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
