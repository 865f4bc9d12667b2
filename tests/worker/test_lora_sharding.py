"""S-LoRA's partition of adapters over tensor-parallel ranks, checked in one process.

Every rank's slots are filled as ``LoraManager(shard=...)`` fills them; the collectives are
played by hand (an all-gather is a concatenation, an all-reduce a sum), and the result must
equal the whole adapter's LoRA (the fp32 references of ``switchboard_kernels.lora_reference``) for
every token of a mixed batch: adapters of odd and even ranks that the group size does or does not
divide, different target modules, and tokens without an adapter.
"""

from __future__ import annotations

import pytest
import torch

from factories import make_checkpoint, make_peft_adapter
from switchboard_kernels import lora_reference as ref
from switchboard_kernels.lora import LoraMapping, lora_expand, lora_shrink
from worker.model.lora_manager import LoraManager
from worker.model.lora_slots import LORA_GROUPS
from worker.model.sharding import Shard

MAX_RANK = 8
# Each token's slot: three adapters and the base model, interleaved as a decode batch is.
TOKEN_SLOTS = [0, -1, 1, 2, 2, 0, -1, 1, 0, 2]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    # 8 heads and 4 KV heads: groups of 2 and of 4 ranks both split it.
    return make_checkpoint(tmp_path_factory.mktemp("base"), num_heads=8, num_kv_heads=4, seed=7)


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    all_modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return [
        make_peft_adapter(base, root / "r3", rank=3, targets=all_modules, seed=1),
        make_peft_adapter(base, root / "r8", rank=8, targets=["q_proj", "v_proj"], seed=2),
        make_peft_adapter(base, root / "r5", rank=5, targets=["o_proj", "gate_proj"], seed=3),
    ]


def filled(base, adapters, shard: Shard | None) -> LoraManager:
    manager = LoraManager(
        base, dtype=torch.float32, max_loras=len(adapters), max_lora_rank=MAX_RANK, shard=shard
    )
    for slot, path in enumerate(adapters):
        adapter_id = manager.load(f"a{slot}", path)
        manager.fill(slot, adapter_id, path)
    return manager


def whole_lora(manager: LoraManager, layer: int, group: str, x: torch.Tensor) -> torch.Tensor:
    """The unsplit adapters' LoRA output of one group: the fp32 references."""
    stack = manager.stacks[layer][group]
    slots = torch.tensor(TOKEN_SLOTS)
    y = torch.zeros(x.shape[0], stack.b.shape[1])
    h = ref.bgmv_shrink(x, stack.a, slots)
    ref.bgmv_expand(y, h, stack.b, slots, stack.scales)
    return y


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("group", list(LORA_GROUPS))
def test_the_ranks_shards_add_up_to_the_whole_adapter(base, adapters, size, group):
    whole = filled(base, adapters, None)
    ranks = [filled(base, adapters, Shard(rank, size)) for rank in range(size)]
    mapping = LoraMapping.build(TOKEN_SLOTS)
    spec = whole.spec
    modules = LORA_GROUPS[group]
    in_features = spec.projection_shape(modules[0])[0]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(len(TOKEN_SLOTS), in_features, generator=g)
    for layer in range(spec.num_layers):
        expected = whole_lora(whole, layer, group, x)
        stacks = [r.stacks[layer][group] for r in ranks]
        if group in ("o", "down"):  # row-parallel: inputs split, partial sums reduced
            parts = [x[:, Shard(rank, size).span(in_features)] for rank in range(size)]
            h = sum(lora_shrink(p, s.a, mapping) for p, s in zip(parts, stacks, strict=True))
            partials = [torch.zeros_like(expected) for _ in range(size)]
            for y, s in zip(partials, stacks, strict=True):
                lora_expand(y, h, s.b, s.scales, mapping, out_offset=s.out_offset)
            got = sum(partials)
        else:  # column-parallel: ranks gathered, each rank its outputs
            h = torch.cat([lora_shrink(x, s.a, mapping) for s in stacks], dim=1)
            outs = []
            for s in stacks:
                y = torch.zeros(x.shape[0], s.b.shape[1])
                lora_expand(y, h, s.b, s.scales, mapping)
                outs.append(y)
            got = _unshard_columns(outs, [spec.projection_shape(m)[1] for m in modules], size)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert expected.abs().max() > 0  # the adapters do something here


def _unshard_columns(outs: list[torch.Tensor], widths: list[int], size: int) -> torch.Tensor:
    """Each rank's fused output [its q | its k | its v] back to the whole [q | k | v]."""
    columns = []
    for m, width in enumerate(widths):
        start = sum(widths[:m]) // size
        columns += [y[:, start : start + width // size] for y in outs]
    return torch.cat(columns, dim=1)


def test_rank_zero_records_its_fills_for_the_others(base, adapters):
    manager = filled(base, adapters, Shard(0, 2))
    assert [(slot, path) for slot, _, path in manager.take_fills()] == [
        (slot, str(path)) for slot, path in enumerate(adapters)
    ]
    assert manager.take_fills() == []
    assert filled(base, adapters, Shard(1, 2)).take_fills() == []
