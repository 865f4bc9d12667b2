"""Scheduler scenarios without a model: who runs, how many tokens, who gets preempted."""

from worker.block_manager import BlockManager
from worker.sampling_params import SamplingParams
from worker.scheduler import Scheduler
from worker.sequence import Sequence, SequenceStatus


def make_scheduler(*, num_blocks=16, block_size=4, max_num_seqs=8, max_tokens=32) -> Scheduler:
    return Scheduler(
        block_manager=BlockManager(num_blocks=num_blocks, block_size=block_size),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_tokens,
    )


def make_seq(order: int, prompt_len: int) -> Sequence:
    return Sequence(f"r{order}", list(range(3, 3 + prompt_len)), SamplingParams(), order)


def run_step(sched: Scheduler) -> list[tuple[str, int, int]]:
    """Schedule one step and pretend the model ran it; sampled sequences get a token."""
    out = sched.schedule()
    plan = [(s.seq.request_id, s.start, s.num_tokens) for s in out.scheduled]
    for s in out.scheduled:
        s.seq.num_computed_tokens += s.num_tokens
        if s.samples:
            s.seq.append_token(7)
    return plan


def test_prefill_is_chunked_under_the_token_budget_and_decodes_go_first():
    sched = make_scheduler(max_tokens=8)
    a, b = make_seq(0, 6), make_seq(1, 10)
    sched.add(a)
    sched.add(b)
    assert run_step(sched) == [("r0", 0, 6), ("r1", 0, 2)]
    # a decodes (1 token) before b's prefill continues with the remaining budget.
    assert run_step(sched) == [("r0", 6, 1), ("r1", 2, 7)]
    assert run_step(sched) == [("r0", 7, 1), ("r1", 9, 1)]
    assert len(a.output_token_ids) == 3 and len(b.output_token_ids) == 1


def test_max_num_seqs_caps_the_running_set():
    sched = make_scheduler(max_num_seqs=2)
    seqs = [make_seq(i, 3) for i in range(3)]
    for s in seqs:
        sched.add(s)
    assert [r for r, _, _ in run_step(sched)] == ["r0", "r1"]
    assert seqs[2].status is SequenceStatus.WAITING
    sched.remove(seqs[0])
    assert [r for r, _, _ in run_step(sched)] == ["r1", "r2"]


def test_latest_arrival_is_preempted_when_blocks_run_out_and_resumes_first():
    # 4 blocks of 4 tokens: two prompts of 8 tokens fill the pool exactly.
    sched = make_scheduler(num_blocks=4, block_size=4, max_tokens=64)
    a, b = make_seq(0, 8), make_seq(1, 8)
    sched.add(a)
    sched.add(b)
    assert run_step(sched) == [("r0", 0, 8), ("r1", 0, 8)]
    # Both now need a 3rd block for token 9: r1 (latest) is preempted, r0 decodes.
    assert run_step(sched) == [("r0", 8, 1)]
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0
    assert b.block_table == [] and sched.num_preemptions == 1
    assert list(sched.waiting) == [b]
    sched.remove(a)
    # b comes back by recomputing its prompt and its sampled token together.
    assert run_step(sched) == [("r1", 0, 9)]
    sched.remove(b)
    assert sched.block_manager.num_free_blocks == 4


def test_preempting_a_sequence_already_scheduled_this_step_gives_back_its_place():
    sched = make_scheduler(num_blocks=4, block_size=2, max_tokens=4)
    late, early = make_seq(1, 2), make_seq(0, 6)
    sched.add(late)  # queued first, but the later arrival
    sched.add(early)
    assert run_step(sched) == [("r1", 0, 2), ("r0", 0, 2)]
    # late's decode is placed first (block 2), then early's chunk needs two more blocks
    # with one free: late, the latest arrival, is preempted and loses its place.
    assert run_step(sched) == [("r0", 2, 3)]
    assert late.status is SequenceStatus.WAITING and late.block_table == []
    assert early.block_table == [1, 3, 2]
    assert sched.block_manager.num_free_blocks == 1


def test_remove_frees_blocks_of_waiting_and_running_sequences():
    sched = make_scheduler()
    a, b = make_seq(0, 5), make_seq(1, 5)
    sched.add(a)
    run_step(sched)
    sched.add(b)
    sched.remove(a)
    sched.remove(b)
    assert not sched.has_work
    assert sched.block_manager.num_free_blocks == 16
