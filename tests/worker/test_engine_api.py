"""The engine's offline and streaming APIs: deltas, stop strings, seeds, aborts, bad input."""

from __future__ import annotations

import pytest
import torch

from factories import add_byte_level_tokenizer, load_hf_model, make_checkpoint, random_prompts
from worker import LLM, SamplingParams
from worker.errors import InvalidRequestError, RequestTooLargeError

VOCAB = 512


@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    """A tiny random model with a real byte-level tokenizer, so outputs are text."""
    path = make_checkpoint(
        tmp_path_factory.mktemp("text"), vocab_size=VOCAB, max_position_embeddings=256, seed=7
    )
    return add_byte_level_tokenizer(path)


@pytest.fixture(scope="module")
def llm(text_model):
    return LLM(text_model, dtype="float32", block_size=4, num_kv_blocks=256)


def greedy(max_tokens: int = 40, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def stream(llm: LLM, prompts, params) -> dict[str, list]:
    """Drive the streaming interface by hand; every output of every step, per request."""
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"s{i}", prompt, params)
    seen: dict[str, list] = {f"s{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished_requests:
        for out in engine.step():
            seen[out.request_id].append(out)
    return seen


def test_streamed_deltas_add_up_to_the_offline_result(llm):
    prompts = ["hello world", "the quick brown fox", "日本"]
    offline = llm.generate(prompts, greedy())
    streamed = stream(llm, prompts, greedy())
    for i, expected in enumerate(offline):
        steps = streamed[f"s{i}"]
        assert [t for out in steps for t in out.new_token_ids] == expected.token_ids
        assert "".join(out.new_text for out in steps) == expected.text
        assert [out.finished for out in steps] == [False] * (len(steps) - 1) + [True]
        assert expected.text == llm.tokenizer.decode(expected.token_ids)
        metrics = steps[-1].metrics
        assert metrics.queue_time >= 0 and metrics.ttft >= metrics.queue_time
        assert len(steps[-1].token_times) == len(expected.token_ids)


def test_stop_string_truncates_the_text_and_never_leaks(llm):
    prompt = "the quick brown fox"
    full = llm.generate([prompt], greedy(max_tokens=60))[0].text
    stop = full[20:23]  # a piece of text greedy decoding is known to produce
    cut = full.index(stop)
    out = llm.generate([prompt], greedy(max_tokens=60, stop=[stop]))[0]
    assert out.text == full[:cut]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    streamed = stream(llm, [prompt], greedy(max_tokens=60, stop=[stop]))["s0"]
    assert "".join(o.new_text for o in streamed) == full[:cut]


def test_stop_token_ids_end_the_request_without_text(llm):
    prompt = "hello world"
    base = llm.generate([prompt], greedy())[0]
    stop_token = base.token_ids[5]
    first = base.token_ids.index(stop_token)
    out = llm.generate([prompt], greedy(stop_token_ids=[stop_token]))[0]
    assert out.token_ids == base.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_token
    assert out.text == llm.tokenizer.decode(base.token_ids[:first])


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20, seed=1234, ignore_eos=True)
    alone = llm.generate(["hello world"], params)[0].token_ids
    crowd = ["the quick brown fox", "hello world", "café"]
    others = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    batch = llm.generate(crowd, [others, params, others])
    assert batch[1].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20, seed=99, ignore_eos=True)
    assert llm.generate(["hello world"], other_seed)[0].token_ids != alone


def test_logprobs_match_the_reference_model(text_model, llm):
    hf = load_hf_model(text_model)
    prompt = llm.tokenizer.encode("hello world")
    out = llm.generate([prompt], greedy(max_tokens=5, logprobs=3))[0]
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + out.token_ids])).logits[0]
    reference = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    for step, token in enumerate(out.logprobs):
        assert token.token_id == out.token_ids[step]
        assert token.logprob == pytest.approx(reference[step, token.token_id].item(), abs=1e-4)
        top = reference[step].topk(3)
        assert [t for t, _ in token.top_logprobs] == top.indices.tolist()


def test_abort_frees_blocks_at_once(llm):
    engine = llm.engine
    engine.add_request("a", "hello world", greedy(max_tokens=100))
    engine.add_request("b", "the quick brown fox", greedy(max_tokens=100))
    engine.step()
    engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    out = engine.abort("a")
    assert out.finished and out.finish_reason == "abort"
    assert engine.abort("a") is None and engine.abort("never-seen") is None
    engine.abort("b")
    assert not engine.has_unfinished_requests
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_generation_stops_at_the_context_length(text_model):
    llm = LLM(text_model, dtype="float32", max_model_len=32)
    out = llm.generate([list(range(3, 30))], greedy(max_tokens=100))[0]
    assert len(out.token_ids) == 32 - 27
    assert out.finish_reason == "length"


