"""worker.model.op_choice: each op's kernels chosen by measurement (RMSNorm, the activation,
LoRA, decode and prefill attention), the cache and the contention guard, each kernel against
torch's, and an engine whose plans switch kernels by rows against transformers + peft."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from switchboard_kernels.measured_choice import KernelPlan
from switchboard_kernels.paged_attention import attend
from worker.core.batch import ScheduledSequence
from worker.core.sequence import Sequence
from worker.model import op_choice
from worker.model.op_choice import (
    NATIVE,
    OPS,
    TORCH,
    OpPlans,
    OpShapes,
    available_kernels,
    fixed_op_plans,
    measure_op_plans,
    op_plans,
)
from worker.model.step_inputs import prepare_step
from worker.sampling.sampling_params import SamplingParams

TINY = OpShapes(
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    block_size=16,
    max_rows=64,
    max_seqs=16,
)


def native_everywhere(dtype=torch.float32) -> bool:
    return all(NATIVE in available_kernels(op, dtype, TINY) for op in OPS)


def one_kernel(kernel: str) -> OpPlans:
    plan = KernelPlan(kernel, kernel)
    return OpPlans(plan, plan, plan, plan, plan)


def test_the_fixed_rule_names_kernels_this_cpu_has_and_torch_off_the_cpu():
    for dtype in (torch.float32, torch.bfloat16):
        plans = fixed_op_plans(dtype)
        for op in OPS:
            plan = getattr(plans, op)
            assert plan.source == "fixed" and set(plan.kernels) <= set(available_kernels(op, dtype))
        assert plans.prefill_attention.kernels == (TORCH,)  # SDPA unless measured otherwise
    off = fixed_op_plans(torch.float32, "cuda")
    assert all(getattr(off, op).kernels == (TORCH,) for op in OPS)
    assert all(available_kernels(op, torch.float16) == [TORCH] for op in OPS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_and_activation_give_torch_results_on_either_kernel(dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 64, generator=gen).to(dtype)
    weight = (torch.rand(64, generator=gen) + 0.5).to(dtype)
    gate_up = torch.randn(7, 192, generator=gen).to(dtype)
    want_norm = F.rms_norm(x.float(), (64,), weight.float(), 1e-6)
    gate, up = gate_up.float().chunk(2, -1)
    want_act = F.silu(gate) * up
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for kernel in (NATIVE, TORCH):
        plans = one_kernel(kernel)
        torch.testing.assert_close(
            plans.rms_norm(x, weight, 1e-6).float(), want_norm, rtol=tolerance, atol=tolerance
        )
        torch.testing.assert_close(
            plans.silu_mul(gate_up).float(), want_act, rtol=tolerance, atol=tolerance
        )


def test_a_split_plan_takes_each_kernel_on_its_side_of_the_rows(monkeypatch):
    calls = []
    monkeypatch.setattr(
        "worker.model.op_choice.native_rms_norm", lambda x, w, eps: calls.append(x.shape[0]) or x
    )
    split = KernelPlan(NATIVE, TORCH, 4)
    plans = OpPlans(split, split, split, split, split)
    weight = torch.ones(8)
    for rows in (1, 4, 5, 64):
        plans.rms_norm(torch.randn(rows, 8), weight, 1e-6)
    assert calls == [1, 4]
    assert [plans.native_chunk(r) for r in (3, 4, 5)] == [True, True, False]
    assert [plans.native_decodes(r) for r in (1, 16)] == [True, False]
    assert [plans.native_lora(r) for r in (2, 9)] == [True, False]


def attention_step(native_chunk, *, context: int, fed: int, decodes: int):
    """One step: ``decodes`` sequences decoding and one chunk of ``fed`` tokens over
    ``context`` cached; the attention output, on the kernels ``native_chunk`` picks."""
    torch.manual_seed(0)
    bs, kv, heads, d = 16, 2, 4, 16
    specs = [(100 + 9 * n, 1) for n in range(decodes)] + [(context, fed)]
    blocks = [-(-(c + f) // bs) for c, f in specs]
    caches = [torch.randn(sum(blocks) + 1, bs, kv, d) for _ in "kv"]
    scheduled, first = [], 1
    for n, ((start, count), size) in enumerate(zip(specs, blocks, strict=True)):
        seq = Sequence(f"s{n}", [0] * (start + count), SamplingParams(), n)
        seq.block_table.extend(range(first, first + size))
        first += size
        scheduled.append(ScheduledSequence(seq, start, count))
    inputs = prepare_step(
        scheduled,
        block_size=bs,
        native_decodes=True,
        triton_attention=False,
        num_kv_heads=kv,
        heads_per_kv_head=heads // kv,
        device_type="cpu",
        native_chunk=native_chunk,
    )
    rows = sum(f for _, f in specs)
    q, k, v = torch.randn(rows, heads, d), torch.randn(rows, kv, d), torch.randn(rows, kv, d)
    out = attend(q, k, v, *caches, inputs.meta, d**-0.5)
    # Rows back in the scheduled order, whichever order the step put them in.
    by_seq, row = {}, 0
    for s in inputs.order:
        by_seq[s.seq.request_id] = out[row : row + s.num_fed]
        row += s.num_fed
    return inputs.meta, torch.cat([by_seq[s.seq.request_id] for s in scheduled])


@pytest.mark.parametrize("context", [0, 40])
def test_a_prefill_chunk_on_the_native_kernel_attends_as_sdpa_does(context):
    if not native_everywhere():
        pytest.skip("the native attention kernel is not built here")
    meta, native = attention_step(lambda n: n <= 8, context=context, fed=6, decodes=3)
    assert meta.native_prefills and not meta.prefills and not meta.all_decode
    meta, sdpa = attention_step(lambda n: False, context=context, fed=6, decodes=3)
    assert len(meta.prefills) == 1 and not meta.native_prefills
    torch.testing.assert_close(native, sdpa, rtol=1e-5, atol=1e-5)
    meta, _ = attention_step(lambda n: n <= 4, context=context, fed=6, decodes=3)
    assert len(meta.prefills) == 1  # past the plan's rows: SDPA


def test_a_measurement_times_every_kernel_at_every_bucket_it_can_meet():
    result = measure_op_plans(TINY, torch.float32)
    for op, seconds in result.seconds.items():
        assert list(seconds) == available_kernels(op, torch.float32, TINY)
        limit = TINY.max_seqs if op == "decode_attention" else TINY.max_rows
        want = [r for r in (1, 4, 16, 64) if r <= limit]
        assert all(sorted(t) == want for t in seconds.values()), op
        assert all(s > 0 for t in seconds.values() for s in t.values())
        plan = getattr(result.plans, op)
        assert plan.source == "measured" and set(plan.kernels) <= set(seconds)
    if native_everywhere():
        assert set(result.seconds) == set(OPS)


def test_a_kernel_stalled_each_time_it_follows_another_keeps_its_plan(monkeypatch):
    """The native kernel takes 1 ms a step, but 9 ms whenever the call before was another
    kernel's (the wait for a sleeping core, seen on a Zen 5 VM); torch's takes 3 ms. Every
    op's plan is native at every bucket: the short steps are timed again back to back."""
    last: list[str] = []

    def stalled(shapes, dtype):
        def step(kernel, rows):
            follows_other = bool(last) and last[-1] != kernel
            last.append(kernel)
            if kernel == TORCH:
                return 0.003
            return 0.009 if follows_other else 0.001

        return step

    for op in OPS:
        monkeypatch.setitem(op_choice._STEPS, op, stalled)
    monkeypatch.setattr(
        op_choice, "available_kernels", lambda op, dtype, shapes=None: [NATIVE, TORCH]
    )
    result = measure_op_plans(TINY, torch.float32)
    for op in OPS:
        assert getattr(result.plans, op).kernels == (NATIVE,), op
        assert all(t == 0.001 for t in result.seconds[op][NATIVE].values()), op


