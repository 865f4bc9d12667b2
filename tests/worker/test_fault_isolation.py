"""A request's values fail only that request: a poison next to a victim, in the engine and
behind the async engine and the gRPC mapping. The victim's tokens must equal those of an
unattacked run, the poison must end with a clear error, and the engine must keep serving."""

from __future__ import annotations

import asyncio
import math

import grpc
import pytest

from factories import add_byte_level_tokenizer, assert_no_block_leaks, drain, make_checkpoint
from rpc import worker_pb2
from worker import LLMEngine, SamplingParams, engine_config
from worker.errors import InvalidRequestError, NonFiniteLogitsError, SequenceFailedError
from worker.serving.async_engine import AsyncEngine
from worker.serving.servicer import sampling_params_from_proto, status_for

VOCAB = 512
VICTIM_PROMPT = [5, 17, 42, 99, 7, 3, 250, 11]
POISON_PROMPT = [8, 9, 10, 11, 12, 13]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("isolation"), vocab_size=VOCAB, seed=11)
    return add_byte_level_tokenizer(path)


@pytest.fixture
def engine(model):
    return LLMEngine(
        model, engine_config(dtype="float32", block_size=4, num_kv_blocks=64, max_loras=0)
    )


def victim_params() -> SamplingParams:
    """Seeded sampling, so a sampler that redraws after a failure would show."""
    return SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)


def unattacked(model) -> list[int]:
    engine = LLMEngine(
        model, engine_config(dtype="float32", block_size=4, num_kv_blocks=64, max_loras=0)
    )
    engine.add_request("victim", VICTIM_PROMPT, victim_params())
    return drain(engine)["victim"].token_ids


def poison_where(engine: LLMEngine, target: str, obj, name: str, rows_of) -> None:
    """Patch ``obj.name`` to raise, after doing its work (its random draws included),
    whenever the poison request ``target`` is in its batch."""
    real = getattr(obj, name)

    def poisoned(*args, **kwargs):
        result = real(*args, **kwargs)
        if target in rows_of(*args):
            raise RuntimeError("index 49152 is out of bounds (poisoned)")
        return result

    setattr(obj, name, poisoned)


@pytest.fixture(scope="module")
def expected(model) -> list[int]:
    return unattacked(model)


def run_with_poison(engine: LLMEngine, poison_params: SamplingParams | None = None):
    engine.add_request("victim", VICTIM_PROMPT, victim_params())
    engine.add_request("poison", POISON_PROMPT, poison_params or SamplingParams(max_tokens=12))
    done = drain(engine)
    return done, engine.take_failures()


def test_a_forward_pass_that_fails_for_one_request_fails_it_alone(engine, expected):
    poison_where(
        engine, "poison", engine.runner, "execute",
        lambda scheduled, **_: {s.seq.request_id for s in scheduled},
    )  # fmt: skip
    done, failures = run_with_poison(engine)
    assert done["victim"].token_ids == expected
    assert done["poison"].finish_reason == "abort" and done["poison"].token_ids == []
    assert set(failures) == {"poison"} and isinstance(failures["poison"], SequenceFailedError)
    assert "forward pass failed" in str(failures["poison"])
    assert_no_block_leaks(engine)
    # The engine serves on, the poison's values included (without the fault).
    engine.add_request("after", VICTIM_PROMPT, victim_params())
    assert drain(engine)["after"].token_ids == expected


def test_sampling_that_raises_for_one_row_fails_it_alone_and_rewinds_seeds(engine, expected):
    """The victim is seeded: after the failed batch its draw must be the clean step's."""
    poison_where(
        engine, "poison", engine, "sampler",
        lambda logits, rows: {"poison" for r in rows if r.params.max_tokens == 7},
    )  # fmt: skip
    done, failures = run_with_poison(engine, SamplingParams(max_tokens=7, seed=5))
    assert done["victim"].token_ids == expected
    assert isinstance(failures["poison"], SequenceFailedError)
    assert "sampling failed" in str(failures["poison"])
    assert_no_block_leaks(engine)


