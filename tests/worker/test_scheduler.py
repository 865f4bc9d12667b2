"""Scheduler scenarios without a model: who runs, how many tokens, who gets preempted."""

from factories import pretend_step
from worker.core.adapter_mix import AdapterMix
from worker.core.batch import BlockMove, MoveKind
from worker.core.block_manager import BlockManager
from worker.core.scheduler import Scheduler
from worker.core.sequence import Sequence, SequenceStatus
from worker.sampling.sampling_params import SamplingParams


def make_scheduler(
    *, num_blocks=16, block_size=4, max_num_seqs=8, max_tokens=32, max_loras=0, host_blocks=0
) -> Scheduler:
    host = BlockManager(num_blocks=host_blocks, block_size=block_size) if host_blocks else None
    return Scheduler(
        block_manager=BlockManager(num_blocks=num_blocks, block_size=block_size),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_tokens,
        max_loras=max_loras,
        preemption_mode="swap" if host_blocks else "recompute",
        host_block_manager=host,
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


def make_lora_seq(order: int, adapter: str | None, prompt_len: int = 2) -> Sequence:
    seq = make_seq(order, prompt_len)
    seq.adapter_id = adapter
    return seq


def running_ids(sched: Scheduler) -> list[str]:
    return sorted(s.request_id for s in sched.running)


def test_at_most_max_loras_adapters_run_and_others_overtake_a_blocked_request():
    sched = make_scheduler(max_loras=2)
    reqs = [
        make_lora_seq(0, "A"),
        make_lora_seq(1, "B"),
        make_lora_seq(2, "C"),  # no third slot
        make_lora_seq(3, None),  # the base model needs no slot
        make_lora_seq(4, "A"),  # A already has a slot
    ]
    for seq in reqs:
        sched.add(seq)
    run_step(sched)
    assert running_ids(sched) == ["r0", "r1", "r3", "r4"]
    assert reqs[2].lora_wait_steps == 1
    sched.remove(reqs[0])
    sched.remove(reqs[4])  # A drained: its slot frees up for C
    run_step(sched)
    assert running_ids(sched) == ["r1", "r2", "r3"]


def test_a_stream_of_requests_for_running_adapters_cannot_starve_another_adapter():
    sched = make_scheduler(max_num_seqs=64, max_loras=1, num_blocks=256)
    sched.max_lora_wait_steps = 3
    sched.add(make_lora_seq(0, "A"))
    sched.add(make_lora_seq(1, "B"))
    order = 2
    for _ in range(3):  # B is passed over while new A requests keep arriving
        sched.add(make_lora_seq(order, "A"))
        order += 1
        run_step(sched)
    assert "r1" not in running_ids(sched)
    # B has waited long enough: new A requests are held back until A drains.
    late_a = make_lora_seq(order, "A")
    sched.add(late_a)
    run_step(sched)
    assert late_a.status is SequenceStatus.WAITING
    for seq in list(sched.running):
        sched.remove(seq)
    run_step(sched)
    assert running_ids(sched) == ["r1"]
    assert late_a.status is SequenceStatus.WAITING  # B holds the only slot now


def make_mix_seq(order: int, adapters: list[str]) -> Sequence:
    seq = make_seq(order, 2)
    seq.adapter_mix = AdapterMix.of([(a, 0.5) for a in adapters], max_adapters=8)
    seq.adapter_id = seq.adapter_mix.key
    return seq


def test_a_mix_holds_a_slot_for_each_of_its_adapters():
    sched = make_scheduler(max_loras=3)
    reqs = [
        make_lora_seq(0, "A"),
        make_mix_seq(1, ["B", "C"]),  # A, B, C: three slots
        make_mix_seq(2, ["C", "D"]),  # D would be a fourth
        make_lora_seq(3, "B"),  # B runs in the mix: no new slot
        make_mix_seq(4, ["A", "C"]),  # both running
        make_lora_seq(5, None),
    ]
    for seq in reqs:
        sched.add(seq)
    run_step(sched)
    assert running_ids(sched) == ["r0", "r1", "r3", "r4", "r5"]
    assert reqs[2].lora_wait_steps == 1
    sched.remove(reqs[1])
    sched.remove(reqs[3])  # B drained; C still runs in r4's mix
    run_step(sched)
    assert "r2" in running_ids(sched)  # A, C, D


def test_a_mix_kept_out_by_single_adapters_gets_its_slots_once_they_drain():
    sched = make_scheduler(max_num_seqs=64, max_loras=2, num_blocks=256)
    sched.max_lora_wait_steps = 2
    sched.add(make_lora_seq(0, "C"))
    sched.add(make_lora_seq(1, "D"))
    mix = make_mix_seq(2, ["A", "B"])
    sched.add(mix)
    order = 3
    for _ in range(3):  # C and D keep both slots busy
        sched.add(make_lora_seq(order, "C" if order % 2 else "D"))
        order += 1
        run_step(sched)
    assert mix.status is SequenceStatus.WAITING
    late = make_lora_seq(order, "C")  # running adapter, but the mix has waited long enough
    sched.add(late)
    run_step(sched)
    assert late.status is SequenceStatus.WAITING
    for seq in list(sched.running):
        sched.remove(seq)
    run_step(sched)
    assert running_ids(sched) == ["r2"]
    assert late.status is SequenceStatus.WAITING  # A and B hold both slots
    sched.remove(mix)
    run_step(sched)
    assert late.status is SequenceStatus.RUNNING


def run_step_with_cache(sched: Scheduler) -> list[tuple[str, int, int]]:
    """Like run_step, but through ``mark_computed``, so full blocks get cached."""
    return pretend_step(sched)


def test_a_cached_prefix_is_skipped_and_costs_no_budget():
    sched = make_scheduler(max_tokens=4)
    first = make_seq(0, 10)
    sched.add(first)
    assert run_step_with_cache(sched) == [("r0", 0, 4)]
    assert run_step_with_cache(sched) == [("r0", 4, 4)]
    assert run_step_with_cache(sched) == [("r0", 8, 2)]
    sched.remove(first)
    again = make_seq(1, 10)  # same tokens
    sched.add(again)
    # Two full blocks (8 tokens) come from the cache: only the last 2 are computed.
    assert run_step_with_cache(sched) == [("r1", 8, 2)]
    assert again.num_cached_tokens == 8 and again.block_table[:2] == [0, 1]
    stats = sched.block_manager.stats
    assert (stats.queries, stats.hits) == (20, 8) and stats.hit_rate == 0.4


def test_swap_preemption_keeps_the_computed_tokens_and_resumes_before_new_arrivals():
    # 4 blocks of 4: two 8-token prompts fill the pool; the host pool has room for one.
    sched = make_scheduler(num_blocks=4, block_size=4, max_tokens=64, host_blocks=2)
    a, b = make_seq(0, 8), make_seq(1, 8)
    sched.add(a)
    sched.add(b)
    run_step(sched)
    assert a.block_table == [0, 1] and b.block_table == [2, 3]
    out = sched.schedule()
    # b (latest) is swapped out: its blocks go to host blocks 0 and 1, its progress stays.
    assert out.preempted == [b] and b.status is SequenceStatus.SWAPPED
    assert out.moves == [BlockMove(MoveKind.SWAP_OUT, 2, 0), BlockMove(MoveKind.SWAP_OUT, 3, 1)]
    assert b.num_computed_tokens == 8 and b.block_table == [] and b.host_block_table == [0, 1]
    assert [(s.seq.request_id, s.start, s.num_tokens) for s in out.scheduled] == [("r0", 8, 1)]
    a.num_computed_tokens += 1
    a.append_token(7)
    late = make_seq(2, 2)
    sched.add(late)
    sched.remove(a)
    # b comes back before the new arrival, decoding its one uncomputed token at once.
    out = sched.schedule()
    assert [(s.seq.request_id, s.start, s.num_tokens) for s in out.scheduled] == [
        ("r1", 8, 1),
        ("r2", 0, 2),
    ]
    assert out.moves[:2] == [
        BlockMove(MoveKind.SWAP_IN, 0, b.block_table[0]),
        BlockMove(MoveKind.SWAP_IN, 1, b.block_table[1]),
    ]
    assert sched.host_block_manager.num_free_blocks == 2
    assert sched.num_preemptions == 1 and b.status is SequenceStatus.RUNNING


def test_swap_falls_back_to_recompute_when_the_host_pool_is_full():
    sched = make_scheduler(num_blocks=4, block_size=4, max_tokens=64, host_blocks=1)
    a, b = make_seq(0, 8), make_seq(1, 8)
    sched.add(a)
    sched.add(b)
    run_step(sched)
    out = sched.schedule()
    assert out.preempted == [b] and b.status is SequenceStatus.WAITING
    assert b.num_computed_tokens == 0 and out.moves == []


def test_a_forked_sequence_copies_the_shared_partial_block_on_its_first_write():
    sched = make_scheduler(num_blocks=8, block_size=4)
    parent = make_seq(0, 6)
    sched.add(parent)
    run_step_with_cache(sched)  # prompt computed: blocks [0, 1], one token sampled
    child = make_seq(1, 6)
    sched.fork(parent, child)
    child.append_token(9)  # its own first sample
    out = sched.schedule()
    assert [(s.seq.request_id, s.start) for s in out.scheduled] == [("r0", 6), ("r1", 6)]
    # The parent writes first and copies; the child is then the only holder of block 1.
    assert out.moves == [BlockMove(MoveKind.COPY, 1, 2)]
    assert parent.block_table == [0, 2] and child.block_table == [0, 1]
    sched.remove(parent)
    sched.remove(child)
    assert sched.block_manager.num_free_blocks == 8
