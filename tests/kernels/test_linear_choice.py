"""switchboard_kernels.linear_choice: the plan chosen from scripted timings, the measurement
and its cache, and an engine whose projections run the measured plan against transformers."""

from __future__ import annotations

import json

import pytest
import torch

from switchboard_kernels import linear_native
from switchboard_kernels.linear_choice import (
    AMX_PANEL_ROWS,
    DECODE_STEP_CREDIT,
    ONEDNN,
    PANELS,
    TORCH,
    LinearPlan,
    available_kernels,
    choose,
    decode_step_credited,
    fixed_plan,
    linear_plan,
    measure_plan,
    measured_rows,
)
from switchboard_kernels.measured_choice import fastest_of_short

# ms a step by rows: panels win small batches, oneDNN large ones (a Zen 3's shape).
CROSSING = {
    PANELS: {1: 37.0, 16: 50.0, 64: 114.0, 256: 616.0, 1024: 2887.0},
    ONEDNN: {1: 55.0, 16: 90.0, 64: 176.0, 256: 589.0, 1024: 2262.0},
}


def test_one_kernel_that_wins_every_bucket_is_the_plan():
    seconds = {PANELS: {1: 1.0, 64: 2.0}, ONEDNN: {1: 1.5, 64: 3.0}}
    assert choose(seconds, dual=True) == LinearPlan(PANELS, PANELS, 0, "measured")


def test_a_crossing_splits_the_rows_where_the_other_kernel_starts_to_win():
    plan = choose(CROSSING, dual=True)
    assert plan == LinearPlan(PANELS, ONEDNN, 64, "measured")
    assert [plan.kernel_for(r) for r in (1, 64, 65, 1024)] == [PANELS, PANELS, ONEDNN, ONEDNN]
    assert plan.kernels == (PANELS, ONEDNN)


def test_without_room_for_two_copies_the_kernel_with_the_least_total_time_is_kept():
    # relative times: panels 1 + 1 + 1 + 1.046 + 1.276 = 5.32; oneDNN 1.49 + 1.8 + 1.54 + 1 + 1
    assert choose(CROSSING, dual=False) == LinearPlan(PANELS, PANELS, 0, "measured")


def test_a_tie_keeps_one_kernel():
    seconds = {PANELS: {1: 1.0, 64: 2.0}, ONEDNN: {1: 1.0, 64: 2.0}}
    assert choose(seconds, dual=True).kernels == (PANELS,)


def test_decode_rows_the_one_call_step_takes_stay_on_the_panels_within_its_credit():
    """A Zen 3's measurement (ms, fp32, 19 layers): oneDNN 4% ahead at 64 rows in isolation
    put the split at 16, and decode steps of 17-64 rows through torch; with the one-call
    step's credit at the rows a decode step holds, the panels keep them. Past those rows, and
    where oneDNN leads by more than the credit, the measurement decides as before."""
    zen3 = {
        PANELS: {1: 11.7, 4: 11.5, 16: 19.4, 64: 78.1, 256: 285.8, 1024: 1154.9},
        ONEDNN: {1: 16.6, 4: 20.8, 16: 30.1, 64: 75.3, 256: 277.7, 1024: 1018.1},
    }
    assert choose(zen3, dual=True).split_rows == 16
    credited = decode_step_credited(zen3, 128)
    assert credited[ONEDNN] == zen3[ONEDNN] and credited[PANELS][256] == zen3[PANELS][256]
    assert credited[PANELS][64] == pytest.approx(78.1 / (1 + DECODE_STEP_CREDIT))
    assert choose(credited, dual=True) == LinearPlan(PANELS, ONEDNN, 64, "measured")
    assert choose(decode_step_credited(zen3, 16), dual=True).split_rows == 16
    assert decode_step_credited(zen3, 0) is zen3
    far_behind = {PANELS: {1: 1.0, 64: 2.0}, ONEDNN: {1: 1.5, 64: 1.0}}  # 2x behind at 64
    assert choose(decode_step_credited(far_behind, 64), dual=True).split_rows == 1


def test_a_full_decode_step_is_measured_between_the_buckets():
    assert measured_rows(1024) == [1, 4, 16, 64, 256, 1024]
    assert measured_rows(1024, 128) == [1, 4, 16, 64, 128, 256, 1024]
    assert measured_rows(64, 128) == [1, 4, 16, 64]  # no step holds more than max_rows
    assert measured_rows(1024, 64) == [1, 4, 16, 64, 256, 1024]
    result = measure_plan(SHAPES, torch.float32, num_layers=2, max_rows=64, dual=True,
                          decode_rows=32)  # fmt: skip
    assert all(sorted(t) == [1, 4, 16, 32, 64] for t in result.seconds.values())


def test_a_short_step_is_timed_again_and_its_fastest_call_counts():
    """A first call stalled by a core waking up (9 ms of a 1 ms step) does not count; a
    long step runs once."""
    calls = iter([0.009, 0.001, 0.0012, 0.5])
    assert fastest_of_short(lambda: next(calls)) == 0.001
    assert next(calls) == 0.5  # three calls taken, no more
    long_calls = iter([0.05, 0.001])
    assert fastest_of_short(lambda: next(long_calls)) == 0.05
    assert next(long_calls) == 0.001  # the long step was not called again


def test_the_fixed_rule_names_a_kernel_this_cpu_has():
    for dtype in (torch.float32, torch.bfloat16):
        plan = fixed_plan(dtype)
        assert plan.source == "fixed"
        assert set(plan.kernels) <= {*available_kernels(dtype), TORCH}
    assert fixed_plan(torch.float32, "cuda").kernels == (TORCH,)


