"""The scheduler's bands without a model (worker/core/scheduler.py): batch work fills idle
capacity and gives it back at once; exact plans per step."""

from __future__ import annotations

import pytest

from worker.core.block_manager import BlockManager
from worker.core.scheduler import Scheduler
from worker.core.sequence import Band, Sequence, SequenceStatus
from worker.sampling.sampling_params import SamplingParams

INT, B = Band.INTERACTIVE, Band.BATCH


def make_scheduler(*, num_blocks=16, block_size=4, max_num_seqs=8, max_tokens=32) -> Scheduler:
    return Scheduler(
        block_manager=BlockManager(num_blocks=num_blocks, block_size=block_size),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_tokens,
    )


def make_seq(order: int, prompt_len: int, band: Band, tenant: str = "t") -> Sequence:
    prompt = list(range(3 + 50 * order, 3 + 50 * order + prompt_len))  # no shared prefixes
    return Sequence(f"r{order}", prompt, SamplingParams(), order, tenant=tenant, band=band)


def run_step(sched: Scheduler) -> list[tuple[str, int, int]]:
    out = sched.schedule()
    plan = [(s.seq.request_id, s.start, s.num_tokens) for s in out.scheduled]
    sched.mark_computed(out)
    for s in out.scheduled:
        if s.samples:
            s.seq.append_token(7)
    return plan


@pytest.mark.parametrize("tenants", [("a", "a"), ("a", "b")])
def test_an_interactive_prompt_is_placed_before_a_batch_prompt_that_came_first(tenants):
    sched = make_scheduler(max_tokens=8)
    batch, chat = make_seq(0, 8, B, tenants[0]), make_seq(1, 8, INT, tenants[1])
    sched.add(batch)
    sched.add(chat)
    assert run_step(sched) == [("r1", 0, 8)]
    assert run_step(sched) == [("r1", 8, 1), ("r0", 0, 7)]


def test_batch_work_alone_fills_the_whole_step():
    """With no interactive work, batch sequences are scheduled exactly as interactive ones."""
    plans = []
    for band in (INT, B):
        sched = make_scheduler(max_tokens=8)
        for i in range(3):
            sched.add(make_seq(i, 5, band, tenant=f"t{i}"))
        plans.append([run_step(sched) for _ in range(3)])
    assert plans[0] == plans[1]


def test_an_interactive_arrival_takes_a_seat_from_the_latest_batch_sequence():
    sched = make_scheduler(max_num_seqs=2)
    early, late = make_seq(0, 4, B), make_seq(1, 4, B)
    sched.add(early)
    sched.add(late)
    run_step(sched)
    chat = make_seq(2, 4, INT, tenant="u")
    sched.add(chat)
    assert run_step(sched) == [("r0", 4, 1), ("r2", 0, 4)]
    assert late.status is SequenceStatus.WAITING and late.block_table == []
    assert sched.num_preemptions == 1


def test_a_batch_arrival_never_takes_room_from_interactive_work():
    sched = make_scheduler(max_num_seqs=2)
    for i in range(2):
        sched.add(make_seq(i, 4, INT))
    run_step(sched)
    batch = make_seq(2, 4, B, tenant="u")
    sched.add(batch)
    for _ in range(3):
        assert [r for r, _, _ in run_step(sched)] == ["r0", "r1"]
    assert batch.status is SequenceStatus.WAITING and sched.num_preemptions == 0


def test_when_blocks_run_out_a_batch_sequence_goes_first_even_if_it_came_first():
    # 4 blocks of 4: two prompts of 8 fill the pool; both need a 3rd block for token 9.
    sched = make_scheduler(num_blocks=4, block_size=4, max_tokens=64)
    batch, chat = make_seq(0, 8, B), make_seq(1, 8, INT)
    sched.add(batch)
    sched.add(chat)
    assert run_step(sched) == [("r1", 0, 8), ("r0", 0, 8)]
    assert run_step(sched) == [("r1", 8, 1)]
    assert batch.status is SequenceStatus.WAITING and chat.status is SequenceStatus.RUNNING
    sched.remove(chat)
    # Back at once when the room is free again (its first block still in the prefix cache).
    assert run_step(sched) == [("r0", 4, 5)]


def test_the_wire_priority_is_a_band_and_an_unknown_one_is_refused():
    from rpc import worker_pb2
    from worker.errors import InvalidRequestError
    from worker.serving.servicer import band_of

    assert band_of(worker_pb2.PRIORITY_INTERACTIVE) is INT
    assert band_of(worker_pb2.PRIORITY_BATCH) is B
    with pytest.raises(InvalidRequestError, match="priority"):
        band_of(7)


