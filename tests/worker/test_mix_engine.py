"""Weighted adapter mixes beside single-adapter rows and base rows in one step, against peft
(fp32): a mix's reference is PEFT's ``add_weighted_adapter(..., combination_type="cat")``,
whose delta is exactly the weighted sum; through preemption and prefix-cache hits, on the
native and the torch CPU paths. Then what a mix is refused for, and that its KV is its own."""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel
from transformers import GenerationConfig

from factories import load_hf_model, make_checkpoint, make_peft_adapter, random_prompts
from switchboard_kernels import lora_native
from worker import LLM, SamplingParams
from worker.errors import InvalidRequestError, UnknownAdapterError

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {
    "a": {"rank": 4, "targets": ALL},
    "b": {"rank": 8, "targets": ["q_proj", "v_proj", "up_proj", "down_proj"], "alpha": 4},
    "c": {"rank": 2, "targets": ["k_proj", "o_proj", "gate_proj"]},
}
MIXES = {
    "mix-ab": [("a", 0.7), ("b", 0.3)],
    "mix-bca": [("b", 1.2), ("c", 0.5), ("a", 0.25)],  # three ranks, a weight above 1
    "mix-ba": [("b", 0.6), ("a", 0.4)],  # mix-ab's adapters, other weights
}
ASSIGNMENT = [None, "mix-ab", "a", "mix-bca", "b", None, "mix-ba", "c", "mix-ab"]
MAX_NEW = 12
# A pool this small preempts; the second round's prompts extend the first's (prefix hits).
PRESSURE = {"block_size": 4, "num_kv_blocks": 30, "max_num_batched_tokens": 48}


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    root = tmp_path_factory.mktemp("mix")
    base = make_checkpoint(root / "base", arch="llama", seed=7)
    dirs = {
        name: make_peft_adapter(base, root / name, seed=60 + i, **spec)
        for i, (name, spec) in enumerate(ADAPTERS.items())
    }
    first = random_prompts(len(ASSIGNMENT), min_len=5, max_len=20, seed=8)
    rounds = [first, [[*p, 7, 8, 9] for p in first]]
    return base, dirs, rounds, peft_greedy(base, dirs, rounds)


