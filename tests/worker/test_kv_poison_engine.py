"""NaN that one request leaves in the KV pool reaches no other request (torch attention plan).

An adapter whose ``lora_B`` entries are huge but finite (3e38: accepted at upload, as PEFT
would) makes its own rows' K/V inf and NaN; the blocks it frees are not cleared, and the torch
attention path gathers whole blocks (padding and tails included). With that plan forced (as
when the start-up measurement is disturbed, or every op's torch kernel wins) and the native
kernel made unavailable, base-model requests run beside and after many such requests, with
the whole pool filled with NaN or inf first, and must give the tokens of a clean engine; each
poisoned request fails with an error naming its adapter.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from factories import make_peft_adapter, random_prompts
from switchboard_kernels.measured_choice import KernelPlan
from worker import LLM, SamplingParams
from worker.model.op_choice import TORCH, OpPlans

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
OPTIONS = dict(
    dtype="float32", block_size=4, num_kv_blocks=96, max_num_batched_tokens=24,
    enable_prefix_caching=False, max_loras=1,
)  # fmt: skip


def make_overflowing_adapter(base, out):
    """A valid PEFT adapter whose every ``lora_B`` entry is 3e38 (finite, near fp32's max)."""
    make_peft_adapter(base, out, rank=4, seed=1, targets=["k_proj", "v_proj", "o_proj"])
    weights = load_file(out / "adapter_model.safetensors")
    weights = {k: torch.full_like(w, 3e38) if "lora_B" in k else w for k, w in weights.items()}
    save_file(weights, out / "adapter_model.safetensors")
    return out


@pytest.fixture(scope="module")
def checkpoints(target, tmp_path_factory):
    return target, make_overflowing_adapter(target, tmp_path_factory.mktemp("kv-poison") / "boom")


def torch_only_llm(base, monkeypatch) -> LLM:
    plan = KernelPlan(TORCH, TORCH)
    plans = OpPlans(plan, plan, plan, plan, plan)
    monkeypatch.setattr("worker.engine.assembly.op_plans", lambda *a, **k: plans)
    llm = LLM(str(base), **OPTIONS)
    assert llm.engine.model.ops is plans
    # A step planned for the native kernel would raise: every attention call is torch's.
    monkeypatch.setattr("switchboard_kernels.paged_attention.native_attention", lambda: None)
    return llm


def fill_pool(llm: LLM, value: float) -> None:
    for key_cache, value_cache in llm.engine.runner.kv_caches:
        key_cache.fill_(value)
        value_cache.fill_(value)


@pytest.mark.parametrize("fill", [float("nan"), float("inf")])
def test_nan_left_in_freed_blocks_reaches_no_other_request(checkpoints, monkeypatch, fill):
    base, boom = checkpoints
    llm = torch_only_llm(base, monkeypatch)
    # Lengths ending mid-block (padded decode groups), prompts split by the token budget
    # (a chunk over the context its first chunk cached). No prefix cache: the pool is all
    # freed blocks between generations, and filled with NaN or inf.
    victims = random_prompts(5, min_len=3, max_len=40, seed=5)
    clean = [o.token_ids for o in llm.generate(victims, GREEDY)]
    llm.load_adapter("boom", boom)
    poisons = random_prompts(6, min_len=3, max_len=30, seed=8)
    for _ in range(2):
        fill_pool(llm, fill)
        mixed = victims + poisons
        outs = llm.generate(mixed, GREEDY, adapters=[None] * len(victims) + ["boom"] * 6)
        failures = llm.engine.take_failures()
        assert [o.token_ids for o in outs[: len(victims)]] == clean
        assert {o.request_id for o in outs[len(victims) :]} == set(failures)
        for error in failures.values():
            assert "not numbers (NaN)" in str(error) and "with adapter '" in str(error)
        # And after them, alone, on the blocks they freed.
        assert [o.token_ids for o in llm.generate(victims, GREEDY)] == clean