@pytest.mark.parametrize(
    ("prompt", "params", "error", "message"),
    [
        (list(range(3, 300)), greedy(), InvalidRequestError, "context is 256 tokens"),
        ([5, VOCAB, 7], greedy(), InvalidRequestError, r"unknown token ids \[512\]"),
        ([5, -1], greedy(), InvalidRequestError, "unknown token ids"),
        ([], greedy(), InvalidRequestError, "prompt is empty"),
        ([5, 6], greedy(stop_token_ids=[10**6]), InvalidRequestError, "stop_token_ids"),
        ([5, 6], greedy(max_tokens=2000), RequestTooLargeError, "KV blocks"),
    ],
)
def test_bad_requests_are_refused_and_disturb_nothing(prompt, params, error, message, text_model):
    # 48 blocks of 4 hold 192 tokens: less than the 256-token context.
    llm = LLM(text_model, dtype="float32", block_size=4, num_kv_blocks=48)
    engine = llm.engine
    engine.add_request("ok", "hello", greedy(max_tokens=4))
    with pytest.raises(error, match=message):
        engine.add_request("bad", prompt, params)
    assert set(engine.requests) == {"ok"}
    while engine.has_unfinished_requests:
        engine.step()
    assert engine.block_manager.num_free_blocks == 48


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens must be at least 1"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"logprobs": 50}, "logprobs"),
        ({"stop": [""]}, "stop strings"),
        ({"num_speculative_tokens": 17}, "num_speculative_tokens must be an integer from 0 to 16"),
        ({"num_speculative_tokens": -1}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 2.5}, "num_speculative_tokens"),
        ({"num_speculative_tokens": True}, "num_speculative_tokens"),
    ],
)
def test_invalid_sampling_params_are_refused(kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**kwargs)


def test_a_request_larger_than_the_kv_pool_is_rejected_not_hung(text_model):
    llm = LLM(text_model, dtype="float32", block_size=4, num_kv_blocks=8)  # 32 slots
    with pytest.raises(RequestTooLargeError):
        llm.generate([random_prompts(1, min_len=20, max_len=20, vocab=VOCAB)[0]], greedy(20))
    assert llm.engine.block_manager.num_free_blocks == 8
    assert not llm.engine.has_unfinished_requests


def cpu_computes_bf16() -> bool:
    """oneDNN's stated requirement for its bf16 matmuls, read from the CPU's own flags."""
    flags = set()
    with open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    return {"avx512bw", "avx512vl", "avx512dq"} <= flags or "avx_ne_convert" in flags


def test_auto_dtype_is_bf16_only_where_the_cpu_computes_it(text_model):
    llm = LLM(text_model, block_size=4, num_kv_blocks=64)  # dtype="auto" by default
    want = torch.bfloat16 if cpu_computes_bf16() else torch.float32
    assert llm.engine.model.dtype == want
    assert llm.generate([[5, 6, 7]], greedy(max_tokens=4))[0].token_ids


def test_an_unknown_dtype_is_refused_with_the_choices(text_model):
    with pytest.raises(InvalidRequestError, match=r"dtype must be one of \['auto', 'float32'"):
        LLM(text_model, dtype="int8")


def test_the_cli_offers_the_engines_dtype_names():
    """switchboard's CLI spells the names out (it must not import torch): the same set."""
    from switchboard.worker_command import DTYPE_CHOICES as CLI_CHOICES
    from worker.engine.placement import DTYPE_CHOICES

    assert set(CLI_CHOICES) == set(DTYPE_CHOICES)


def test_an_output_reads_as_of_its_own_step_however_far_the_request_goes(llm):
    """Outputs read the request's lists up to their own token (the worker reads them on
    another thread, after more tokens are appended): each reads the same long after."""
    engine = llm.engine
    engine.add_request("d", "hello world", greedy(max_tokens=6, logprobs=1))
    outputs = []
    while engine.has_unfinished_requests:
        outputs += engine.step()
    assert len(outputs) == 6 and outputs[-1].finished
    final = outputs[-1]
    assert final.text == llm.engine.tokenizer.decode(final.token_ids) != ""
    assert len(final.token_ids) == len(final.logprobs) == len(final.token_times) == 6
    for i, out in enumerate(outputs, start=1):
        assert out.num_tokens == i
        assert out.token_ids == final.token_ids[:i]
        assert out.new_token_ids == final.token_ids[i - 1 : i]
        assert out.logprobs == final.logprobs[:i] and out.token_times == final.token_times[:i]
        assert [t.token_id for t in out.new_logprobs] == out.new_token_ids
        assert out.text == "".join(o.new_text for o in outputs[:i])
    out = outputs[0]
    out.token_ids.append(7)  # a copy: the output and the request are untouched
    assert out.token_ids == final.token_ids[:1] and final.num_tokens == 6


def test_a_requests_clocks_start_when_the_server_received_it(llm):
    """``arrival_time``: a request that waited for the step loop counts its queue time and its
    time to the first token from when it was received, and the tenant's first-token histogram
    holds that time (against the wall clock read before and after)."""
    import time

    engine = llm.engine
    ledger = engine.scheduler.ledger

    def first_token_totals() -> tuple[float, int]:
        (mine,) = [t for t in ledger.snapshot() if t.tenant == "clocks"] or [None]
        return (0.0, 0) if mine is None else (mine.first_token_sum, mine.first_token_buckets[-1])

    received = time.monotonic() - 2.0  # as if it had waited two seconds for the loop
    engine.add_samples(["clocks"], [5, 6, 7], [greedy(2)], tenant="clocks", arrival_time=received)
    seq = engine.requests["clocks"]
    assert seq.metrics.arrival_time == received
    while engine.has_unfinished_requests:
        engine.step()
        if seq.metrics.first_token_time is not None and first_token_totals()[1] == 1:
            break
    total, count = first_token_totals()
    assert count == 1
    assert total == pytest.approx(seq.metrics.first_token_time - received)
    assert 2.0 <= total < 2.0 + (time.monotonic() - received)
    while engine.has_unfinished_requests:
        engine.step()