def peft_greedy(base, dirs, rounds) -> list[list[list[int]]]:
    """Each round's greedy tokens from peft, one request at a time; each mix as PEFT's own
    weighted adapter (concatenated ranks: the exact weighted sum of the deltas)."""
    hf = load_hf_model(base)
    hf.generation_config.eos_token_id = None
    config = GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0)
    names = list(dirs)
    model = PeftModel.from_pretrained(hf, dirs[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(dirs[name], adapter_name=name)
    for mix, parts in MIXES.items():
        adapters, weights = [n for n, _ in parts], [w for _, w in parts]
        model.add_weighted_adapter(adapters, weights, mix, combination_type="cat")
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

    return [[run(p, a) for p, a in zip(prompts, ASSIGNMENT, strict=True)] for prompts in rounds]


def make_llm(base, dirs, **kw) -> LLM:
    llm = LLM(base, dtype="float32", **{"max_loras": len(ADAPTERS), **PRESSURE, **kw})
    for name, path in dirs.items():
        llm.load_adapter(name, path)
    return llm


def requests() -> list[str | list[tuple[str, float]] | None]:
    return [MIXES.get(a, a) if a is not None else None for a in ASSIGNMENT]


@pytest.mark.parametrize("form", ["native", "torch"])
def test_mixes_single_and_base_rows_in_one_batch_match_peft(case, form, monkeypatch):
    base, dirs, rounds, expected = case
    if form == "torch":  # as where the native kernel cannot be built
        monkeypatch.setattr(lora_native, "native_library", lambda: None)
    elif lora_native.native_library() is None:
        pytest.skip("no C compiler here: the native kernel is not built")
    llm = make_llm(base, dirs)
    assert llm.engine.lora_manager.native == (form == "native")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    for prompts, want in zip(rounds, expected, strict=True):
        outputs = llm.generate(prompts, params, adapters=requests())
        assert [o.token_ids for o in outputs] == want
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.prefix_cache_stats.hits > 0
    # The mixes really mix: each differs from its adapters alone on some prompt.
    for mix in ("mix-ab", "mix-ba"):
        rows = [i for i, a in enumerate(ASSIGNMENT) if a == mix]
        alone = llm.generate([rounds[0][i] for i in rows], params, adapters=["a"] * len(rows))
        assert [o.token_ids for o in alone] != [expected[0][i] for i in rows]


def test_a_mix_needs_its_slots_and_waits_for_them(case):
    """Two slots, requests for three adapters and a two-adapter mix: all finish (no deadlock),
    with the same tokens as peft."""
    base, dirs, rounds, expected = case
    llm = make_llm(base, dirs, max_loras=2)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    rows = [i for i, a in enumerate(ASSIGNMENT) if a != "mix-bca"]  # three adapters > 2 slots
    adapters = [requests()[i] for i in rows]
    outputs = llm.generate([rounds[0][i] for i in rows], params, adapters=adapters)
    assert [o.token_ids for o in outputs] == [expected[0][i] for i in rows]


def test_a_mix_shares_kv_with_no_single_adapter_and_no_other_mix(case):
    base, dirs, rounds, _ = case
    llm = make_llm(base, dirs, num_kv_blocks=200)
    prompt = rounds[0][0] * 3  # several full blocks
    params = SamplingParams(temperature=0.0, max_tokens=1)
    first = [("a", 0.7), ("b", 0.3)]
    cached = []
    for adapter in ["a", first, [("b", 0.3), ("a", 0.7)], [("a", 0.3), ("b", 0.7)], [("a", 1.0)]]:
        cached.append(llm.generate([prompt], params, adapters=[adapter])[0].num_cached_tokens)
    # The same mix in another order is the same mix (its cached prefix); the rest start cold.
    assert cached[0] == cached[1] == 0
    assert cached[2] > 0
    assert cached[3] == cached[4] == 0


@pytest.mark.parametrize(
    ("mix", "error", "words"),
    [
        ([("a", 0.5), ("nope", 0.5)], UnknownAdapterError, "'nope' is not loaded"),
        ([("a", 0.5), ("a", 0.5)], InvalidRequestError, "at most once"),
        ([("a", -0.5), ("b", 0.5)], InvalidRequestError, "finite and >= 0"),
        ([("a", float("nan")), ("b", 0.5)], InvalidRequestError, "finite and >= 0"),
        ([("a", float("inf"))], InvalidRequestError, "finite and >= 0"),
        ([("a", 0.5), ("b", 0.5), ("c", 0.5), ("a2", 0.5)], InvalidRequestError, "1 to 3"),
        ([], InvalidRequestError, "1 to 3"),
        ([("a", 0.5), ("dora", 0.5)], InvalidRequestError, "'dora' uses DoRA"),
        ([("a", 0.5), ("head", 0.5)], InvalidRequestError, "'head' uses modules_to_save"),
        ([("tokens", 0.5), ("a", 0.5)], InvalidRequestError, "'tokens' uses trainable_token"),
    ],
)
def test_a_mix_is_refused_by_name(case, mix, error, words, tmp_path):
    base, dirs, rounds, _ = case
    llm = make_llm(base, dirs)
    llm.load_adapter("a2", dirs["a"])
    llm.load_adapter(
        "dora", make_peft_adapter(base, tmp_path / "d", rank=2, targets=ALL, use_dora=True)
    )
    saved = make_peft_adapter(
        base, tmp_path / "h", rank=2, targets=["q_proj"], modules_to_save=["lm_head"]
    )
    llm.load_adapter("head", saved)
    tokens = make_peft_adapter(
        base, tmp_path / "t", rank=2, targets=["q_proj"], trainable_token_indices=[3, 5]
    )
    llm.load_adapter("tokens", tokens)
    with pytest.raises(error, match=words):
        llm.engine.add_request("r", rounds[0][0], SamplingParams(max_tokens=2), mix=mix)
    assert not llm.engine.requests


def test_expert_lora_is_refused_in_a_mix(tmp_path):
    """On a MoE base, an adapter with LoRA on the experts (target_parameters) does not mix."""
    from moe_factories import EXPERT_PARAMETERS, make_expert_adapter, make_moe_checkpoint

    base = make_moe_checkpoint(tmp_path / "base", "mixtral", seed=3)
    llm = LLM(base, dtype="float32", max_loras=2)
    llm.load_adapter("plain", make_peft_adapter(base, tmp_path / "p", rank=2, targets=["q_proj"]))
    experts = make_expert_adapter(
        base, tmp_path / "e", rank=2, targets=["q_proj"], parameters=EXPERT_PARAMETERS
    )
    llm.load_adapter("experts", experts)
    mix = [("plain", 0.5), ("experts", 0.5)]
    with pytest.raises(InvalidRequestError, match="'experts' uses LoRA on MoE experts"):
        llm.engine.add_request("r", [3, 4, 5], SamplingParams(max_tokens=2), mix=mix)
