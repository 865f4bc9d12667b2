"""The start-up warm-up leaves no trace: no blocks held, nothing cached, counters at zero,
and the same tokens as transformers afterwards."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from factories import assert_no_block_leaks, drain, load_hf_model, make_checkpoint, random_prompts
from worker import LLMEngine, SamplingParams, engine_config
from worker.core.prefix_cache import PrefixCacheStats
from worker.engine.engine_stats import snapshot
from worker.errors import EngineError

MAX_NEW = 12


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("warmup"), max_position_embeddings=256)


def make_engine(checkpoint, **options) -> LLMEngine:
    options = {"dtype": "float32", "block_size": 4, "num_kv_blocks": 512, **options}
    return LLMEngine(checkpoint, engine_config(**options))


def assert_clean(engine: LLMEngine) -> None:
    assert_no_block_leaks(engine)
    assert engine.prefix_cache_stats == PrefixCacheStats()
    stats = snapshot(engine)
    assert (stats.running, stats.waiting, stats.tenants) == (0, 0, ())
    assert stats.free_kv_blocks == stats.total_kv_blocks
    assert not engine.requests


@pytest.mark.parametrize(
    "options",
    [
        {"max_num_batched_tokens": 64, "max_num_seqs": 8},
        {"max_num_batched_tokens": 1024, "max_num_seqs": 128},
        {"num_kv_blocks": 8},  # a pool too small for the whole warm-up
        {"max_model_len": 3, "max_num_batched_tokens": 2},
    ],
    ids=["small-budget", "defaults", "tiny-pool", "tiny-model-len"],
)
def test_warmup_leaves_the_engine_clean(checkpoint, options):
    engine = make_engine(checkpoint, warmup=True, **options)
    assert_clean(engine)
    assert engine.warm_up().steps >= 1  # again, by hand: still clean
    assert_clean(engine)


def test_warmed_engine_generates_what_transformers_does(checkpoint):
    prompts = random_prompts(4, min_len=3, max_len=30, seed=2)
    engine = make_engine(checkpoint, warmup=True, max_num_batched_tokens=32)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    outputs = drain(engine)
    model = load_hf_model(checkpoint)
    model.generation_config.eos_token_id = None
    config = GenerationConfig(
        max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            ids = model.generate(torch.tensor([prompt]), generation_config=config)
        assert outputs[str(i)].token_ids == ids[0, len(prompt) :].tolist()
    assert_no_block_leaks(engine)


def test_warmup_refuses_an_engine_with_requests(checkpoint):
    engine = make_engine(checkpoint)
    engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=2))
    with pytest.raises(EngineError):
        engine.warm_up()
    drain(engine)
    assert_no_block_leaks(engine)


def test_the_warm_up_times_steps_of_decodes_alone_by_rows(checkpoint):
    """The decode curve (worker.core.bands prices batch rows beside interactive decodes on
    it) starts from steps of 1, 2, 4 and 8 decoding sequences, up to max_num_seqs."""
    engine = make_engine(checkpoint, warmup=True, max_num_seqs=8, max_num_batched_tokens=64)
    rows, seconds = engine.scheduler.step_budget.decode_times.points()
    assert rows == [1, 2, 4, 8] and all(s > 0 for s in seconds)
    assert_clean(engine)


def test_only_steps_of_sampling_rows_alone_feed_the_decode_curve(checkpoint):
    """A step whose every row samples one token (decodes, a prompt's last token) is one of
    decodes alone; one with a prompt's one-token chunk that does not sample is not (on a CPU
    it takes the prompt path, not the native decode step)."""
    engine = make_engine(checkpoint, warmup=True, max_num_batched_tokens=2)
    budget = engine.scheduler.step_budget
    seen: list[tuple[list[tuple[int, bool]], bool]] = []
    schedule, observe = engine.scheduler.schedule, budget.observe
    steps: list = []

    def scheduled():
        out = schedule()
        steps.append([(s.num_tokens, s.samples) for s in out.scheduled])
        return out

    def observed(tokens, decode_rows_only, seconds):
        seen.append((steps[-1], decode_rows_only))
        observe(tokens, decode_rows_only, seconds)

    engine.scheduler.schedule, budget.observe = scheduled, observed
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.add_request("a", [5, 6, 7], params)
    engine.step()
    engine.step()  # a's last prompt token, which samples
    engine.add_request("b", [8, 9, 10, 11, 12], params)
    drain(engine)
    assert ([(1, True), (1, False)], False) in seen  # a decodes beside b's first token
    assert ([(1, True)], True) in seen
    assert all(flag == all(n == 1 and s for n, s in plan) for plan, flag in seen)
