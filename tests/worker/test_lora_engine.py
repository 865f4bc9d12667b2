"""Mixed-adapter batches in the engine against peft, one adapter at a time (fp32)."""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel
from transformers import GenerationConfig

from factories import load_hf_model, make_checkpoint, make_peft_adapter, random_prompts
from switchboard_kernels import lora_native
from switchboard_kernels.lora import SlotPairs
from worker import LLM, SamplingParams
from worker.errors import UnknownAdapterError
from worker.serving.async_engine import AsyncEngine
from worker.serving.metrics import EngineStatsCollector

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Different ranks and target sets, including rank 1, MLP only, one layer, rank patterns.
ADAPTERS = {
    "r1-qv": {"rank": 1, "targets": ["q_proj", "v_proj"]},
    "r2-all": {"rank": 2, "targets": ALL},
    "r4-mlp": {"rank": 4, "targets": ["gate_proj", "up_proj", "down_proj"]},
    "r8-ko": {"rank": 8, "targets": ["k_proj", "o_proj"]},
    "r16-all": {"rank": 16, "targets": ALL},
    "r32-attn": {"rank": 32, "targets": ["q_proj", "k_proj", "v_proj", "o_proj"]},
    "r8-layer1": {"rank": 8, "targets": ALL, "layers_to_transform": [1]},
    "r4-pattern": {"rank": 4, "targets": ALL, "rank_pattern": {"down_proj": 12}},
    "r8-rslora": {"rank": 8, "targets": ["q_proj", "down_proj"], "use_rslora": True},
}
MAX_NEW = 16


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("base"), seed=11)


@pytest.fixture(scope="module")
def adapter_dirs(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: make_peft_adapter(base, root / name, seed=i, **spec)
        for i, (name, spec) in enumerate(ADAPTERS.items())
    }


