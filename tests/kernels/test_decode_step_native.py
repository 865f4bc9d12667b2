"""switchboard_kernels/decode_step_cpu.c: a served model's decode step in one native call.

The reference is the model's own torch path (``LlamaModel.forward`` and ``compute_logits``,
each op dispatched from Python): the native step claims to compute exactly what it does, so
every step's logits and every K/V it writes must equal that path's bit for bit, for bf16 and
fp32 models, biases, GQA, quantized bases, blocks crossed and batches of sequences at
different lengths. That torch path is itself checked against transformers and peft
elsewhere (tests/worker/test_engine.py, test_quantized_engine.py).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from factories import make_checkpoint
from switchboard_kernels.activation_native import native_activation
from switchboard_kernels.decode_step_native import native_step
from switchboard_kernels.linear_choice import ONEDNN, PANELS, LinearPlan
from switchboard_kernels.measured_choice import KernelPlan
from worker.core.batch import ScheduledSequence
from worker.core.block_manager import BlockManager
from worker.core.sequence import Sequence
from worker.model.llama import LlamaModel
from worker.model.model_runner import ModelRunner
from worker.model.op_choice import NATIVE, TORCH, fixed_op_plans
from worker.model.quantize_on_load import OnLoad
from worker.model.step_interrupt import StepAbandoned

pytestmark = pytest.mark.skipif(native_step() is None, reason="no C compiler here")
BLOCK = 4  # small blocks: the sequences below cross several


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def checkpoint(request, tmp_path_factory):
    """Hidden 128, 4 heads over 2 KV heads, an untied output layer (Qwen2: qkv biases)."""
    root = tmp_path_factory.mktemp(request.param)
    return make_checkpoint(
        root / "model", arch=request.param, hidden_size=128, tie_word_embeddings=False, seed=5
    )


def runner_for(
    path, dtype: torch.dtype, on_load: OnLoad | None = None, output_token_ids=None, plan=None
):
    """``plan``: the projections' kernels (default: the native panels, which AVX2 CPUs take
    for fp32 too; with AVX-512 the fixed rule gives fp32 to oneDNN). The activation is the
    native kernel on every CPU (the fixed rule gives it to torch without a vector loop, and the
    native step runs only where the torch path would call the same kernels)."""
    ops = dataclasses.replace(fixed_op_plans(dtype), activation=KernelPlan(NATIVE, NATIVE))
    model = LlamaModel.from_pretrained(
        path,
        dtype=dtype,
        on_load=on_load,
        output_token_ids=output_token_ids,
        linear_plan=plan or LinearPlan(PANELS, PANELS),
        op_plans=ops,
    )
    blocks = BlockManager(num_blocks=64, block_size=BLOCK, enable_caching=False)
    return ModelRunner(model, num_blocks=64, block_size=BLOCK), blocks


def caches(runner) -> list[torch.Tensor]:
    return [t.clone() for kv in runner.kv_caches for t in kv]


def decode_both_ways(
    runner, blocks, prompts: list[list[int]], steps: int, *, kept_only=False, stopped_first=False
):
    """Each prompt prefilled through torch, then ``steps`` steps of every sequence decoding
    its next token (the prompt's own tokens cycled: the same tokens both ways), each step
    run natively, then again through torch over the same slots. Asserts each step's logits
    and caches equal; returns how many steps ran natively. ``stopped_first``: each step is
    first run natively with its interrupt raised, which must stop it (StepAbandoned)."""
    step = runner.native_step
    seqs = [Sequence(str(i), list(p), None, 0) for i, p in enumerate(prompts)]
    for s, p in zip(seqs, prompts, strict=True):
        blocks.allocate(s.block_table, len(p) + steps + 1)
        runner.execute([ScheduledSequence(s, 0, len(p))])
        s.num_computed_tokens = len(p)
    for t in range(steps):
        for s, p in zip(seqs, prompts, strict=True):
            s.tokens.append(p[t % len(p)])
        scheduled = [ScheduledSequence(s, len(s.tokens) - 1, 1) for s in seqs]
        runner.native_step = step
        if stopped_first:
            runner.model.interrupt.arm()
            assert runner.model.interrupt.request()
            with pytest.raises(StepAbandoned):
                runner._execute_native_step(scheduled, kept_only)
            runner.model.interrupt.disarm()
        native = runner._execute_native_step(scheduled, kept_only)
        assert native is not None
        after_native = caches(runner)
        runner.native_step = None
        order, logits = runner.execute(scheduled, kept_only=kept_only)
        runner.native_step = step
        assert [o.seq for o in native[0]] == seqs  # one row per sequence, in the order given
        rows = [[o.seq for o in order].index(s) for s in seqs]  # torch's order may differ
        assert torch.equal(native[1], logits[rows]), (native[1] - logits[rows]).abs().max()
        for got, want in zip(after_native, caches(runner), strict=True):
            assert torch.equal(got, want)
        for s in seqs:
            s.num_computed_tokens += 1
    return steps


PROMPTS = [[5, 9, 3, 7, 11, 40, 2, 8, 13], [17, 4, 200], [250, 6, 6, 6, 31, 8, 1, 90, 91, 92, 93]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_steps_equal_the_torch_path(checkpoint, dtype):
    runner, blocks = runner_for(checkpoint, dtype)
    assert runner.native_step is not None
    decode_both_ways(runner, blocks, PROMPTS, steps=9)


def test_a_step_stopped_by_its_interrupt_raises_and_runs_again_exactly(checkpoint):
    """The flag an interactive arrival raises (worker.model.step_interrupt) stops the step
    before its first layer; the step run again gives the torch path's logits and K/V."""
    runner, blocks = runner_for(checkpoint, torch.bfloat16)
    assert runner.native_step is not None
    decode_both_ways(runner, blocks, PROMPTS, steps=3, stopped_first=True)


@pytest.mark.parametrize("method", ["int4", "int8"])
def test_quantized_bases_equal_the_torch_path(checkpoint, method):
    """A base quantized on load, bf16 rows: the quantized kernel adds its fp32 sums to the
    fp32 residual stream on both paths; int4 output layer too."""
    runner, blocks = runner_for(checkpoint, torch.bfloat16, OnLoad.of(method, lm_head="int4"))
    assert runner.native_step is not None
    decode_both_ways(runner, blocks, PROMPTS, steps=5)


def test_a_cut_down_output_layer(checkpoint):
    kept = torch.tensor([2, 5, 9, 40, 41, 77, 100, 255])
    runner, blocks = runner_for(checkpoint, torch.bfloat16, output_token_ids=kept)
    decode_both_ways(runner, blocks, PROMPTS[:2], steps=3, kept_only=True)
    decode_both_ways(runner, blocks, PROMPTS[2:], steps=2)  # widened to the vocabulary


def test_steps_it_does_not_take_go_through_torch(checkpoint):
    """Prefills, several tokens a sequence, a row that does not sample, drafts to verify,
    an adapter: None, and the runner's torch path serves them."""
    runner, blocks = runner_for(checkpoint, torch.bfloat16)
    s = Sequence("a", [5, 9, 3, 7, 11], None, 0)
    blocks.allocate(s.block_table, 12)
    assert runner._execute_native_step([ScheduledSequence(s, 0, 5)], False) is None
    runner.execute([ScheduledSequence(s, 0, 5)])
    s.num_computed_tokens = 5
    s.tokens += [8, 1]  # two tokens to feed
    assert runner._execute_native_step([ScheduledSequence(s, 5, 2)], False) is None
    assert not ScheduledSequence(s, 5, 1).samples
    assert runner._execute_native_step([ScheduledSequence(s, 5, 1)], False) is None
    runner.execute([ScheduledSequence(s, 5, 1)])
    s.num_computed_tokens = 6
    assert runner._execute_native_step([ScheduledSequence(s, 6, 1)], False) is not None
    assert runner._execute_native_step([ScheduledSequence(s, 6, 1, num_spec=1)], False) is None
    s.adapter_id = "someone"
    assert runner._execute_native_step([ScheduledSequence(s, 6, 1)], False) is None


def test_no_step_over_a_kernel_it_cannot_call(checkpoint):
    """oneDNN's matmul (the fixed rule's fp32 kernel on AVX-512) is not called from C."""
    runner, _ = runner_for(checkpoint, torch.float32, plan=LinearPlan(ONEDNN, ONEDNN))
    assert runner.native_step is None


def test_no_step_for_a_draft_model(checkpoint):
    """A draft's approximate 4-bit copies are its own native pass's (draft_cpu.c)."""
    model = LlamaModel.from_pretrained(checkpoint, dtype=torch.float32, quantization="int4")
    runner = ModelRunner(model, num_blocks=16, block_size=BLOCK)
    assert runner.native_step is None


def compare_every_step(runner) -> dict[str, int]:
    """Wrap ``runner.execute``: each step the native step takes runs natively, then again
    through torch over the same slots, and both must agree bit for bit (logits and caches);
    steps it refuses run through torch. Returns the counts of each, updated as steps run."""
    original, step = runner.execute, runner.native_step
    counts = {"native": 0, "torch": 0}

    def through_torch(scheduled, kept_only):
        runner.native_step = None
        try:
            return original(scheduled, kept_only=kept_only)
        finally:
            runner.native_step = step

    def execute(scheduled, *, kept_only=False):
        native = runner._execute_native_step(scheduled, kept_only)
        if native is None:
            counts["torch"] += 1
            return through_torch(scheduled, kept_only)
        after_native = caches(runner)
        order, logits = through_torch(scheduled, kept_only)
        rows = [[o.seq for o in order].index(s.seq) for s in native[0]]
        assert torch.equal(native[1], logits[rows]), (native[1] - logits[rows]).abs().max()
        for got, want in zip(after_native, caches(runner), strict=True):
            assert torch.equal(got, want)
        counts["native"] += 1
        return native

    runner.execute = execute
    return counts


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_lora_rows_equal_the_torch_path(checkpoint, tmp_path, dtype):
    """Mixed batches of base rows and plain adapters (all projections; q and v only, so some
    groups go unused) through the native LoRA kernel: every decode step taken natively once
    the adapters are in slots. A DoRA adapter's steps stay with torch."""
    from factories import make_peft_adapter
    from worker import LLM, SamplingParams

    all_modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    adapters = {
        "all": make_peft_adapter(checkpoint, tmp_path / "all", rank=8, targets=all_modules),
        "qv": make_peft_adapter(checkpoint, tmp_path / "qv", rank=4, targets=["q_proj", "v_proj"]),
        "dora": make_peft_adapter(
            checkpoint, tmp_path / "dora", rank=4, targets=["o_proj"], use_dora=True, seed=2
        ),
    }
    # fp32: batch-invariant products, the native panels whatever the CPU (see runner_for)
    options = {"batch_invariant": True} if dtype == "float32" else {"kernel_choice": "fixed"}
    llm = LLM(checkpoint, dtype=dtype, max_loras=3, **options)
    for name, path in adapters.items():
        llm.load_adapter(name, path)
    runner = llm.engine.runner
    if runner.native_step is None:
        pytest.skip(f"{dtype}: the fixed plan's projections are oneDNN's on this CPU")
    model = runner.model  # the native activation on every CPU (see runner_for)
    model.ops = dataclasses.replace(model.ops, activation=KernelPlan(NATIVE, NATIVE))
    counts = compare_every_step(runner)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[0][:4]]
    outputs = llm.generate(prompts, params, adapters=[None, "all", "qv", "all"])
    assert counts["native"] >= 5, counts
    base_only = llm.generate(prompts, params)
    assert base_only[1].token_ids != outputs[1].token_ids  # the adapters matter here
    before = dict(counts)
    llm.generate([PROMPTS[0]], params, adapters=["dora"])
    assert counts["native"] == before["native"]  # DoRA's steps: torch's


def test_a_runner_with_the_native_step_takes_native_ops_for_few_rows(checkpoint):
    """A measured plan that gives the activation to torch up to 4 rows (as on a Zen 3) would
    keep every small decode step off the native step: the runner widens it
    (OpPlans.for_native_step), and a one-row step then runs natively, equal to torch's path."""
    ops = dataclasses.replace(
        fixed_op_plans(torch.float32), activation=KernelPlan(TORCH, NATIVE, 4, "measured")
    )
    model = LlamaModel.from_pretrained(
        checkpoint, dtype=torch.float32, linear_plan=LinearPlan(PANELS, PANELS), op_plans=ops
    )
    if native_activation() is None or native_step() is None:
        pytest.skip("no native activation here")
    runner = ModelRunner(model, num_blocks=64, block_size=BLOCK)
    assert runner.native_step is not None
    assert model.ops.activation.kernel_for(1) == NATIVE
    blocks = BlockManager(num_blocks=64, block_size=BLOCK, enable_caching=False)
    assert decode_both_ways(runner, blocks, [PROMPTS[0]], steps=3) == 3
