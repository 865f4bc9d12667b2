"""Rendering a step's tokens during the next step (``async_output``) against plain steps.

Oracle: the same engine settings with ``async_output`` off, which renders each token in the
step that samples it. Every request ends with the same tokens, text, finish and stop reasons
and logprobs, whatever ends it (a stop string found a step late, a stop token, EOS, its
length, its grammar), with n > 1, seeded sampling, preemption and aborts; each stream's
deltas add up to its result, and no KV block is left held.
"""

from __future__ import annotations

import pytest
import torch

from factories import add_byte_level_tokenizer, assert_no_block_leaks, make_checkpoint
from worker import LLM, SamplingParams
from worker.engine.placement import resolve_async_output
from worker.errors import InvalidRequestError
from worker.sampling.structured_output import StructuredOutput

VOCAB = 512
EOS = 0  # the tokenizer's <|endoftext|>
PROMPTS = ["hello world", "the quick brown fox", "日本", "a", "jumps over the lazy dog"]


@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    path = make_checkpoint(
        tmp_path_factory.mktemp("async"),
        vocab_size=VOCAB,
        max_position_embeddings=256,
        eos_token_id=EOS,
        seed=11,
    )
    return add_byte_level_tokenizer(path)


def engines(text_model, **options):
    """(plain, async) engines with the same settings."""
    options = dict(dtype="float32", block_size=4, num_kv_blocks=256) | options
    return (
        LLM(text_model, async_output=False, **options),
        LLM(text_model, async_output=True, **options),
    )


def run(llm: LLM, requests: list[tuple[str, SamplingParams]], abort_after: dict | None = None):
    """Stream every request by hand: each request's outputs, in order. ``abort_after``:
    request id -> the step after which it is aborted (its abort output is kept)."""
    engine = llm.engine
    ids = []
    for i, (prompt, params) in enumerate(requests):
        ids.append(f"r{i}")
        engine.add_request(ids[-1], prompt, params)
    seen: dict[str, list] = {request_id: [] for request_id in ids}
    step = 0
    while engine.has_unfinished_requests:
        for out in engine.step():
            assert not (seen[out.request_id] and seen[out.request_id][-1].finished)
            seen[out.request_id].append(out)
        step += 1
        for request_id, when in (abort_after or {}).items():
            if when == step and (out := engine.abort(request_id)) is not None:
                seen[request_id].append(out)
        assert step < 500
    assert_no_block_leaks(engine)
    return seen


def assert_same_results(plain: dict, overlapped: dict) -> None:
    for request_id, expected_steps in plain.items():
        steps = overlapped[request_id]
        expected, got = expected_steps[-1], steps[-1]
        assert got.finished and expected.finished
        assert got.token_ids == expected.token_ids, request_id
        assert got.text == expected.text, request_id
        assert (got.finish_reason, got.stop_reason) == (
            expected.finish_reason,
            expected.stop_reason,
        ), request_id
        assert "".join(out.new_text for out in steps) == got.text
        assert [t for out in steps for t in out.new_token_ids] == got.token_ids
        if expected.logprobs is not None:
            assert [t.token_id for t in got.logprobs] == [t.token_id for t in expected.logprobs]
            assert [t.logprob for t in got.logprobs] == pytest.approx(
                [t.logprob for t in expected.logprobs]
            )


def test_every_way_to_end_gives_what_plain_steps_give(text_model):
    plain_llm, async_llm = engines(text_model)
    # Stop strings and stop tokens taken from what the model says unconstrained, so each
    # ends its request partway.
    free = plain_llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=40))
    requests = []
    for i, out in enumerate(free):
        text, tokens = out.text, out.token_ids
        requests += [
            (PROMPTS[i], SamplingParams(temperature=0.0, max_tokens=40)),
            (PROMPTS[i], SamplingParams(temperature=0.0, max_tokens=7 + i, ignore_eos=True)),
            (PROMPTS[i], SamplingParams(temperature=0.8, seed=i, max_tokens=30, logprobs=2)),
        ]
        if len(text) > 8:
            requests.append(
                (PROMPTS[i], SamplingParams(temperature=0.0, max_tokens=40, stop=[text[5:8]]))
            )
        if len(tokens) > 6:
            stop_token = tokens[5]
            requests.append(
                (
                    PROMPTS[i],
                    SamplingParams(
                        temperature=0.0, max_tokens=40, stop_token_ids=[stop_token], ignore_eos=True
                    ),
                )
            )
    plain = run(plain_llm, requests)
    overlapped = run(async_llm, requests)
    assert_same_results(plain, overlapped)
    reasons = {steps[-1].finish_reason for steps in plain.values()}
    stops = {type(steps[-1].stop_reason) for steps in plain.values()}
    assert reasons == {"stop", "length"} and {str, int} <= stops  # every way was taken


