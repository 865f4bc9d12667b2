"""No value in a slot a sequence does not own reaches its attention output, on any path.

Freed blocks are not cleared, and a block table's padding and the tail of a sequence's last
block point at slots another sequence wrote: with an adapter that overflows, inf or NaN. So
every path (the torch path's gathered decode groups and chunks over cached context, the
native kernel's decodes and chunks, the Triton kernels) runs one planned step twice: once
with every slot outside the sequences' own tokens holding finite noise, once holding NaN
and inf; the outputs must be equal, element for element.

Triton runs in its CPU interpreter on these small shapes (the flag set before triton is
imported, as in test_paged_attention_kernels.py).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import triton.language as tl

import switchboard_kernels.paged_attention_triton as tri
from switchboard_kernels.attention_native import native_attention
from switchboard_kernels.paged_attention import attend
from worker.core.batch import ScheduledSequence
from worker.core.block_manager import BlockManager
from worker.core.sequence import Sequence
from worker.model.step_inputs import prepare_step

HEADS, KV_HEADS, DIM, BLOCK, NUM_BLOCKS = 4, 2, 16, 4, 64
TRITON_HERE = torch.cuda.is_available() or (
    type(tl.zeros).__name__ == "InterpretedFunction"
    and type(tri._attention_kernel).__name__ == "InterpretedFunction"
)
NATIVE_HERE = native_attention() is not None

# (cached tokens, tokens fed, drafts): decodes at several contexts (one ending mid-block),
# one verifying 2 drafts, a chunk over cached context, two fresh prompts of one length.
SHAPES = [(3, 1, 0), (13, 1, 0), (30, 1, 0), (21, 1, 2), (22, 9, 0), (0, 11, 0), (0, 11, 0)]

PATHS = {
    "torch": {"native_decodes": False, "triton_attention": False},
    "native": {"native_decodes": True, "triton_attention": False},
    "native-prefills": {"native_decodes": True, "triton_attention": False, "native_prefills": True},
    "triton": {"native_decodes": False, "triton_attention": True},
}


def device_of(path: str) -> str:
    """Triton on the GPU where there is one (else its interpreter); the others on the CPU."""
    return "cuda" if path == "triton" and torch.cuda.is_available() else "cpu"


def plan(path: str):
    """One step over sequences whose blocks are scattered over the pool (every other block
    free, so padding and neighbours are slots nobody in the step owns), and the flat slots
    the step's sequences own (their tokens and drafts)."""
    pool = BlockManager(num_blocks=NUM_BLOCKS, block_size=BLOCK)
    g = torch.Generator().manual_seed(0)
    scheduled, owned = [], []
    for i, (cached, fed, drafts) in enumerate(SHAPES):
        filler = Sequence(f"gap{i}", [1] * BLOCK, None, 0)
        pool.allocate(filler.block_table, BLOCK)  # a block between sequences, freed below
        tokens = torch.randint(3, 200, (cached + fed,), generator=g).tolist()
        seq = Sequence(f"s{i}", tokens, None, i)
        if drafts:
            seq.spec_token_ids = [5] * drafts
        length = seq.num_tokens + drafts
        pool.allocate(seq.block_table, length)
        owned += [seq.block_table[p // BLOCK] * BLOCK + p % BLOCK for p in range(length)]
        scheduled.append(ScheduledSequence(seq, cached, fed, num_spec=drafts))
        pool.free(filler.block_table)
    step = prepare_step(
        scheduled,
        block_size=BLOCK,
        num_kv_heads=KV_HEADS,
        heads_per_kv_head=HEADS // KV_HEADS,
        device_type=device_of(path),
        **PATHS[path],
    )
    return step, torch.tensor(owned)


def caches(owned: torch.Tensor, dtype: torch.dtype, fill: tuple[float, float] | None):
    """Key and value caches: the owned slots random, every other slot random too (``fill``
    None) or the key and value given (NaN, inf)."""
    g = torch.Generator().manual_seed(1)
    key = torch.randn(NUM_BLOCKS * BLOCK, KV_HEADS, DIM, generator=g)
    value = torch.randn(NUM_BLOCKS * BLOCK, KV_HEADS, DIM, generator=g)
    if fill is not None:
        foreign = torch.ones(NUM_BLOCKS * BLOCK, dtype=torch.bool)
        foreign[owned] = False
        key[foreign], value[foreign] = fill
    shape = (NUM_BLOCKS, BLOCK, KV_HEADS, DIM)
    return key.view(shape).to(dtype), value.view(shape).to(dtype)


def run(step, key_cache, value_cache, device: str) -> torch.Tensor:
    rows = len(step.positions)
    query = torch.randn(rows, HEADS, DIM, generator=torch.Generator().manual_seed(2))
    query, key_cache, value_cache = (t.to(device) for t in (query, key_cache, value_cache))
    query = query.to(key_cache.dtype)
    meta = step.meta.to(torch.device(device))
    flat = meta.slot_mapping
    key = key_cache.flatten(0, 1)[flat].clone()  # this step's fresh keys, as their slots hold
    value = value_cache.flatten(0, 1)[flat].clone()
    return attend(query, key, value, key_cache, value_cache, meta, DIM**-0.5).cpu()


def skip_unless_here(path: str) -> None:
    if path == "triton" and not TRITON_HERE:
        pytest.skip("triton was imported without TRITON_INTERPRET=1 before this module")
    if path.startswith("native") and not NATIVE_HERE:
        pytest.skip("the native attention kernel is not built here")


@pytest.mark.parametrize("fill", [(float("nan"), float("inf")), (float("-inf"), float("nan"))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", list(PATHS))
def test_foreign_slots_never_reach_the_output(path, dtype, fill):
    skip_unless_here(path)
    if path == "triton" and dtype == torch.bfloat16 and not torch.cuda.is_available():
        pytest.skip("the interpreter's bf16 is covered by the float32 case")
    step, owned = plan(path)
    clean = run(step, *caches(owned, dtype, None), device_of(path))
    poisoned = run(step, *caches(owned, dtype, fill), device_of(path))
    assert clean.isfinite().all()
    torch.testing.assert_close(poisoned, clean, rtol=0, atol=0)


def test_the_torch_path_gathers_foreign_slots():
    """The case is real: the torch path's gathered blocks hold slots the step does not own
    (padding of the decode groups' tables, the tail of a chunk's last block)."""
    step, owned = plan("torch")
    tables = [g.block_tables for g in step.meta.decode_groups]
    tables += [c.block_table for c in step.meta.prefills if c.block_table is not None]
    gathered = {int(b) * BLOCK + o for t in tables for b in t.tolist() for o in range(BLOCK)}
    assert gathered - set(owned.tolist())