@pytest.fixture(scope="module")
def peft_greedy(base, adapter_dirs):
    """Greedy tokens from peft with each adapter alone, and from the base model."""
    prompts = random_prompts(len(ADAPTERS) + 2, min_len=3, max_len=24, seed=4)
    hf = load_hf_model(base)
    hf.generation_config.eos_token_id = None
    config = GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0)
    names = list(adapter_dirs)
    model = PeftModel.from_pretrained(hf, adapter_dirs[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapter_dirs[name], adapter_name=name)
    model.eval()

    def run(prompt, adapter):
        ids = torch.tensor([prompt])
        if adapter is None:
            with model.disable_adapter():
                out = model.generate(input_ids=ids, generation_config=config)
        else:
            model.set_adapter(adapter)
            out = model.generate(input_ids=ids, generation_config=config)
        return out[0, len(prompt) :].tolist()

    # Every adapter once, the base model twice (first and last), all in one batch.
    assignment = [None, *names, None]
    expected = [run(p, a) for p, a in zip(prompts, assignment, strict=True)]
    return prompts, assignment, expected


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def make_llm(base, adapter_dirs, *, dtype="float32", **kwargs) -> LLM:
    llm = LLM(base, dtype=dtype, **kwargs)
    for name, path in adapter_dirs.items():
        llm.load_adapter(name, path)
    return llm


def test_mixed_batch_matches_peft_for_every_request(base, adapter_dirs, peft_greedy):
    prompts, assignment, expected = peft_greedy
    llm = make_llm(base, adapter_dirs, max_loras=len(ADAPTERS))
    outputs = llm.generate(prompts, greedy(), adapters=assignment)
    assert [o.token_ids for o in outputs] == expected
    # The adapters really change the output (else this test could not fail).
    base_only = llm.generate(prompts, greedy())
    changed = sum(b.token_ids != o.token_ids for b, o in zip(base_only, outputs, strict=True))
    assert changed >= len(ADAPTERS) - 1


def test_more_adapters_than_slots_all_complete_unchanged(base, adapter_dirs, peft_greedy):
    prompts, assignment, expected = peft_greedy
    # Two slots for nine adapters, and a host cache too small to keep any: every adapter
    # is evicted and reloaded from disk along the way.
    llm = make_llm(base, adapter_dirs, max_loras=2, lora_host_cache_gb=1e-6)
    outputs = llm.generate(prompts, greedy(), adapters=assignment)
    assert [o.token_ids for o in outputs] == expected
    manager = llm.engine.lora_manager
    assert manager.num_slot_loads >= len(ADAPTERS)
    assert len(manager.host) == 1
    # Both slots start empty; every later slot load evicts the adapter it held. Each of
    # the nine loads pushed the previous adapter out of the one-adapter host cache.
    assert manager.num_slot_evictions == manager.num_slot_loads - 2
    assert manager.num_host_evictions >= len(ADAPTERS) - 1
    engine = llm.engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    # The worker's /metrics exports both counts from the engine's stats snapshot.
    collector = EngineStatsCollector(lambda: AsyncEngine(engine).stats)
    exported = {
        s.labels["tier"]: s.value
        for family in collector.collect()
        for s in family.samples
        if s.name == "switchboard_worker_adapter_evictions_total"
    }
    assert exported == {"slot": manager.num_slot_evictions, "host": manager.num_host_evictions}


def test_the_stats_tell_slots_from_the_host_cache(base, adapter_dirs):
    """What the worker publishes (its registry record and /metrics read this snapshot): each
    device slot's content and the host cache's, most recently used first, apart. A host cache
    of one adapter keeps only the last one read, while the slots keep what ran."""
    first, second, third = list(adapter_dirs)[:3]
    llm = make_llm(
        base,
        {n: adapter_dirs[n] for n in (first, second, third)},
        max_loras=2,
        lora_host_cache_gb=1e-6,
    )
    manager = llm.engine.lora_manager
    ids = {name: manager.resolve(name) for name in (first, second, third)}

    def stats():
        return AsyncEngine(llm.engine).stats

    loaded = stats().residency
    assert loaded.slots == (None, None) and loaded.host == (ids[third],)
    assert loaded.host_bytes == manager.host[ids[third]].num_bytes
    assert loaded.host_limit == manager.host_cache_bytes

    llm.generate([[1, 2, 3]], greedy(), adapters=[first])
    llm.generate([[1, 2, 3]], greedy(), adapters=[second])
    ran = stats().residency
    assert ran.slots == (ids[first], ids[second])  # in slots, though read again in turn
    assert ran.host == (ids[second],)
    assert stats().adapter_ids == tuple(sorted(ids.values()))

    # A roomy host cache keeps all three, most recent first; /metrics counts both tiers.
    roomy = make_llm(base, {n: adapter_dirs[n] for n in (first, second, third)}, max_loras=2)
    roomy.generate([[1, 2, 3]], greedy(), adapters=[first])
    residency = AsyncEngine(roomy.engine).stats.residency
    assert residency.host == (ids[first], ids[third], ids[second])
    assert residency.slots == (ids[first], None)
    collector = EngineStatsCollector(lambda: AsyncEngine(roomy.engine).stats)
    exported = {s.name: s.value for family in collector.collect() for s in family.samples}
    assert exported["switchboard_worker_adapter_slots_used"] == 1
    assert exported["switchboard_worker_adapter_slots_total"] == 2
    assert exported["switchboard_worker_adapters_in_host_cache"] == 3
    assert exported["switchboard_worker_adapter_host_cache_bytes"] == residency.host_bytes


def peft_with_every_adapter(base, adapter_dirs) -> PeftModel:
    """The fp32 HF model with every adapter loaded under its name (none active yet)."""
    names = list(adapter_dirs)
    model = PeftModel.from_pretrained(
        load_hf_model(base), adapter_dirs[names[0]], adapter_name=names[0]
    )
    for name in names[1:]:
        model.load_adapter(adapter_dirs[name], adapter_name=name)
    return model


def test_prefill_logits_match_peft(base, adapter_dirs, peft_greedy):
    prompts, assignment, _ = peft_greedy
    llm = make_llm(base, adapter_dirs, max_loras=len(ADAPTERS))
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    outputs = llm.generate(prompts, params, adapters=assignment)
    model = peft_with_every_adapter(base, adapter_dirs)
    for prompt, adapter, out in zip(prompts, assignment, outputs, strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            if adapter is None:
                with model.disable_adapter():
                    logits = model(input_ids=ids).logits[0, -1]
            else:
                model.set_adapter(adapter)
                logits = model(input_ids=ids).logits[0, -1]
        reference = torch.log_softmax(logits, -1)
        top = out.logprobs[0].top_logprobs
        assert [t for t, _ in top] == reference.topk(5).indices.tolist()
        got = torch.tensor([lp for _, lp in top])
        torch.testing.assert_close(got, reference.topk(5).values, rtol=1e-4, atol=1e-4)


def test_bf16_mixed_decode_step_is_close_to_fp32_peft(base, adapter_dirs, peft_greedy):
    """The bf16 path (LoRA computed in bf16: bucketed decodes, runs for prefill) against
    fp32 peft: each request's second token (a decode in one mixed step) scored by both."""
    prompts, assignment, _ = peft_greedy
    llm = make_llm(base, adapter_dirs, dtype="bfloat16", max_loras=len(ADAPTERS))
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, logprobs=0)
    outputs = llm.generate(prompts, params, adapters=assignment)
    model = peft_with_every_adapter(base, adapter_dirs)
    errors, adapter_effects = [], []
    for prompt, adapter, out in zip(prompts, assignment, outputs, strict=True):
        ids = torch.tensor([prompt + out.token_ids[:1]])
        with torch.no_grad(), model.disable_adapter():
            without = torch.log_softmax(model(input_ids=ids).logits[0, -1], -1)
        if adapter is None:
            reference = without
        else:
            model.set_adapter(adapter)
            with torch.no_grad():
                reference = torch.log_softmax(model(input_ids=ids).logits[0, -1], -1)
            adapter_effects.append((reference - without).abs().max().item())
        token = out.token_ids[1]
        errors.append(abs(out.logprobs[1].logprob - reference[token].item()))
    # Measured: base rows within 0.01, adapter rows within 0.06 (bf16 rounding of x, h, B).
    assert max(errors) < 0.1, errors
    # Every adapter moves the logprobs by far more than the error allowed above.
    assert min(adapter_effects) > 0.5, adapter_effects


def test_new_weights_under_the_same_name_give_the_new_outputs(base, adapter_dirs, tmp_path):
    llm = make_llm(base, {"tenant-a": adapter_dirs["r16-all"]}, max_loras=2)
    prompt = random_prompts(1, min_len=8, max_len=8, seed=9)[0]
    before = llm.generate([prompt], greedy(), adapters=["tenant-a"])[0].token_ids
    first_id = llm.engine.lora_manager.resolve("tenant-a")
    replacement = make_peft_adapter(base, tmp_path / "v2", rank=16, targets=ALL, seed=123)
    second_id = llm.load_adapter("tenant-a", replacement)
    assert second_id != first_id
    after = llm.generate([prompt], greedy(), adapters=["tenant-a"])[0].token_ids
    fresh = make_llm(base, {"x": replacement}, max_loras=1)
    assert after == fresh.generate([prompt], greedy(), adapters=["x"])[0].token_ids
    assert after != before


@pytest.mark.parametrize("form", ["native", "pairs"])
def test_bf16_refilled_slot_serves_its_new_adapter(base, adapter_dirs, form, monkeypatch):
    """bf16 keeps each slot's A and B cut to rank beside the stacks, laid out for the native
    kernel (switchboard_kernels.lora_native.NativeSlots) or, without it, prepacked (SlotPairs): one
    slot taking turns between two adapters must give what each gives in a fresh engine."""
    if form == "pairs":  # as on a machine where the native kernel cannot be built
        if not SlotPairs.wanted(torch.zeros(1, dtype=torch.bfloat16)):
            pytest.skip("this CPU's oneDNN does not pack bf16 weights: no pairs are kept")
        monkeypatch.setattr(lora_native, "native_library", lambda: None)
    elif lora_native.native_library() is None:
        pytest.skip("no C compiler here: the native kernel is not built")
    names = ["r16-all", "r2-all"]
    prompt = random_prompts(1, min_len=8, max_len=8, seed=9)[0]
    shared = make_llm(base, {n: adapter_dirs[n] for n in names}, dtype="bfloat16", max_loras=1)
    turns = [shared.generate([prompt], greedy(), adapters=[n])[0].token_ids for n in names * 2]
    manager = shared.engine.lora_manager
    assert manager.num_slot_loads == 4  # every turn refilled the one slot
    kept = [getattr(s, form) for layer in manager.stacks for s in layer.values()]
    assert all(k is not None for k in kept)
    alone = {}
    for n in names:
        fresh = make_llm(base, {n: adapter_dirs[n]}, dtype="bfloat16", max_loras=1)
        alone[n] = fresh.generate([prompt], greedy(), adapters=[n])[0].token_ids
    assert turns == [alone[n] for n in names * 2]
    assert alone["r16-all"] != alone["r2-all"]


def test_unknown_adapter_is_refused_and_unload_forgets_the_name(base, adapter_dirs):
    llm = make_llm(base, {"only": adapter_dirs["r2-all"]}, max_loras=1)
    with pytest.raises(UnknownAdapterError, match="'other' is not loaded"):
        llm.generate([[5, 6, 7]], greedy(), adapters=["other"])
    llm.unload_adapter("only")
    with pytest.raises(UnknownAdapterError, match="'only' is not loaded"):
        llm.generate([[5, 6, 7]], greedy(), adapters=["only"])
    assert not llm.engine.has_unfinished_requests


@pytest.mark.slow
def test_default_model_mixed_adapters_match_peft(default_model_path, tmp_path):
    """The real default model with three adapters and the base model in one batch (fp32)."""
    specs = {
        "attn": {"rank": 8, "targets": ["q_proj", "k_proj", "v_proj", "o_proj"]},
        "mlp": {"rank": 16, "targets": ["gate_proj", "up_proj", "down_proj"]},
        "all": {"rank": 4, "targets": ALL},
    }
    dirs = {
        name: make_peft_adapter(default_model_path, tmp_path / name, seed=i, **spec)
        for i, (name, spec) in enumerate(specs.items())
    }
    prompts = random_prompts(4, min_len=6, max_len=12, vocab=49152, seed=3)
    assignment = [None, "attn", "mlp", "all"]
    llm = LLM(default_model_path, dtype="float32", max_loras=3)
    for name, path in dirs.items():
        llm.load_adapter(name, path)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate(prompts, params, adapters=assignment)

    hf = load_hf_model(default_model_path)
    hf.generation_config.eos_token_id = None
    model = PeftModel.from_pretrained(hf, dirs["attn"], adapter_name="attn")
    for name in ("mlp", "all"):
        model.load_adapter(dirs[name], adapter_name=name)
    config = GenerationConfig(max_new_tokens=8, do_sample=False, pad_token_id=0)
    for prompt, adapter, out in zip(prompts, assignment, outputs, strict=True):
        ids = torch.tensor([prompt])
        if adapter is None:
            with model.disable_adapter():
                expected = model.generate(input_ids=ids, generation_config=config)
        else:
            model.set_adapter(adapter)
            expected = model.generate(input_ids=ids, generation_config=config)
        assert out.token_ids == expected[0, len(prompt) :].tolist(), adapter


def test_a_popular_adapter_keeps_its_slot_through_cold_ones(base, adapter_dirs):
    """Two slots, one request at a time: hot, hot, hot, cold1, cold2, hot. LRU would give
    cold2 the hot adapter's slot (it was used before cold1) and load hot again; the decayed
    request counts give it cold1's. Every request's adapter is open while it runs only."""
    hot, cold1, cold2 = list(adapter_dirs)[:3]
    llm = make_llm(base, {n: adapter_dirs[n] for n in (hot, cold1, cold2)}, max_loras=2)
    manager = llm.engine.lora_manager
    prompt = random_prompts(1, min_len=5, max_len=5, seed=7)
    for name in (hot, hot, hot, cold1, cold2, hot):
        llm.generate(prompt, greedy(), adapters=[name])
    assert manager.num_slot_loads == 3 and manager.num_slot_evictions == 1
    assert set(manager.slots) == {manager.resolve(hot), manager.resolve(cold2)}
    assert not manager.eviction.open
