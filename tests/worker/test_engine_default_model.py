"""The engine on the real default model (SmolLM2-135M-Instruct, fp32) against transformers."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from worker import LLM, SamplingParams

pytestmark = pytest.mark.slow

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name three primary colors."},
    ],
    [{"role": "user", "content": "Write a haiku about the sea."}],
]
MAX_NEW = 32


def test_greedy_chat_matches_transformers(default_model_path):
    llm = LLM(default_model_path, dtype="float32", max_num_batched_tokens=48)
    tokenizer = llm.tokenizer
    prompts = [
        tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        for chat in CHATS
    ]
    assert all(p.startswith("<|im_start|>") for p in prompts)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW))

    hf = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32).eval()
    config = GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False)
    for prompt, out in zip(prompts, outputs, strict=True):
        ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt").input_ids
        assert out.prompt_token_ids == ids[0].tolist()
        expected = hf.generate(ids, generation_config=config)[0, ids.shape[1] :].tolist()
        assert out.token_ids == expected
        assert out.text == tokenizer.decode(
            [t for t in expected if t not in llm.engine.config.eos_token_ids],
            skip_special_tokens=True,
        )
    assert "Paris" in outputs[0].text


TEXTS = [
    "The quick brown fox jumps over the lazy dog while the farmer watches from the porch.",
    "In 1492, Columbus sailed across the Atlantic Ocean looking for a new route to Asia.",
    "Water boils at 100 degrees Celsius at sea level, but at lower temperatures on high mountains.",
]


def _hf_prompt_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def test_bf16_prompt_logprobs_are_nearer_fp32_than_transformers_bf16(default_model_path):
    """As `make run` serves the model (bf16, every kernel's own rounding), each prompt token's
    logprob, echoed, is nearer transformers' fp32 than transformers' own bf16 is (ours keeps
    the residual stream and the logits in fp32): a kernel that rounds more than it must shows
    here. Not one near-tie's answer: "What is the capital of France?" is one ("The" against
    "L", 0.08 apart in fp32), which bf16's roundings move by about 0.1 either way whatever
    the kernels (docs/performance.md), so greedy bf16 answers it either way."""
    llm = LLM(default_model_path, dtype="bfloat16")
    tokenizer = llm.tokenizer
    chats = [
        tokenizer.apply_chat_template(c, add_generation_prompt=True, return_dict=False)
        for c in CHATS
    ]
    prompts = chats + [tokenizer(t, add_special_tokens=False).input_ids for t in TEXTS]
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0))
    ours = torch.cat([torch.tensor([t.logprob for t in o.prompt_logprobs]) for o in outs])
    fp32, bf16 = (
        AutoModelForCausalLM.from_pretrained(default_model_path, dtype=dtype).eval()
        for dtype in (torch.float32, torch.bfloat16)
    )
    want = torch.cat([_hf_prompt_logprobs(fp32, ids) for ids in prompts])
    theirs = torch.cat([_hf_prompt_logprobs(bf16, ids) for ids in prompts])
    ours_distance = (ours.double() - want.double()).abs().mean()
    theirs_distance = (theirs.double() - want.double()).abs().mean()
    assert ours_distance < theirs_distance, (float(ours_distance), float(theirs_distance))