def test_without_a_measurement_an_amx_cpu_sends_bf16_beyond_a_few_rows_to_onednn(monkeypatch):
    """...unless the panels' own build multiplies on the tiles (amx_bf16.h)."""
    if {PANELS, ONEDNN} - set(available_kernels(torch.bfloat16)):
        pytest.skip("needs both the bf16 panels and oneDNN's bf16 packing")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    monkeypatch.setattr(linear_native, "bf16_panels_use_amx", lambda: False)
    assert fixed_plan(torch.bfloat16) == LinearPlan(PANELS, ONEDNN, AMX_PANEL_ROWS)
    assert fixed_plan(torch.bfloat16, dual=False) == LinearPlan(ONEDNN, ONEDNN)
    monkeypatch.setattr(linear_native, "bf16_panels_use_amx", lambda: True)
    assert fixed_plan(torch.bfloat16) == LinearPlan(PANELS, PANELS)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(linear_native, "bf16_panels_use_amx", lambda: False)
    assert fixed_plan(torch.bfloat16) == LinearPlan(PANELS, PANELS)


SHAPES = [(48, 32), (32, 48)]


def test_a_measurement_times_every_kernel_at_every_bucket_up_to_the_rows():
    result = measure_plan(SHAPES, torch.float32, num_layers=2, max_rows=64, dual=True)
    kernels = available_kernels(torch.float32)
    assert list(result.seconds) == kernels
    assert all(sorted(t) == [1, 4, 16, 64] for t in result.seconds.values())
    assert all(s > 0 for t in result.seconds.values() for s in t.values())
    assert set(result.plan.kernels) <= set(kernels) and result.layers == 2


def test_a_measured_plan_is_cached_and_read_back(tmp_path, monkeypatch):
    if len(available_kernels(torch.float32)) < 2:
        pytest.skip("one kernel here: nothing to measure")
    monkeypatch.setenv("SWITCHBOARD_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr("switchboard_kernels.measured_choice.MIN_CPU_SHARE", 0.0)  # a busy CI
    first = linear_plan(SHAPES, torch.float32, num_layers=2, max_rows=16)
    assert first.source == "measured"
    (cached,) = (tmp_path / "choices").glob("linear-*.json")
    record = json.loads(cached.read_text())
    assert record["plan"]["small"] == first.small and set(record["seconds"]) == set(
        available_kernels(torch.float32)
    )
    again = linear_plan(SHAPES, torch.float32, num_layers=2, max_rows=16)
    assert (again.small, again.large, again.split_rows, again.source) == (
        first.small, first.large, first.split_rows, "cached",
    )  # fmt: skip
    # Another shape is another measurement; a damaged file is measured again.
    assert linear_plan([(64, 32)], torch.float32, num_layers=2, max_rows=16).source == "measured"
    cached.write_text("{not json")
    assert linear_plan(SHAPES, torch.float32, num_layers=2, max_rows=16).source == "measured"


def test_a_measurement_starved_of_cpu_is_neither_trusted_nor_cached(tmp_path, monkeypatch):
    """Other processes slow each kernel's rounds unevenly; the plan is then the fixed rule's and
    the next start measures again."""
    import switchboard_kernels.measured_choice as choice

    if len(available_kernels(torch.float32)) < 2:
        pytest.skip("one kernel here: nothing to measure")
    monkeypatch.setenv("SWITCHBOARD_KERNEL_CACHE", str(tmp_path))
    result = measure_plan(SHAPES, torch.float32, num_layers=2, max_rows=16, dual=True)
    assert result.cpu_share > 0
    monkeypatch.setattr(choice, "MIN_CPU_SHARE", 1e9)  # every measurement counts as starved
    assert linear_plan(SHAPES, torch.float32, num_layers=2, max_rows=16) == fixed_plan(
        torch.float32
    )
    assert not list(tmp_path.glob("choices/linear-*.json"))


def test_fixed_choice_measures_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("SWITCHBOARD_KERNEL_CACHE", str(tmp_path))
    plan = linear_plan(SHAPES, torch.float32, num_layers=2, max_rows=16, measure=False)
    assert plan == fixed_plan(torch.float32)
    assert not (tmp_path / "choices").exists()


def test_an_engine_on_a_measured_plan_generates_what_transformers_does(tmp_path, monkeypatch):
    """The plan's kernels, whichever were measured fastest, in every layer of a real model:
    greedy tokens equal transformers' (fp32). A Llama block's plan also times a full decode
    step (max_num_seqs rows), which its one-call native step may take."""
    from transformers import GenerationConfig

    from factories import load_hf_model, make_checkpoint, random_prompts
    from worker import LLM, SamplingParams

    monkeypatch.setenv("SWITCHBOARD_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr("switchboard_kernels.measured_choice.MIN_CPU_SHARE", 0.0)  # a busy CI
    checkpoint = make_checkpoint(tmp_path / "model")
    llm = LLM(str(checkpoint), dtype="float32", kernel_choice="measure", max_num_seqs=24)
    layer = llm.engine.model.layers[0]
    plan = llm.engine.model.linear_plan
    assert plan is not None and plan.source in ("measured", "cached")
    (cached,) = (tmp_path / "choices").glob("linear-*.json")
    timed = json.loads(cached.read_text())["seconds"]
    assert all(sorted(map(int, t)) == [1, 4, 16, 24, 64, 256, 1024] for t in timed.values())
    assert len(layer.qkv.kernels) == len(plan.kernels)
    prompts = random_prompts(3, min_len=3, max_len=40, seed=4)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    hf = load_hf_model(checkpoint)
    config = GenerationConfig(max_new_tokens=8, do_sample=False, min_new_tokens=8)
    for prompt, out in zip(prompts, outs, strict=True):
        ids = torch.tensor([prompt])
        want = hf.generate(ids, generation_config=config)[0, len(prompt) :].tolist()
        assert out.token_ids == want