def test_each_output_read_after_its_step_is_consistent(text_model):
    """Consumers read an output after step() returns (the server, on another thread), by
    when the next token has been appended: the lists must end at the output's own token."""
    _, async_llm = engines(text_model)
    engine = async_llm.engine
    for i, prompt in enumerate(PROMPTS):
        params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, stop=["zz"])
        engine.add_request(f"r{i}", prompt, params)
    counts = dict.fromkeys((f"r{i}" for i in range(len(PROMPTS))), 0)
    while engine.has_unfinished_requests:
        for out in engine.step():
            counts[out.request_id] += len(out.new_token_ids)
            assert len(out.token_ids) == len(out.logprobs) == len(out.token_times)
            assert len(out.token_ids) == counts[out.request_id]
            assert out.token_ids[len(out.token_ids) - len(out.new_token_ids) :] == out.new_token_ids
            assert [t.token_id for t in out.logprobs] == out.token_ids
    assert set(counts.values()) == {12}


def test_outputs_come_one_step_later(text_model):
    plain_llm, async_llm = engines(text_model)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    counts = []
    for llm in (plain_llm, async_llm):
        engine = llm.engine
        engine.add_request("x", "hello world", params)
        per_step = []
        while engine.has_unfinished_requests:
            per_step.append(len(engine.step()))
        counts.append(per_step)
    assert counts == [[1] * 5, [0] + [1] * 5]


def test_n_samples_grammars_and_preemption(text_model):
    """n > 1 (forks), structured outputs (the grammar is consumed at once, so the next
    step's mask is right) and a KV pool too small for everyone (preemption)."""
    spec = StructuredOutput.regex(r"(yes|no), [a-z]{2,8}\.")
    greedy = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    requests = [  # (prompt, one params per sample)
        (
            "the quick brown fox",
            [SamplingParams(temperature=1.0, seed=s, max_tokens=30) for s in range(3)],
        ),
        (
            "hello world",
            [SamplingParams(temperature=1.0, seed=5, max_tokens=40, structured_output=spec)],
        ),
        ("日本", [SamplingParams(temperature=0.0, max_tokens=40, structured_output=spec)]),
    ] + [(p, [greedy]) for p in PROMPTS]
    results = []
    for llm in engines(text_model, num_kv_blocks=40):
        engine = llm.engine
        seen: dict[str, list] = {}
        for i, (prompt, samples) in enumerate(requests):
            ids = [f"r{i}-{j}" for j in range(len(samples))]
            engine.add_samples(ids, prompt, samples)
            seen |= {request_id: [] for request_id in ids}
        while engine.has_unfinished_requests or engine.has_pending_forks:
            for out in engine.step():
                seen[out.request_id].append(out)
        assert_no_block_leaks(engine)
        assert engine.scheduler.num_preemptions > 0
        results.append(seen)
    assert_same_results(*results)
    for request_id in ("r1-0", "r2-0"):
        assert results[1][request_id][-1].finish_reason == "stop"


def test_an_abort_between_steps_drops_the_unrendered_token(text_model):
    plain_llm, async_llm = engines(text_model)
    requests = [
        (p, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)) for p in PROMPTS
    ]
    seen = run(async_llm, requests, abort_after={"r1": 4, "r3": 1})
    for request_id in ("r1", "r3"):
        last = seen[request_id][-1]
        assert last.finish_reason == "abort" and last.finished
        assert sum(out.finished for out in seen[request_id]) == 1
    plain = run(plain_llm, requests)
    assert_same_results(
        {k: v for k, v in plain.items() if k not in ("r1", "r3")},
        {k: v for k, v in seen.items() if k not in ("r1", "r3")},
    )


def test_where_it_is_on_by_default():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not resolve_async_output(None, cpu, speculative=False)
    assert resolve_async_output(None, cuda, speculative=False)
    assert not resolve_async_output(None, cuda, speculative=True)
    assert resolve_async_output(True, cpu, speculative=False)
    with pytest.raises(InvalidRequestError, match="speculative decoding off"):
        resolve_async_output(True, cuda, speculative=True)


async def test_served_streams_match_plain_steps_and_a_cancelled_one_disturbs_none(text_model):
    """Through the worker's AsyncEngine (the step loop on its own thread): every stream ends
    with plain steps' tokens, and one cancelled mid-stream leaves the others whole."""
    import asyncio

    from worker.serving.async_engine import AsyncEngine

    plain_llm, async_llm = engines(text_model)
    params = SamplingParams(temperature=0.0, max_tokens=24, stop=["e"])
    prompts = [plain_llm.tokenizer.encode(p) for p in PROMPTS]
    expected = plain_llm.generate(prompts, params)
    served = AsyncEngine(async_llm.engine)
    served.start()
    try:

        async def collect(request_id, prompt):
            return [s.output async for s in served.generate(request_id, prompt, params)]

        async def cancelled():
            stream = served.generate("gone", prompts[0], SamplingParams(max_tokens=200))
            async for _ in stream:
                break
            await stream.aclose()

        results = await asyncio.gather(
            *(collect(f"s{i}", p) for i, p in enumerate(prompts)), cancelled()
        )
        for outs, want in zip(results[:-1], expected, strict=True):
            assert outs[-1].token_ids == want.token_ids and outs[-1].text == want.text
            assert "".join(out.new_text for out in outs) == want.text
    finally:
        await served.stop()
    assert_no_block_leaks(async_llm.engine)
