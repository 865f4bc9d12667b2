"""The windowed and soft-capped families on the Triton attention kernels (in the interpreter on
CPU) against transformers: Gemma 2's alternating sliding/full layers with both soft-caps."""

import os

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import triton.language as tl  # noqa: E402
from family_factories import WINDOW, make_family_checkpoint  # noqa: E402
from transformers import GenerationConfig  # noqa: E402

from factories import load_hf_model, random_prompts  # noqa: E402
from worker import LLM, SamplingParams  # noqa: E402

needs_triton = pytest.mark.skipif(
    not CUDA and type(tl.zeros).__name__ != "InterpretedFunction",
    reason="the Triton kernels on CPU need TRITON_INTERPRET=1 before triton is imported",
)


@needs_triton
@pytest.mark.parametrize("family", ["gemma2", "mistral-window"])
def test_triton_backend_matches_transformers_past_the_window(tmp_path, family):
    """Prompts of 2-5 windows, prefilled in chunks of 16 over cached context, then decodes."""
    base = make_family_checkpoint(tmp_path, family, seed=3)
    prompts = random_prompts(3, min_len=2 * WINDOW, max_len=5 * WINDOW, seed=6)
    hf = load_hf_model(base)
    hf.generation_config.eos_token_id = None
    config = GenerationConfig(max_new_tokens=6, do_sample=False, pad_token_id=0)
    expected = [
        hf.generate(torch.tensor([p]), generation_config=config)[0, len(p) :].tolist()
        for p in prompts
    ]
    llm = LLM(
        base,
        dtype="float32",
        device="cuda" if CUDA else "cpu",
        attention_backend="triton",
        block_size=4,
        num_kv_blocks=128,
        max_num_batched_tokens=16,
        max_loras=0,
    )
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