def test_a_measured_plan_is_cached_and_read_back(tmp_path, monkeypatch):
    if not native_everywhere():
        pytest.skip("without the native kernels there is nothing to choose or cache")
    monkeypatch.setenv("SWITCHBOARD_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr("switchboard_kernels.measured_choice.MIN_CPU_SHARE", 0.0)  # a busy CI
    first = op_plans(TINY, torch.float32)
    assert len(list((tmp_path / "choices").glob("ops-*.json"))) == 1
    monkeypatch.setattr(
        "worker.model.op_choice.measure_op_plans",
        lambda *a, **k: pytest.fail("a cached plan is measured again"),
    )
    again = op_plans(TINY, torch.float32)
    for op in OPS:
        a, b = getattr(first, op), getattr(again, op)
        assert (a.small, a.large, a.split_rows, b.source) == (
            b.small, b.large, b.split_rows, "cached"
        )  # fmt: skip


def test_a_measurement_starved_of_cpu_is_neither_trusted_nor_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("SWITCHBOARD_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr("switchboard_kernels.measured_choice.MIN_CPU_SHARE", 2.0)  # never reached
    assert op_plans(TINY, torch.float32) == fixed_op_plans(torch.float32)
    assert not list(tmp_path.glob("choices/ops-*.json"))


def test_fixed_choice_measures_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("SWITCHBOARD_KERNEL_CACHE", str(tmp_path))
    assert op_plans(TINY, torch.float32, measure=False) == fixed_op_plans(torch.float32)
    assert not (tmp_path / "choices").exists()


@pytest.mark.parametrize("split", [True, False], ids=["split-at-4", "torch-only"])
def test_an_engine_switching_kernels_by_rows_generates_what_transformers_and_peft_do(
    tmp_path, monkeypatch, split
):
    """Every op on a plan that changes kernel at 4 rows (native below, torch above, and the
    reverse), prompts chunked so chunks, decodes and LoRA steps fall on both sides, a
    prefix shared; or torch's path for every op: greedy tokens equal transformers' and peft's
    (fp32)."""
    from peft import PeftModel
    from transformers import GenerationConfig

    from factories import load_hf_model, make_checkpoint, make_peft_adapter, random_prompts
    from worker import LLM

    if not native_everywhere():
        pytest.skip("needs every native kernel, so that both sides of each split run")
    low, high = KernelPlan(NATIVE, TORCH, 4, "measured"), KernelPlan(TORCH, NATIVE, 4, "measured")
    plans = OpPlans(norm=low, activation=high, lora=low, decode_attention=high,
                    prefill_attention=low)  # fmt: skip
    if not split:  # torch's path for every op, however many rows
        plans = one_kernel(TORCH)
    monkeypatch.setattr("worker.engine.assembly.op_plans", lambda *a, **k: plans)
    # The torch path's switches: no native decode step (it would take native for every
    # row count of the ops it runs: OpPlans.for_native_step).
    monkeypatch.setattr(
        "worker.model.llama.LlamaModel.native_decode_step", lambda self, kv_caches: None
    )
    base = make_checkpoint(tmp_path / "base", seed=3)
    adapter = make_peft_adapter(
        base, tmp_path / "a", rank=8, seed=1,
        targets=["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"],
    )  # fmt: skip
    shared = random_prompts(1, min_len=20, max_len=20, seed=9)[0]
    prompts = [shared + p for p in random_prompts(6, min_len=2, max_len=30, seed=5)]
    adapters = [None, "a", "a", None, "a", None]
    llm = LLM(str(base), dtype="float32", max_num_batched_tokens=24, enable_prefix_caching=True)
    assert llm.engine.model.ops is plans
    llm.load_adapter("a", adapter)
    if not split:  # the native attention kernel gone: a step planned for it would raise
        monkeypatch.setattr("switchboard_kernels.paged_attention.native_attention", lambda: None)
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outputs = llm.generate(prompts, greedy, adapters=adapters)

    hf = load_hf_model(base)
    hf.generation_config.eos_token_id = None
    model = PeftModel.from_pretrained(hf, adapter, adapter_name="a").eval()
    config = GenerationConfig(max_new_tokens=10, do_sample=False, pad_token_id=0)
    for prompt, name, out in zip(prompts, adapters, outputs, strict=True):
        ids = torch.tensor([prompt])
        if name is None:
            with model.disable_adapter():
                want = model.generate(input_ids=ids, generation_config=config)
        else:
            want = model.generate(input_ids=ids, generation_config=config)
        assert out.token_ids == want[0, len(prompt) :].tolist()


def test_a_native_decode_step_takes_native_ops_at_every_row_count():
    """Where the native step is built, an op whose plan takes native for larger row counts
    takes it for all (the step runs only where every op's plan is native at its rows, and
    the torch path must call the kernels it calls); an op planned for torch stays so."""
    low, high = KernelPlan(NATIVE, TORCH, 4, "measured"), KernelPlan(TORCH, NATIVE, 4, "measured")
    plans = OpPlans(norm=high, activation=high, lora=high, decode_attention=low,
                    prefill_attention=high)  # fmt: skip
    widened = plans.for_native_step()
    for op in ("norm", "activation"):
        assert getattr(widened, op).kernels == (NATIVE,), op
        assert getattr(widened, op).kernel_for(1) == NATIVE
    assert widened.decode_attention == low  # torch above 4: unchanged (no step for >4 rows)
    assert widened.lora == high and widened.prefill_attention == high  # not the step's to pick
    assert one_kernel(TORCH).for_native_step() == one_kernel(TORCH)
