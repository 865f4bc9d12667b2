"""A lone tenant's burst of prompts (worker/core/burst.py): short steps, decodes waiting behind
at most a full step of prompt tokens; exact plans per step, and the engine's tokens unchanged."""

from __future__ import annotations

import pytest
import torch

from factories import load_hf_model, make_checkpoint, pretend_step, random_prompts
from worker import LLM, SamplingParams
from worker.core.block_manager import BlockManager
from worker.core.scheduler import Scheduler
from worker.core.sequence import Band, Sequence
from worker.sampling.sampling_params import SamplingParams as Params


def make_scheduler(*, burst: int | None = 4, max_tokens: int = 16) -> Scheduler:
    return Scheduler(
        block_manager=BlockManager(num_blocks=64, block_size=4),
        max_num_seqs=16,
        max_num_batched_tokens=max_tokens,
        burst_prefill_tokens=burst,
    )


def make_seq(order: int, prompt_len: int, tenant: str = "t", band=Band.INTERACTIVE) -> Sequence:
    prompt = list(range(3 + 50 * order, 3 + 50 * order + prompt_len))  # no shared prefixes
    return Sequence(f"r{order}", prompt, Params(), order, tenant=tenant, band=band)


def test_a_burst_runs_in_short_steps_and_decodes_wait_behind_one_full_step_of_prompts():
    sched = make_scheduler(burst=4, max_tokens=16)
    for i in range(10):
        sched.add(make_seq(i, 4))
    # 40 prompt tokens wait, more than a full step (16): prompts only, a chunk a step, while
    # the prompt tokens since the decodes last ran stay within a full step: 4, 8, 12, 16.
    assert pretend_step(sched) == [("r0", 0, 4)]
    assert pretend_step(sched) == [("r1", 0, 4)]
    assert pretend_step(sched) == [("r2", 0, 4)]
    assert pretend_step(sched) == [("r3", 0, 4)]
    # Another chunk would make r0 wait behind more than 16: the decodes come first, then
    # prompts fill what the step allows (the decodes plus 16 prompt tokens at most, never
    # more than max_num_batched_tokens).
    assert pretend_step(sched) == [
        ("r0", 4, 1), ("r1", 4, 1), ("r2", 4, 1), ("r3", 4, 1),
        ("r4", 0, 4), ("r5", 0, 4), ("r6", 0, 4),
    ]  # fmt: skip
    # 12 prompt tokens left, one step's worth: no burst, decodes first and prompts fill it.
    assert pretend_step(sched) == [(f"r{i}", 5 if i < 4 else 4, 1) for i in range(7)] + [
        ("r7", 0, 4), ("r8", 0, 4), ("r9", 0, 1),
    ]  # fmt: skip


def test_without_the_rule_decodes_go_first_and_prompts_fill_the_step():
    sched = make_scheduler(burst=None, max_tokens=16)
    for i in range(10):
        sched.add(make_seq(i, 4))
    assert pretend_step(sched) == [(f"r{i}", 0, 4) for i in range(4)]
    assert pretend_step(sched) == [(f"r{i}", 4, 1) for i in range(4)] + [
        ("r4", 0, 4), ("r5", 0, 4), ("r6", 0, 4),
    ]  # fmt: skip


@pytest.mark.parametrize("prompts", [[8], [6, 6]], ids=["one prompt", "a step's worth"])
def test_prompts_that_one_step_computes_are_no_burst(prompts):
    sched = make_scheduler(burst=4, max_tokens=16)
    sched.add(make_seq(0, 4))
    assert pretend_step(sched) == [("r0", 0, 4)]
    for i, n in enumerate(prompts, start=1):
        sched.add(make_seq(i, n))
    placed = [(f"r{i}", 0, n) for i, n in enumerate(prompts, start=1)]
    assert pretend_step(sched) == [("r0", 4, 1), *placed]