def test_beside_interactive_decodes_batch_decodes_take_turns_within_a_tenth_of_the_step():
    """Steps cost 10 ms for 1 token, 20 ms for 16: a step of one interactive decode may
    take 11 ms, so one batch row rides along (bands.batch_token_room), each in turn; once
    the interactive request ends, every batch row decodes."""
    from worker.core.bands import batch_token_room
    from worker.core.step_budget import DecodeStepBudget, StepTimes

    times = StepTimes({1: 0.010, 16: 0.020, 64: 0.050})
    assert batch_token_room(times, 1) == 1
    assert batch_token_room(times, 0) == 320  # alone: within BATCH_STEP_S (0.25 s)
    sched = make_scheduler(max_tokens=64)
    sched.step_budget = DecodeStepBudget(times, 1.0)
    batch = [make_seq(i, 4, B, tenant="bulk") for i in range(3)]
    for seq in batch:
        sched.add(seq)
    assert [r for r, _, _ in run_step(sched)] == ["r0", "r1", "r2"]  # alone: all of them
    chat = make_seq(3, 4, INT, tenant="chat")
    sched.add(chat)
    run_step(sched)  # the chat's prompt
    plans = [{r for r, _, _ in run_step(sched)} for _ in range(3)]
    assert all("r3" in plan and len(plan) == 2 for plan in plans), plans
    assert sorted(r for plan in plans for r in plan - {"r3"}) == ["r0", "r1", "r2"]  # in turns
    sched.remove(chat)
    sched.batch_band.interactive_left_at = -1e9  # long ago (just after, see the next test)
    assert [r for r, _, _ in run_step(sched)] == ["r0", "r1", "r2"]


def test_a_batch_alone_takes_steps_no_longer_than_what_an_arrival_may_wait_for():
    """Steps cost 10 ms a token here: alone, batch work feeds 25 tokens a step
    (bands.BATCH_STEP_S, 0.25 s): every decode, then the lines' prompts in chunks of what is
    left, so an interactive arrival waits for a short step; each prompt goes on where it
    stopped."""
    from worker.core.step_budget import DecodeStepBudget, StepTimes

    sched = make_scheduler(num_blocks=32, max_tokens=64)
    sched.step_budget = DecodeStepBudget(StepTimes({1: 0.010, 64: 0.640}), 1.0)
    sched.batch_band.interactive_left_at = -1e9
    for i in range(3):
        sched.add(make_seq(i, 20, B, tenant="bulk"))
    plans = [run_step(sched) for _ in range(4)]
    assert plans == [
        [("r0", 0, 20), ("r1", 0, 5)],
        [("r0", 20, 1), ("r1", 5, 15), ("r2", 0, 9)],
        [("r0", 21, 1), ("r1", 20, 1), ("r2", 9, 11)],
        [("r0", 22, 1), ("r1", 21, 1), ("r2", 20, 1)],
    ]


def test_an_interactive_prompt_is_not_cut_to_guard_batch_decodes():
    """The step budget (a 20-token cap beside decodes) guards other tenants' decodes against
    a long prompt; batch decodes are not guarded: the chat's 40-token prompt goes whole."""
    from worker.core.step_budget import DecodeStepBudget, StepTimes

    times = StepTimes({1: 0.010, 16: 0.020, 64: 0.050})
    sched = make_scheduler(max_tokens=64)
    sched.step_budget = DecodeStepBudget(times, 0.0225)  # 20 tokens
    for i in range(2):
        sched.add(make_seq(i, 4, B, tenant="bulk"))
    run_step(sched)
    sched.add(make_seq(2, 40, INT, tenant="chat"))
    plan = run_step(sched)
    assert ("r2", 0, 40) in plan


@pytest.mark.parametrize("steps_stop", [False, True], ids=["steps-not-stopped", "steps-stopped"])
def test_just_after_an_interactive_request_ends_batch_steps_stay_short(steps_stop):
    """A closed-loop client's next request comes just after its answer: for ACTIVE_GRACE_S
    batch work keeps to the room beside one interactive decode, then fills the step again;
    unless an arrival stops a step of batch work alone (``BatchBand.steps_stop``: one rank), when
    it fills the next step at once."""
    from worker.core.step_budget import ACTIVE_GRACE_S, DecodeStepBudget, StepTimes

    times = StepTimes({1: 0.010, 16: 0.020, 64: 0.050})
    sched = make_scheduler(max_tokens=64)
    sched.batch_band.steps_stop = steps_stop
    sched.step_budget = DecodeStepBudget(times, 1.0)
    for i in range(3):
        sched.add(make_seq(i, 4, B, tenant="bulk"))
    chat = make_seq(3, 4, INT, tenant="chat")
    sched.add(chat)
    run_step(sched)
    sched.remove(chat)
    assert len(run_step(sched)) == (3 if steps_stop else 1)  # else the room beside one decode
    sched.batch_band.interactive_left_at -= ACTIVE_GRACE_S
    assert len(run_step(sched)) == 3


