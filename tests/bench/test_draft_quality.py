"""bench.draft_quality: its replay of greedy speculation, counted by hand, and its int8
rounding against the engine's int8 model."""

from __future__ import annotations

import pytest
import torch

from bench.draft_quality import chain_tokens, round_to_int8
from factories import make_checkpoint, random_prompts
from switchboard_kernels.linear_native import native_linear
from worker.core.batch import ScheduledSequence
from worker.core.block_manager import BlockManager
from worker.core.sequence import Sequence
from worker.model.llama import LlamaModel
from worker.model.model_runner import ModelRunner


def test_a_chain_of_k_drafts_gives_the_matches_in_a_row_plus_the_targets_token():
    assert chain_tokens([True] * 10, 4) == 10 / 2  # 4 accepted + 1, twice
    assert chain_tokens([False] * 10, 4) == 1.0  # every verification gives the target's own
    # k = 2 over T T F T F F T: [T T]+1 -> position 3; [T F]: 1+1 -> 5; [F]: 1 -> 6; end: 1.
    assert chain_tokens([True, True, False, True, False, False, True], 2) == 7 / 4
    # The last position is always the target's own token: no draft is checked past the end.
    assert chain_tokens([True, True, True], 4) == 3.0


@pytest.mark.skipif(native_linear() is None, reason="no C compiler: no int8 kernel")
def test_int8_rounding_matches_the_engines_int8_model(tmp_path):
    """bench.draft_quality --int8 ranks with transformers' model whose weights are rounded as
    the engine's int8 panels hold them: the engine's int8 model (the native kernel) gives
    the same logits, and both differ from the exact model's."""
    from transformers import AutoModelForCausalLM

    path = make_checkpoint(tmp_path, arch="llama", num_heads=4, num_kv_heads=2)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    exact_weight = hf.lm_head.weight.detach().clone()
    round_to_int8(hf)
    assert torch.equal(hf.model.embed_tokens.weight, exact_weight)  # the embedding is kept
    model = LlamaModel.from_pretrained(path, dtype=torch.float32, quantization="int8")
    runner = ModelRunner(model, num_blocks=16, block_size=4)
    prompt = random_prompts(1, min_len=12, max_len=12, seed=3)[0]
    seq = Sequence("r", prompt, None, 0)
    BlockManager(num_blocks=16, block_size=4).allocate(seq.block_table, seq.num_tokens)
    logits = runner.execute([ScheduledSequence(seq, 0, seq.num_tokens)])[1]  # last position
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0, -1]
        exact = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)(
            torch.tensor([prompt])
        ).logits[0, -1]
    torch.testing.assert_close(logits[0], want, atol=1e-4, rtol=1e-4)
    assert (exact - want).abs().max() > 1e-2  # the rounding is visible, so the check bites