@pytest.mark.parametrize(
    "neighbour",
    [dict(tenant="u"), dict(tenant="t", band=Band.BATCH)],
    ids=["another tenant decodes", "batch work"],
)
def test_the_rule_holds_only_for_one_tenant_with_interactive_work(neighbour):
    """Another tenant's decodes are the step budget's to guard, and batch work the bands':
    the burst rule never makes them wait."""
    sched = make_scheduler(burst=4, max_tokens=16)
    sched.add(make_seq(0, 4, **neighbour))
    assert pretend_step(sched) == [("r0", 0, 4)]
    for i in range(1, 8):
        sched.add(make_seq(i, 4))  # 28 prompt tokens: a burst, were r0 not there
    plan = pretend_step(sched)
    assert plan[0] == ("r0", 4, 1)
    assert sum(n for _, _, n in plan) > 4  # full steps: the prompts are not cut to chunks


def test_a_tenant_that_just_left_still_counts_as_active():
    """Within ACTIVE_GRACE_S of another tenant's last sequence leaving (a closed loop's next
    question is on its way), the step budget guards it and the burst rule waits."""
    sched = make_scheduler(burst=4, max_tokens=16)
    sched.add(make_seq(0, 4))
    other = make_seq(1, 4, tenant="u")
    sched.add(other)
    pretend_step(sched)
    sched.remove(other)
    for i in range(2, 9):
        sched.add(make_seq(i, 4))  # 28 prompt tokens
    plan = pretend_step(sched)
    assert plan[0] == ("r0", 4, 1) and sum(n for _, _, n in plan) == 16


def test_decodes_carrying_drafts_are_placed_with_them():
    """Drafts were proposed for this step: the rule stands aside while any decode has them."""
    sched = make_scheduler(burst=4, max_tokens=16)
    first = make_seq(0, 4)
    sched.add(first)
    pretend_step(sched)
    first.spec_token_ids = [9]
    for i in range(1, 8):
        sched.add(make_seq(i, 4))  # 28 prompt tokens
    out = sched.schedule()
    assert (out.scheduled[0].seq, out.scheduled[0].num_spec) == (first, 1)
    assert out.num_tokens == 16


def test_the_worker_flag_sets_the_rule_and_0_turns_it_off():
    from switchboard.cli import build_parser
    from switchboard.worker_command import worker_engine_kwargs

    def kwargs(*flags):
        return worker_engine_kwargs(build_parser().parse_args(["worker", *flags]))

    assert kwargs()["burst_prefill_tokens"] == 512
    assert kwargs("--burst-prefill-tokens", "256")["burst_prefill_tokens"] == 256
    assert kwargs("--burst-prefill-tokens", "0")["burst_prefill_tokens"] is None


def test_decodes_are_placed_when_no_prompt_can_start():
    """A burst step whose prompts find no seat does not leave the decodes idle."""
    sched = Scheduler(
        block_manager=BlockManager(num_blocks=64, block_size=4),
        max_num_seqs=1,
        max_num_batched_tokens=16,
        burst_prefill_tokens=4,
    )
    sched.add(make_seq(0, 4))
    assert pretend_step(sched) == [("r0", 0, 4)]
    sched.add(make_seq(1, 12))
    sched.add(make_seq(2, 12))
    assert pretend_step(sched) == [("r0", 4, 1)]
    assert pretend_step(sched) == [("r0", 5, 1)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("burst"), seed=3)


def test_the_engine_computes_the_same_tokens_with_and_without_the_rule(checkpoint):
    """fp32: every token equals the plain schedule's and transformers' greedy decoding."""
    prompts = random_prompts(12, min_len=20, max_len=60, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = {}
    for burst in (None, 32):
        llm = LLM(
            checkpoint, dtype="float32", block_size=4, num_kv_blocks=512,
            max_num_batched_tokens=128, burst_prefill_tokens=burst,
        )  # fmt: skip
        outputs[burst] = [o.token_ids for o in llm.generate(prompts, params)]
        llm.shutdown()
    assert outputs[32] == outputs[None]
    hf = load_hf_model(checkpoint)
    for prompt, tokens in zip(prompts[:3], outputs[32], strict=False):
        reference = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
        assert tokens == reference[0, len(prompt) :].tolist()
