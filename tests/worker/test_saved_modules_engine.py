"""Adapters with trained copies of lm_head and embed_tokens (PEFT's modules_to_save) or trainable
token rows beside plain LoRA, DoRA, a weighted mix of two plain adapters and base rows in one
step, against peft one adapter at a time (fp32; the mix as PEFT's ``add_weighted_adapter(...,
"cat")``), through preemption and prefix-cache hits, on a base with separate and with tied
embeddings (where token rows change the logits of their ids too)."""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel
from transformers import GenerationConfig

from factories import load_hf_model, make_checkpoint, make_peft_adapter, random_prompts
from worker import LLM, SamplingParams

QV = ["q_proj", "v_proj"]
ADAPTERS = {
    "plain": {"rank": 4, "targets": QV},
    "plain2": {"rank": 4, "targets": ["o_proj", "gate_proj", "up_proj", "down_proj"]},
    "head": {"rank": 2, "targets": QV, "modules_to_save": ["lm_head"]},
    "embed": {"rank": 2, "targets": ["o_proj"], "modules_to_save": ["embed_tokens"]},
    "both-dora": {
        "rank": 4,
        "targets": ["q_proj", "down_proj"],
        "modules_to_save": ["lm_head", "embed_tokens"],
        "use_dora": True,
    },
}
FIRST = random_prompts(12, min_len=5, max_len=18, seed=8)  # one per row of the assignment
TOKEN_IDS = sorted({t for p in FIRST for t in p[1:4]})  # ids the prompts hold
ADAPTERS["tokens"] = {"rank": 2, "targets": ["k_proj"], "trainable_token_indices": TOKEN_IDS}
TIED_ONLY = {  # PEFT ties the two copies on a tied base when asked
    "tied-copy": {
        "rank": 2,
        "targets": QV,
        "modules_to_save": ["embed_tokens"],
        "ensure_weight_tying": True,
    }
}
UNTIED_ONLY = {  # token rows beside a trained lm_head (on a tied base both would change it)
    "tokens-head": {
        "rank": 2,
        "targets": QV,
        "trainable_token_indices": TOKEN_IDS[::2],
        "modules_to_save": ["lm_head"],
    }
}
MIX = [("plain", 0.5), ("plain2", 1.5)]
ASSIGNMENT = [
    None,
    "plain",
    "head",
    "embed",
    "both-dora",
    None,
    "tokens",
    MIX,
    "both-dora",
    "tokens",
]
MAX_NEW = 10
# A pool this small preempts; the second round's prompts extend the first's (prefix hits).
PRESSURE = {"block_size": 4, "num_kv_blocks": 34, "max_num_batched_tokens": 48}


@pytest.fixture(scope="module", params=["untied", "tied"])
def case(request, tmp_path_factory):
    tied = request.param == "tied"
    root = tmp_path_factory.mktemp(f"saved-{request.param}")
    base = make_checkpoint(root / "base", seed=7, tie_word_embeddings=tied)
    specs = {**ADAPTERS, **(TIED_ONLY if tied else UNTIED_ONLY)}
    dirs = {
        name: make_peft_adapter(base, root / name, seed=60 + i, **spec)
        for i, (name, spec) in enumerate(specs.items())
    }
    assignment = [*ASSIGNMENT, "tied-copy" if tied else "tokens-head", "head"]
    rounds = [FIRST, [[*p, 7, 8, 9] for p in FIRST]]
    return base, dirs, assignment, rounds, peft_greedy(base, dirs, assignment, rounds)


def peft_greedy(base, dirs, assignment, rounds) -> list[list[list[int]]]:
    """Each round's greedy tokens from peft, every request with its adapter alone (a fresh
    PeftModel per adapter: its wrappers hold every adapter's copies side by side)."""
    config = GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0)
    models = {}
    for name, path in dirs.items():
        hf = load_hf_model(base)
        hf.generation_config.eos_token_id = None
        models[name] = PeftModel.from_pretrained(hf, path).eval()
    plain = load_hf_model(base).eval()
    plain.generation_config.eos_token_id = None
    hf = load_hf_model(base)
    hf.generation_config.eos_token_id = None
    mixed = PeftModel.from_pretrained(hf, dirs["plain"], adapter_name="plain")
    mixed.load_adapter(dirs["plain2"], adapter_name="plain2")
    names, weights = zip(*MIX, strict=True)
    mixed.add_weighted_adapter(list(names), list(weights), "mix", combination_type="cat")
    mixed.set_adapter("mix")
    models["mix"] = mixed.eval()

    def run(prompt, adapter):
        model = plain if adapter is None else models["mix" if adapter == MIX else adapter]
        out = model.generate(input_ids=torch.tensor([prompt]), generation_config=config)
        return out[0, len(prompt) :].tolist()

    return [[run(p, a) for p, a in zip(prompts, assignment, strict=True)] for prompts in rounds]


def test_saved_copies_beside_plain_dora_and_base_rows_match_peft(case):
    base, dirs, assignment, rounds, expected = case
    llm = LLM(base, dtype="float32", max_loras=len(dirs), **PRESSURE)
    for name, path in dirs.items():
        llm.load_adapter(name, path)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    for prompts, want in zip(rounds, expected, strict=True):
        outputs = llm.generate(prompts, params, adapters=assignment)
        assert [o.token_ids for o in outputs] == want
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.prefix_cache_stats.hits > 0
    manager = llm.engine.lora_manager
    held = [m for m in manager.slot_saved if m is not None]
    assert len(held) == len(dirs) - 2  # all but "plain" and "plain2"
    # The copies change the tokens: the base's rows differ from the "head" adapter's.
    row = assignment.index("head")
    alone = llm.generate([rounds[0][row]], params)[0].token_ids
    assert alone != expected[0][row]
    # The mix's second part counts: its row differs from its first adapter's alone.
    row = assignment.index(MIX)
    alone = llm.generate([rounds[0][row]], params, adapters=["plain"])[0].token_ids
    assert alone != expected[0][row]


def test_prompt_logprobs_use_the_adapters_copies(case):
    base, dirs, _, rounds, _ = case
    llm = LLM(base, dtype="float32", max_loras=2)
    llm.load_adapter("both-dora", dirs["both-dora"])
    prompt = rounds[0][2]
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    served = llm.generate([prompt], params, adapters=["both-dora"])[0].prompt_logprobs
    model = PeftModel.from_pretrained(load_hf_model(base), dirs["both-dora"]).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt])).logits[0].float()
    want = torch.log_softmax(logits, -1)[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    assert [e.token_id for e in served] == prompt[1:]
    got = torch.tensor([e.logprob for e in served])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
