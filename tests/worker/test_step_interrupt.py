"""A step of batch work alone stops at a layer when interactive work arrives
(worker/model/step_interrupt.py): the flag's rules, and the serving path that raises it.
That a stopped step, run again, keeps every token: test_bands_engine.py and
tests/kernels/test_decode_step_native.py."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from factories import assert_no_block_leaks, drain, make_checkpoint
from worker import LLMEngine, SamplingParams, engine_config
from worker.core.sequence import Band
from worker.engine.engine_stats import snapshot
from worker.model.step_interrupt import StepAbandoned, StepInterrupt
from worker.serving.async_engine import AsyncEngine

BATCH_PROMPT = [5, 17, 42, 99, 7, 3, 250, 11, 60, 61, 62, 63]
CHAT_PROMPT = [8, 9, 10, 11, 12, 13]


def test_a_request_stops_only_the_armed_step():
    interrupt = StepInterrupt()
    assert interrupt.request() is False  # nothing armed: no step to stop...
    interrupt.arm()
    interrupt.check()  # ...and the next armed step does not inherit a stale request
    assert interrupt.request() is True and interrupt.requested
    with pytest.raises(StepAbandoned):
        interrupt.check()
    interrupt.disarm()
    assert not interrupt.requested
    interrupt.check()


def test_a_request_from_another_thread_reaches_the_armed_step():
    interrupt = StepInterrupt()
    interrupt.arm()
    threading.Thread(target=interrupt.request).start()
    deadline = time.monotonic() + 10
    with pytest.raises(StepAbandoned):
        while time.monotonic() < deadline:
            interrupt.check()
            time.sleep(0.001)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("interrupt"), seed=7)


def new_engine(model) -> LLMEngine:
    return LLMEngine(model, engine_config(dtype="float32", block_size=4, max_loras=0))


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


async def test_an_interactive_arrival_stops_the_batch_step_in_flight(model):
    """The batch line's first step is held at its first layer until a stop is asked: only
    the interactive arrival's ``generate`` asks, so without it the step would run on (after
    ten seconds) and nothing would be dropped. Both requests' tokens are a plain engine's."""
    plain = new_engine(model)
    plain.add_request("b", BATCH_PROMPT, greedy(8), band=Band.BATCH)
    plain.add_request("c", CHAT_PROMPT, greedy(8))
    expected = {rid: out.token_ids for rid, out in drain(plain).items()}

    engine = new_engine(model)
    interrupt, check = engine.runner.model.interrupt, engine.runner.model.interrupt.check
    entered = threading.Event()

    def held() -> None:
        if interrupt.armed and not entered.is_set():
            entered.set()
            deadline = time.monotonic() + 10
            while not interrupt.requested and time.monotonic() < deadline:
                time.sleep(0.001)
        check()

    interrupt.check = held
    served = AsyncEngine(engine)
    served.start()
    try:

        async def collect(request_id, prompt, band):
            samples = served.generate(request_id, prompt, greedy(8), band=band)
            return [s.output async for s in samples][-1].token_ids

        batch = asyncio.create_task(collect("b", BATCH_PROMPT, Band.BATCH))
        assert await asyncio.to_thread(entered.wait, 10)
        chat = await collect("c", CHAT_PROMPT, Band.INTERACTIVE)
        assert {"b": await batch, "c": chat} == expected
    finally:
        await served.stop()
    assert interrupt.abandoned == 1 and snapshot(engine).batch_steps_stopped == 1
    assert_no_block_leaks(engine)


def test_no_step_is_armed_where_the_scheduler_does_not_count_on_stops(model):
    """Under tensor parallelism (``BatchBand.steps_stop`` off: every rank must run every layer) a
    step of batch work alone is never armed, so a request cannot stop it."""
    engine = new_engine(model)
    assert engine.scheduler.batch_band.steps_stop  # one rank
    engine.scheduler.batch_band.steps_stop = False
    interrupt, execute = engine.runner.model.interrupt, engine.runner.execute
    armed: list[bool] = []

    def recorded(scheduled, **kwargs):
        armed.append(interrupt.armed)
        assert engine.stop_batch_step() is False
        return execute(scheduled, **kwargs)

    engine.runner.execute = recorded
    engine.add_request("b", BATCH_PROMPT, greedy(4), band=Band.BATCH)
    drain(engine)
    assert armed and not any(armed) and interrupt.abandoned == 0