@pytest.mark.parametrize("bad", [math.nan, -math.inf])
def test_nan_or_empty_logits_for_one_request_fail_it_with_a_clear_error(engine, expected, bad):
    """As an adapter whose output overflows would: the poison's logits rows are NaN (or
    all -inf); the sampler says so for that row and samples the others."""
    real = engine.runner.execute

    def execute(scheduled, **kwargs):
        sampling, logits = real(scheduled, **kwargs)
        logits = logits.clone()  # an inference tensor: changed only as a copy
        for row, s in enumerate(sampling):
            if s.seq.request_id == "poison":
                logits[row] = bad
        return sampling, logits

    engine.runner.execute = execute
    done, failures = run_with_poison(engine)
    assert done["victim"].token_ids == expected
    assert isinstance(failures["poison"], NonFiniteLogitsError)
    assert ("NaN" if math.isnan(bad) else "-inf") in str(failures["poison"])
    assert status_for(failures["poison"]) is grpc.StatusCode.INVALID_ARGUMENT
    assert_no_block_leaks(engine)


@pytest.mark.parametrize(
    "poison",
    [
        dict(repetition_penalty=1e-30, temperature=1.0),  # the attack of issue 27
        dict(repetition_penalty=1e-30, temperature=0.0),
        dict(repetition_penalty=1e-38, temperature=1e-5, top_k=3, top_p=0.5),
        dict(temperature=1e-30),
        dict(temperature=1e-5, min_p=0.9, frequency_penalty=-2.0, presence_penalty=-2.0),
        dict(repetition_penalty=2.0, frequency_penalty=2.0, presence_penalty=2.0, logprobs=20),
    ],
)
def test_extreme_values_within_bounds_hurt_nobody(engine, expected, poison):
    done, failures = run_with_poison(engine, SamplingParams(max_tokens=12, **poison))
    assert failures == {}
    assert done["victim"].token_ids == expected
    assert len(done["poison"].token_ids) <= 12
    assert all(0 <= t < VOCAB for t in done["poison"].token_ids)
    for token in done["poison"].logprobs or []:
        assert math.isfinite(token.logprob)
        assert all(math.isfinite(lp) for _, lp in token.top_logprobs)
    assert_no_block_leaks(engine)


async def test_the_async_engine_hands_the_error_to_the_poison_only(engine, expected):
    poison_where(
        engine, "poison-0", engine.runner, "execute",
        lambda scheduled, **_: {s.seq.request_id for s in scheduled},
    )  # fmt: skip
    served = AsyncEngine(engine)
    served.start()
    try:

        async def collect(request_id, prompt, params):
            return [s.output async for s in served.generate(request_id, prompt, params)]

        victim = asyncio.create_task(collect("victim", VICTIM_PROMPT, victim_params()))
        poison = asyncio.create_task(collect("poison", POISON_PROMPT, SamplingParams()))
        with pytest.raises(SequenceFailedError) as raised:
            await poison
        assert status_for(raised.value) is grpc.StatusCode.INTERNAL
        assert (await victim)[-1].token_ids == expected
        # Still serving.
        again = await collect("again", VICTIM_PROMPT, victim_params())
        assert again[-1].token_ids == expected
    finally:
        await served.stop()
    assert_no_block_leaks(engine)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("temperature", 1e9),
        ("top_p", math.nan),
        ("top_p", 1.5),
        ("min_p", math.nan),
        ("repetition_penalty", -1.0),
        ("repetition_penalty", math.inf),
        ("repetition_penalty", 2.5),
        ("presence_penalty", math.nan),
        ("presence_penalty", -2.5),
        ("frequency_penalty", math.inf),
        ("top_k", -2),
        ("logprobs", 21),
        ("num_speculative_tokens", 17),
    ],
)
def test_the_worker_rechecks_every_value_from_the_wire(field, value):
    msg = worker_pb2.SamplingParams(max_tokens=4, **{field: value})
    with pytest.raises(InvalidRequestError, match=field):
        sampling_params_from_proto(msg)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(stop=["x"] * 33),
        dict(stop=["x" * 1025]),
        dict(stop_token_ids=list(range(1025))),
        dict(seed=2**63),
        dict(max_tokens=2**31),
        dict(max_tokens=True),
        dict(temperature="1"),
    ],
)
def test_request_shapes_are_bounded(kwargs):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kwargs)


