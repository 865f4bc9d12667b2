"""DoRA rows beside plain LoRA rows and base rows in one step, against peft one adapter at a
time (fp32), through preemption and prefix-cache hits, on the native and the torch CPU paths."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file
from transformers import GenerationConfig

from factories import load_hf_model, make_checkpoint, make_peft_adapter, random_prompts
from switchboard_kernels import lora_native
from worker import LLM, SamplingParams

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {
    "plain": {"rank": 4, "targets": ALL},
    "dora-all": {"rank": 8, "targets": ALL, "use_dora": True},
    # q and v but not k: one fused group with DoRA and plain outputs side by side.
    "dora-qv": {"rank": 2, "targets": ["q_proj", "v_proj"], "use_dora": True},
    "dora-mlp": {
        "rank": 4,
        "targets": ["up_proj", "down_proj"],
        "use_dora": True,
        "use_rslora": True,
    },
}
ASSIGNMENT = [None, "plain", "dora-all", "dora-qv", "dora-mlp", None, "dora-all", "plain"]
MAX_NEW = 12
# A pool this small preempts; the second round's prompts extend the first's (prefix hits).
PRESSURE = {"block_size": 4, "num_kv_blocks": 30, "max_num_batched_tokens": 48}


@pytest.fixture(scope="module", params=["llama", "qwen2"])  # qwen2: q/k/v biases
def case(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"dora-{request.param}")
    base = make_checkpoint(root / "base", arch=request.param, seed=5)
    dirs = {
        name: make_peft_adapter(base, root / name, seed=40 + i, **spec)
        for i, (name, spec) in enumerate(ADAPTERS.items())
    }
    first = random_prompts(len(ASSIGNMENT), min_len=5, max_len=20, seed=6)
    rounds = [first, [[*p, 7, 8, 9] for p in first]]
    return base, dirs, rounds, peft_greedy(base, dirs, rounds)


def peft_greedy(base, dirs, rounds) -> list[list[list[int]]]:
    """Each round's greedy tokens from peft, every request with its adapter alone."""
    hf = load_hf_model(base)
    hf.generation_config.eos_token_id = None
    config = GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0)
    names = list(dirs)
    model = PeftModel.from_pretrained(hf, dirs[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(dirs[name], adapter_name=name)
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


@pytest.mark.parametrize("form", ["native", "torch"])
def test_dora_plain_and_base_rows_in_one_batch_match_peft(case, form, monkeypatch):
    base, dirs, rounds, expected = case
    if form == "torch":  # as where the native kernel cannot be built
        monkeypatch.setattr(lora_native, "native_library", lambda: None)
    elif lora_native.native_library() is None:
        pytest.skip("no C compiler here: the native kernel is not built")
    llm = LLM(base, dtype="float32", max_loras=len(ADAPTERS), **PRESSURE)
    for name, path in dirs.items():
        llm.load_adapter(name, path)
    manager = llm.engine.lora_manager
    assert manager.native == (form == "native")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    for prompts, want in zip(rounds, expected, strict=True):
        outputs = llm.generate(prompts, params, adapters=ASSIGNMENT)
        assert [o.token_ids for o in outputs] == want
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.prefix_cache_stats.hits > 0
    assert sum(manager.slot_dora) == 3
    # DoRA really changes the tokens: the same A and B without the magnitudes do not give them.
    llm.load_adapter("no-magnitudes", without_magnitudes(dirs["dora-all"], base.parent / form))
    row = ASSIGNMENT.index("dora-all")
    plain = llm.generate([rounds[0][row]], params, adapters=["no-magnitudes"])[0].token_ids
    assert plain != expected[0][row]


def without_magnitudes(src: Path, dst: Path) -> Path:
    """The DoRA adapter at ``src`` as a plain LoRA: its A and B, no magnitude vectors."""
    shutil.copytree(src, dst)
    weights = dst / "adapter_model.safetensors"
    tensors = load_file(weights)
    save_file({k: v for k, v in tensors.items() if "magnitude" not in k}, weights)
    config = json.loads((dst / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps({**config, "use_dora": False}))
    return dst
