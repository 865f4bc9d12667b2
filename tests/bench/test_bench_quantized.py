"""bench.quantized's scoring: the logits it captures from an engine's prompt logprobs are the
model's next-token logits at every position (against transformers, fp32)."""

from __future__ import annotations

import torch

from bench.quantized import scored_logits
from factories import load_hf_model, make_checkpoint, random_prompts
from worker import LLM


def test_scored_logits_are_every_positions_next_token_logits(tmp_path):
    base = make_checkpoint(tmp_path / "base", seed=3)
    tokens = random_prompts(1, min_len=20, max_len=20, seed=4)[0]
    got = scored_logits(LLM(base, dtype="float32"), tokens)
    with torch.no_grad():
        want = load_hf_model(base)(torch.tensor([tokens])).logits[0, :-1]
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