def banded_scheduler(**fairness) -> Scheduler:
    """Steps cost 10 ms for 1 token, 20 ms for 16: beside one interactive decode a step may
    carry one batch row (``bands.batch_token_room``)."""
    from worker.core.config import FairnessConfig
    from worker.core.step_budget import DecodeStepBudget, StepTimes

    sched = Scheduler(
        block_manager=BlockManager(num_blocks=32, block_size=4),
        max_num_seqs=8,
        max_num_batched_tokens=64,
        fairness=FairnessConfig(**fairness),
    )
    sched.step_budget = DecodeStepBudget(StepTimes({1: 0.010, 16: 0.020, 64: 0.050}), 1.0)
    return sched


def test_a_step_with_an_interactive_prompt_carries_no_batch_rows_and_they_keep_their_turn():
    sched = banded_scheduler()
    for i in range(3):
        sched.add(make_seq(i, 4, B, tenant="bulk"))
    assert run_step(sched) == [("r0", 0, 4), ("r1", 0, 4), ("r2", 0, 4)]
    sched.add(make_seq(3, 4, INT, tenant="chat"))
    # The prompt's step: the room beside it (one row) is not taken; the batch decodes wait.
    assert run_step(sched) == [("r3", 0, 4)]
    # Then one row beside the chat's decode, in turns from the first (none lost its turn).
    assert run_step(sched) == [("r0", 4, 1), ("r3", 4, 1)]
    assert run_step(sched) == [("r1", 4, 1), ("r3", 5, 1)]
    assert run_step(sched) == [("r2", 4, 1), ("r3", 6, 1)]


def test_a_second_prompt_mid_stream_also_runs_without_batch_rows():
    sched = banded_scheduler()
    for i in range(2):
        sched.add(make_seq(i, 4, B, tenant="bulk"))
    sched.add(make_seq(2, 4, INT, tenant="chat"))
    assert run_step(sched) == [("r2", 0, 4)]
    sched.add(make_seq(3, 4, INT, tenant="chat2"))
    assert run_step(sched) == [("r2", 4, 1), ("r3", 0, 4)]
    # Two decodes: room for one batch token, a chunk of a batch prompt that waited.
    assert run_step(sched) == [("r2", 5, 1), ("r3", 4, 1), ("r0", 0, 1)]


def test_an_interactive_arrival_that_cannot_start_stops_no_batch_work():
    """The chat tenant may run one sequence at a time: its second request waits, and the
    step beside its first one's decode carries its batch row as before."""
    sched = banded_scheduler(max_running_per_tenant=1)
    for i in range(2):
        sched.add(make_seq(i, 4, B, tenant="bulk"))
    run_step(sched)
    sched.add(make_seq(2, 4, INT, tenant="chat"))
    assert run_step(sched) == [("r2", 0, 4)]
    waiting = make_seq(3, 4, INT, tenant="chat")
    sched.add(waiting)
    plan = run_step(sched)
    assert ("r2", 4, 1) in plan and waiting.status is SequenceStatus.WAITING
    assert [r for r, _, _ in plan if r in ("r0", "r1")] == ["r0"]


def test_beside_interactive_decodes_batch_rows_are_priced_on_decode_steps_and_no_prompt_joins():
    """Decode steps cost 5 ms for 1 or 2 rows, 5.5 ms for 4, 9 ms for 8; a step with prompt
    tokens 10 ms for 1 (another path: on a CPU, not the native decode step). Beside two
    interactive decodes (5 ms) a step may take 5.5 ms: two batch decode rows, each in turn,
    and no batch prompt chunk (the prompt-token curve alone would allow a few tokens)."""
    from worker.core.bands import batch_rows_beside_decodes
    from worker.core.step_budget import DecodeStepBudget, StepTimes

    decodes = StepTimes({1: 0.005, 2: 0.005, 4: 0.0055, 8: 0.009})
    budget = DecodeStepBudget(StepTimes({1: 0.010, 16: 0.020, 64: 0.050}), 1.0, decodes)
    assert batch_rows_beside_decodes(budget, 2) == 2
    assert batch_rows_beside_decodes(DecodeStepBudget(budget.times, 1.0), 2) is None
    sched = make_scheduler(num_blocks=32, max_num_seqs=8, max_tokens=64)
    sched.step_budget = budget
    lines = [make_seq(i, 4, B, tenant="bulk") for i in range(3)]
    for seq in lines:
        sched.add(seq)
    run_step(sched)  # alone: the three prompts
    chats = [make_seq(3 + i, 4, INT, tenant=f"chat{i}") for i in range(2)]
    for seq in chats:
        sched.add(seq)
    run_step(sched)  # the chats' prompts, alone
    late = make_seq(5, 8, B, tenant="bulk")  # a line whose prompt has not started
    sched.add(late)
    plans = [run_step(sched) for _ in range(3)]
    for plan in plans:
        ids = [r for r, _, _ in plan]
        assert {"r3", "r4"} <= set(ids) and len(ids) == 4, plans  # two batch rows
        assert all(n == 1 for _, _, n in plan) and "r5" not in ids, plans  # no prompt
    assert {r for plan in plans for r, _, _ in plan} == {"r0", "r1", "r2", "r3", "r4"}  # turns
    assert late.num_computed_tokens == 0
