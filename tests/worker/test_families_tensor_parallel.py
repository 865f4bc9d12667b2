"""The registry's families split over two ranks on CPU (gloo) give one rank's tokens: Gemma 2's
sandwich norms and soft-caps, OLMo 2's q/k norms across the heads (their mean square
all-reduced), Phi-3's fused tensors and fused-target LoRA split part by part, with LongRoPE's
switch (the rows' RoPE tables travel in the step message)."""

from __future__ import annotations

import pytest
from family_factories import WINDOW, make_family_checkpoint

from factories import make_peft_adapter, random_prompts
from worker import LLM, SamplingParams

ENGINE = {"dtype": "float32", "block_size": 4, "num_kv_blocks": 64, "max_num_batched_tokens": 32}
TARGETS = {
    "gemma2": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "olmo2": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "phi3-longrope": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
}


@pytest.mark.parametrize("family", sorted(TARGETS))
def test_two_ranks_match_one(tmp_path, family):
    """A LoRA on every projection; prompts past the window (and, for LongRoPE, short ones
    crossing the switch while decoding and long ones)."""
    base = make_family_checkpoint(tmp_path / "base", family, seed=3)
    adapter = make_peft_adapter(base, tmp_path / "a", rank=4, targets=TARGETS[family], seed=1)
    prompts = random_prompts(4, min_len=2 * WINDOW + 1, max_len=5 * WINDOW, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens = []
    for size in (1, 2):
        llm = LLM(base, **ENGINE, tensor_parallel_size=size)
        try:
            llm.load_adapter("a", adapter)
            outputs = llm.generate(prompts, params, adapters=[None, "a", None, "a"])
            tokens.append([o.token_ids for o in outputs])
        finally:
            if size == 2:
                llm.shutdown()
    assert tokens[1] == tokens[0]