def test_the_engine_checks_what_needs_the_model(engine):
    with pytest.raises(InvalidRequestError, match="top_k"):
        engine.add_request("k", VICTIM_PROMPT, SamplingParams(top_k=VOCAB + 1))
    with pytest.raises(InvalidRequestError, match="stop_token_ids"):
        engine.add_request("s", VICTIM_PROMPT, SamplingParams(stop_token_ids=[VOCAB]))
    assert not engine.has_unfinished_requests


def test_a_sample_that_fails_its_prompt_hands_it_to_its_sibling(engine):
    """n = 2: the first sample computes the prompt and fails alone; the second takes over."""
    poison_where(
        engine, "p-0", engine.runner, "execute",
        lambda scheduled, **_: {s.seq.request_id for s in scheduled},
    )  # fmt: skip
    engine.add_samples(["p-0", "p-1"], POISON_PROMPT, [SamplingParams(max_tokens=3)] * 2)
    engine.add_request("victim", VICTIM_PROMPT, victim_params())
    done = drain(engine)
    assert done["p-0"].finish_reason == "abort"
    assert len(done["p-1"].token_ids) == 3 and len(done["victim"].token_ids) == 12
    assert set(engine.take_failures()) == {"p-0"}
    assert_no_block_leaks(engine)


async def test_over_grpc_the_poison_gets_its_code_and_the_victim_its_tokens(model, expected):
    """Behind the real servicer: INTERNAL for the request that failed alone (the gateway
    neither retries it nor blames the worker), INVALID_ARGUMENT for non-finite values."""
    from rpc import worker_pb2_grpc
    from worker.serving.server import WorkerServer

    def poisoned_engine() -> LLMEngine:
        engine = LLMEngine(
            model, engine_config(dtype="float32", block_size=4, num_kv_blocks=64, max_loras=0)
        )
        poison_where(
            engine, "poison-0", engine.runner, "execute",
            lambda scheduled, **_: {s.seq.request_id for s in scheduled},
        )  # fmt: skip
        return engine

    def call(request_id, prompt, **params) -> worker_pb2.GenerateRequest:
        return worker_pb2.GenerateRequest(
            request_id=request_id,
            prompt_token_ids=prompt,
            params=worker_pb2.SamplingParams(skip_special_tokens=True, **params),
        )

    victim = dict(temperature=0.8, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    server = WorkerServer(poisoned_engine, model_name="tiny")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            answered, failed = await asyncio.gather(
                stub.GenerateAll(call("victim", VICTIM_PROMPT, **victim)),
                stub.GenerateAll(call("poison", POISON_PROMPT, max_tokens=12)),
                return_exceptions=True,
            )
            assert [t for r in answered.responses for t in r.token_ids] == expected
            assert isinstance(failed, grpc.aio.AioRpcError)
            assert failed.code() is grpc.StatusCode.INTERNAL
            assert "forward pass failed" in failed.details()
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.GenerateAll(
                    call("nan", VICTIM_PROMPT, max_tokens=4, temperature=math.nan)
                )
            assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            again = await stub.GenerateAll(call("again", VICTIM_PROMPT, **victim))
            assert [t for r in again.responses for t in r.token_ids] == expected
    finally:
        await server.shutdown(drain_timeout=2.0)
