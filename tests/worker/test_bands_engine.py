"""The bands in the engine: batch rows held back beside interactive work, given back when an
interactive prompt joins, batch sequences preempted for arrivals. The order changes; the tokens
must not: every request's greedy output equals the one it gets on a plain engine."""

from __future__ import annotations

import pytest
from family_factories import make_family_checkpoint

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


def stopped_run(
    engine: LLMEngine, *, every: int, at: int = 1
) -> tuple[dict[str, list[int]], int, int]:
    """Six batch lines and, after four steps, a chat; every ``every``-th step of batch work
    alone is asked to stop at its check number ``at`` (the torch path checks before each
    layer, its MLP and its down projection: 1 is the first layer's MLP, 3 the second layer) or
    before its first layer (the native decode step, which reads the flag in C), as an
    interactive arrival asks. A stop asked during a step that carries interactive work must do
    nothing. Returns the tokens by request, how many steps the native decode step ran and the
    most checks one step made."""
    runner, interrupt = engine.runner, engine.runner.model.interrupt
    check, execute = interrupt.check, runner.execute
    armed_steps, layer, native_calls, most_checks = [0], [0], [0], [0]

    def checked() -> None:
        if not interrupt.armed:
            assert engine.stop_batch_step() is False  # interactive work: never stopped
        elif layer[0] == at and armed_steps[0] % every == 0:
            assert engine.stop_batch_step() is True
        layer[0] += 1
        check()

    def counted(scheduled, **kwargs):
        most_checks[0] = max(most_checks[0], layer[0])
        layer[0] = 0
        if interrupt.armed:
            armed_steps[0] += 1
        return execute(scheduled, **kwargs)

    class NativeStopped:
        """The native step, asked to stop before it starts on the chosen armed steps."""

        def __init__(self, step) -> None:
            self.step = step

        def __getattr__(self, name):
            return getattr(self.step, name)

        def __call__(self, feeds, lora=None, *, interrupt=None):
            native_calls[0] += 1
            if engine.runner.model.interrupt.armed and armed_steps[0] % every == 0:
                assert engine.stop_batch_step() is True
            return self.step(feeds, lora, interrupt=interrupt)

    interrupt.check, runner.execute = checked, counted
    if runner.native_step is not None:  # (every CPU with the native kernels, in bf16)
        runner.native_step = NativeStopped(runner.native_step)
    batch = random_prompts(6, min_len=6, max_len=14, seed=11)
    chat = random_prompts(1, min_len=5, max_len=20, seed=12)[0]
    for i, prompt in enumerate(batch):
        engine.add_request(f"b{i}", prompt, greedy(12), tenant="bulk", band=Band.BATCH)
    done = {}
    for step in range(400):
        if step == 4:
            engine.add_request("c0", chat, greedy(6), tenant="chat")
        if not engine.has_unfinished_requests:
            break
        for out in engine.step():
            if out.finished:
                assert out.finish_reason == "length", out
                done[out.request_id] = out
    tokens = {rid: out.token_ids for rid, out in done.items()}
    return tokens, native_calls[0], most_checks[0]


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    """A family the Llama loop does not take (``LlamaModel._forward_block``: its own checks)."""
    return make_family_checkpoint(tmp_path_factory.mktemp("gemma2"), "gemma2", seed=5)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
@pytest.mark.parametrize("at", [1, 2, 3], ids=["before-mlp", "before-down", "next-layer"])
def test_batch_steps_stopped_midway_run_again_with_every_token_kept(request, family, at):
    """Each stopped step is dropped whole and run again (its K/V written at positions not yet
    computed, its charges made once): every greedy token is the one a plain engine gives,
    wherever in a layer it stopped, in the Llama loop and in the other families' loop."""
    checkpoint = request.getfixturevalue("target" if family == "llama" else family)
    kwargs = {"dtype": "bfloat16", "block_size": 4, "max_num_batched_tokens": 64}
    plain = LLMEngine(checkpoint, engine_config(**kwargs))
    expected, _, checks = stopped_run(plain, every=10**9)
    assert checks == 3 * len(plain.runner.model.layers)  # each layer, its MLP, its down
    engine = LLMEngine(checkpoint, engine_config(**kwargs))
    got, native_calls, _ = stopped_run(engine, every=2, at=at)
    assert got == expected and len(got) == 7
    assert native_calls > 5 or engine.runner.native_step is None  # both paths were stopped
    assert engine.runner.model.interrupt.abandoned >= 5
    assert_no_block_leaks(engine)
