"""Every dense family on a CUDA GPU: the compiled Triton kernels (paged attention with windows and
soft-caps, the LoRA kernels on fused targets) and decode steps replayed as CUDA graphs, against
transformers + peft on the same GPU in fp32 (TF32 off). Skipped without a GPU: on CPU the same
paths run in Triton's interpreter (test_families_triton.py) or are refused."""

from __future__ import annotations

import pytest
import torch
from family_factories import FAMILIES, WINDOW, make_family_checkpoint
from peft import PeftModel
from transformers import GenerationConfig

from factories import load_hf_model, make_peft_adapter, random_prompts
from worker import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

MAX_NEW = 10
ATTENTION = {True: ["qkv_proj", "o_proj"], False: ["q_proj", "k_proj", "v_proj", "o_proj"]}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_triton_and_cuda_graphs_match_transformers(family, tmp_path):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    base = make_family_checkpoint(tmp_path / "base", family, seed=3)
    targets = ATTENTION[family.startswith("phi3")]
    adapter = make_peft_adapter(base, tmp_path / "a", rank=4, targets=targets, seed=1)
    prompts = random_prompts(5, min_len=2 * WINDOW + 1, max_len=5 * WINDOW, seed=5)
    assignment = [None, "a", None, "a", None]
    model = PeftModel.from_pretrained(load_hf_model(base), adapter, adapter_name="a").cuda()
    model.generation_config.eos_token_id = None
    config = GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0)
    expected = []
    for prompt, name in zip(prompts, assignment, strict=True):
        ids = torch.tensor([prompt], device="cuda")
        if name is None:
            with model.disable_adapter():
                out = model.generate(input_ids=ids, generation_config=config)
        else:
            out = model.generate(input_ids=ids, generation_config=config)
        expected.append(out[0, len(prompt) :].tolist())
    llm = LLM(
        base,
        dtype="float32",
        device="cuda",
        attention_backend="triton",
        cuda_graphs=True,
        max_loras=2,
        block_size=16,
    )
    llm.load_adapter("a", adapter)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outputs = llm.generate(prompts, params, adapters=assignment)
    assert [o.token_ids for o in outputs] == expected
    graphs = llm.engine.runner.graphs
    if llm.engine.model.long_rope is None:
        assert graphs is not None and graphs.num_replays > 0
