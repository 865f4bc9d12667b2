"""The bands in the engine: batch rows held back beside interactive work, given back when an
interactive prompt joins, batch sequences preempted for arrivals. The order changes; the tokens
must not: every request's greedy output equals the one it gets on a plain engine."""

from __future__ import annotations

from factories import assert_no_block_leaks, drain, random_prompts
from worker import SamplingParams
from worker.core.config import engine_config
from worker.core.sequence import Band
from worker.core.step_budget import DecodeStepBudget, StepTimes
from worker.engine.llm_engine import LLMEngine


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def run(engine: LLMEngine, *, banded: bool) -> tuple[dict[str, list[int]], list[list[str]]]:
    """Six batch lines start; after three steps, and again after eight, chats arrive while
    the batch decodes. Returns the tokens by request and each step's scheduled request ids."""
    batch = random_prompts(6, min_len=6, max_len=14, seed=11)
    chats = random_prompts(4, min_len=5, max_len=20, seed=12)
    band = Band.BATCH if banded else Band.INTERACTIVE
    for i, prompt in enumerate(batch):
        engine.add_request(f"b{i}", prompt, greedy(12), tenant="bulk", band=band)
    plans: list[list[str]] = []
    schedule = engine.scheduler.schedule

    def recorded():
        out = schedule()
        plans.append([s.seq.request_id for s in out.scheduled])
        return out

    engine.scheduler.schedule = recorded
    done = {}
    step = 0
    while engine.has_unfinished_requests or step < 9:
        if step in (3, 8):
            for j in (0, 1) if step == 3 else (2, 3):
                engine.add_request(f"c{j}", chats[j], greedy(6), tenant=f"chat{j}")
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        step += 1
    done.update(drain(engine))
    return {rid: out.token_ids for rid, out in done.items()}, plans


def test_batch_rows_held_back_and_given_back_keep_every_token(target):
    kwargs = {"dtype": "float32", "block_size": 4, "max_num_batched_tokens": 64}
    expected, _ = run(LLMEngine(target, engine_config(**kwargs)), banded=False)
    # Room for one batch row beside one interactive decode (test_scheduler_bands).
    engine = LLMEngine(target, engine_config(max_num_seqs=7, **kwargs))
    times = StepTimes({1: 0.010, 16: 0.020, 64: 0.050}, min_observations=10**9)
    engine.scheduler.step_budget = DecodeStepBudget(times, 1.0)
    got, plans = run(engine, banded=True)
    assert got == expected
    # The chats' prompts ran in steps of their own, without the batch rows then running...
    chat_steps = [p for p in plans if any(r.startswith("c0") or r.startswith("c2") for r in p)]
    assert not any(r.startswith("b") for r in chat_steps[0])
    # ...a seventh sequence took a batch line's seat, and batch rows took turns meanwhile.
    assert engine.scheduler.num_preemptions >= 1
    assert any(0 < sum(r.startswith("b") for r in p) < 6 for p in plans)
    assert_no_block_leaks(engine)
