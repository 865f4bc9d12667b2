"""The registry's families split over two ranks on CPU (gloo) give one rank's tokens; the
families whose block does not split by heads are refused by name."""

from __future__ import annotations

import pytest
from family_factories import WINDOW, make_family_checkpoint

from factories import make_peft_adapter, random_prompts
from worker import LLM, SamplingParams
from worker.errors import TensorParallelConfigError
from worker.model.model_config import ModelConfig
from worker.model.sharding import check_divisible

ENGINE = {"dtype": "float32", "block_size": 4, "num_kv_blocks": 64, "max_num_batched_tokens": 32}


def test_gemma2_on_two_ranks_matches_one(tmp_path):
    """Sandwich norms, soft-caps, alternating windows and a LoRA on every projection, with
    the embedding scale after the vocabulary-parallel all-reduce."""
    base = make_family_checkpoint(tmp_path / "base", "gemma2", seed=3)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    adapter = make_peft_adapter(base, tmp_path / "a", rank=4, targets=targets, seed=1)
    prompts = random_prompts(4, min_len=2 * WINDOW, max_len=5 * WINDOW, seed=5)
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


@pytest.mark.parametrize("family", ["olmo2", "phi3"])
def test_blocks_that_do_not_split_by_heads_are_refused(tmp_path, family):
    config = ModelConfig.from_pretrained(make_family_checkpoint(tmp_path, family))
    with pytest.raises(TensorParallelConfigError, match=family):
        check_divisible(config, 2)
    check_divisible(config, 1)
