"""switchboard_kernels/draft_cpu.c: a 4-bit draft model's one-token passes in one native call.

The reference is transformers on the same checkpoint with every projection replaced by
the 4-bit levels the kernel multiplies by (``switchboard_kernels.q4_native.quantize_weight``), and
each projection's input rows rounded to int8 per group as the kernel rounds them (a hook
before every ``nn.Linear``). In fp32 the two agree to summation order, except where that
order puts a value on the other side of an int8 tie (``assert_matches_up_to_ties``);
rounding the rows at all moves these logits by ~3%, so a pass wired wrong cannot hide.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DynamicCache

from factories import load_hf_model, make_checkpoint
from q4_levels import activation_levels
from switchboard_kernels.draft_native import native_draft
from switchboard_kernels.q4_native import dequantize_weight, native_q4, quantize_weight
from worker.core.batch import ScheduledSequence
from worker.core.block_manager import BlockManager
from worker.core.sequence import Sequence
from worker.model.llama import LlamaModel
from worker.model.model_runner import ModelRunner

pytestmark = pytest.mark.skipif(
    native_q4() is None or native_draft() is None, reason="no C compiler here"
)
BLOCK = 4  # small blocks: the sequences below cross several
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def four_bit_checkpoint(src: Path, dst: Path) -> Path:
    """The checkpoint with each projection and the output layer on its 4-bit levels."""
    dst.mkdir()
    weights = load_file(src / "model.safetensors")
    for name, w in weights.items():
        if name.endswith(".weight") and (name.split(".")[-2] in PROJECTIONS or "lm_head" in name):
            weights[name] = dequantize_weight(*quantize_weight(w)).contiguous()
    save_file(weights, dst / "model.safetensors")
    (dst / "config.json").write_text((src / "config.json").read_text())
    return dst


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def checkpoints(request, tmp_path_factory):
    """(draft checkpoint, the same on its 4-bit levels): hidden 128 (two groups of 64
    features), untied output layer (quantized; the embeddings are not), every weight on
    bf16's grid (so that a bf16 model quantizes the same values)."""
    root = tmp_path_factory.mktemp(request.param)
    src = make_checkpoint(
        root / "draft",
        arch=request.param,
        hidden_size=128,
        num_heads=4,
        num_kv_heads=2,
        tie_word_embeddings=False,
        seed=3,
    )
    weights = load_file(src / "model.safetensors")
    save_file({k: w.bfloat16().float() for k, w in weights.items()}, src / "model.safetensors")
    return src, four_bit_checkpoint(src, root / "levels")


def runner_for(path: Path, dtype: torch.dtype, output_token_ids=None):
    model = LlamaModel.from_pretrained(
        path, dtype=dtype, quantization="int4", output_token_ids=output_token_ids
    )
    blocks = BlockManager(num_blocks=64, block_size=BLOCK, enable_caching=False)
    return ModelRunner(model, num_blocks=64, block_size=BLOCK), blocks


def decode_token_by_token(runner, blocks, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Each prompt's tokens fed one a step, all prompts batched (the first token of each as
    a one-token prefill), as a draft catching up token by token would; returns each
    prompt's logits [len - 1, columns], from its second token on."""
    seqs = [Sequence(str(i), [p[0]], None, 0) for i, p in enumerate(prompts)]
    for s, p in zip(seqs, prompts, strict=True):
        blocks.allocate(s.block_table, len(p))
        runner.execute([ScheduledSequence(s, 0, 1)], kept_only=True)
        s.num_computed_tokens = 1
    rows: list[list[torch.Tensor]] = [[] for _ in prompts]
    for t in range(1, max(map(len, prompts))):
        live = [i for i, p in enumerate(prompts) if t < len(p)]
        for i in live:
            seqs[i].tokens.append(prompts[i][t])
        order, logits = runner.execute(
            [ScheduledSequence(seqs[i], t, 1) for i in live], kept_only=True
        )
        assert [o.seq for o in order] == [seqs[i] for i in live]  # rows in the order given
        for row, i in enumerate(live):
            rows[i].append(logits[row])
            seqs[i].num_computed_tokens += 1
    return [torch.stack(r) for r in rows]


def reference(levels: Path):
    """transformers on the 4-bit levels, each projection's input rows rounded to int8 per
    group of 64 features as the kernel rounds them (``activation_levels``)."""
    model = load_hf_model(levels)

    def round_rows(module, args):
        x = args[0]
        return (activation_levels(x.reshape(-1, x.shape[-1])).to(x.dtype).view_as(x),)

    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(round_rows)
    return model


def reference_rows(hf, prompt: list[int], rows: list[int]) -> torch.Tensor:
    """The reference's logits after each of ``rows`` (token indices), each from its own pass
    over the prompt up to it. Not one pass over the whole prompt: where a CPU sums that
    pass's attention in another order (seen on a Xeon: 1e-6 apart), an activation near a
    tie between two int8 levels rounds the other way and moves later rows ~1%, exactly as
    a pass over the prefix alone differs from the whole prompt's there."""
    with torch.no_grad():
        return torch.stack([hf(torch.tensor([prompt[: r + 1]])).logits[0, -1] for r in rows])


def reference_chunks(hf, prompt: list[int], chunks: list[int]) -> torch.Tensor:
    """The reference's logits after each chunk's last token, fed chunk by chunk through its
    own KV cache: passes of the shapes the engine ran (see ``reference_rows``)."""
    cache, rows, start = DynamicCache(config=hf.config), [], 0
    with torch.no_grad():
        for n in chunks:
            ids = torch.tensor([prompt[start : start + n]])
            out = hf(input_ids=ids, cache=cache, use_cache=True)
            rows.append(out.logits[0, -1])
            start += n
    return torch.stack(rows)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


# What one int8 level taken on the other side of a rounding tie moves a row of these
# logits by: up to 1.2% (seen on an AVX2 EPYC). Every row's pass rounds some value within
# 1e-4 of a level's tie, and a pass summing in another order (1e-6 apart) lands there.
TIE_FLIP = 2e-2


def assert_matches_up_to_ties(got: torch.Tensor, want: torch.Tensor, unrounded: torch.Tensor):
    """``got`` is the reference ``want`` up to summation order and the int8 ties it flips:
    each row within 1e-4 or off by about one flipped level; at least a quarter of the rows
    within 1e-4 (a pass with a small error of its own, an epsilon say, has none); and the
    whole far nearer ``want`` than ``unrounded`` (the same model without the rounding: each
    row 2-5% away), so a pass that skipped or misplaced the rounding cannot pass."""
    rows = [relative_error(g, w) for g, w in zip(got, want, strict=True)]
    assert max(rows) < TIE_FLIP, rows
    assert sum(e < 1e-4 for e in rows) >= len(rows) / 4, rows
    assert relative_error(got, want) < 0.5 * relative_error(unrounded, want), rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_passes_match_transformers_on_the_4bit_levels(checkpoints, dtype):
    src, levels = checkpoints
    runner, blocks = runner_for(src, dtype)
    assert runner.native_pass is not None
    prompts = [[5, 9, 3, 7, 11, 40, 2, 8, 13, 90, 77], [17, 4, 200], [250, 6, 6, 6, 31, 8, 1]]
    logits = decode_token_by_token(runner, blocks, prompts)
    hf, plain = reference(levels), load_hf_model(levels)
    rows = [list(range(1, len(prompt))) for prompt in prompts]  # [len - 1, vocab] each
    got = torch.cat(logits)
    want = torch.cat([reference_rows(hf, p, r) for p, r in zip(prompts, rows, strict=True)])
    if dtype == torch.float32:  # the same arithmetic up to summation order
        unrounded = [reference_rows(plain, p, r) for p, r in zip(prompts, rows, strict=True)]
        assert_matches_up_to_ties(got, want, torch.cat(unrounded))
    else:
        # The K/V cached in bf16 move some rows' int8 levels, as much again as the rounding
        # itself (the pass runs in fp32); a pass wired wrong is off by ~100%.
        assert relative_error(got, want) < 0.08, relative_error(got, want)


def test_a_cut_down_output_layer_gives_its_own_columns(checkpoints, tmp_path):
    """A draft's output layer cut to some tokens (draft_vocab.json): the pass returns those
    columns; the runner widens them to the vocabulary (-inf elsewhere) unless asked not to."""
    src, levels = checkpoints
    kept = torch.tensor([2, 5, 9, 40, 41, 77, 100, 255])
    runner, blocks = runner_for(src, torch.float32, output_token_ids=kept)
    prompt = [5, 9, 3, 7, 11, 40]
    (got,) = decode_token_by_token(runner, blocks, [prompt])
    rows = list(range(1, len(prompt)))
    want = reference_rows(reference(levels), prompt, rows)[:, kept]
    unrounded = reference_rows(load_hf_model(levels), prompt, rows)[:, kept]
    assert got.shape == (len(prompt) - 1, len(kept))
    assert_matches_up_to_ties(got, want, unrounded)
    s = Sequence("wide", prompt, None, 0)
    blocks.allocate(s.block_table, len(prompt))
    runner.execute([ScheduledSequence(s, 0, len(prompt) - 1)])
    _, wide = runner.execute([ScheduledSequence(s, len(prompt) - 1, 1)])
    assert wide.shape == (1, 256) and torch.isinf(wide[0, 3])
    assert torch.isfinite(wide[0, kept]).all()


def test_sequences_feeding_several_tokens_at_once(checkpoints):
    """As after a verification that accepted drafts: each sequence feeds the tokens since
    its last pass in one go (chunks of 1-5 here, sequences of different lengths batched),
    attending causally among them; logits after each chunk's last token."""
    src, levels = checkpoints
    runner, blocks = runner_for(src, torch.float32)
    prompts = [[5, 9, 3, 7, 11, 40, 2, 8, 13, 90, 77, 6], [17, 4, 200, 31, 9, 9, 1]]
    chunks = [[3, 1, 5, 2, 1], [2, 4, 1]]  # tokens fed per pass
    seqs = [Sequence(str(i), list(p), None, 0) for i, p in enumerate(prompts)]
    for s, p in zip(seqs, prompts, strict=True):
        blocks.allocate(s.block_table, len(p))
    got: list[list[torch.Tensor]] = [[], []]
    ends: list[list[int]] = [[], []]
    for step in range(max(map(len, chunks))):
        scheduled = []
        for i, s in enumerate(seqs):
            if step < len(chunks[i]):
                start = sum(chunks[i][:step])
                s.tokens = prompts[i][: start + chunks[i][step]]  # it samples after them
                scheduled.append(ScheduledSequence(s, start, chunks[i][step]))
        order, logits = runner.execute(scheduled, kept_only=True)
        for row, sch in zip(logits, order, strict=True):
            i = seqs.index(sch.seq)
            got[i].append(row)
            ends[i].append(sch.start + sch.num_tokens - 1)
    hf, plain = reference(levels), load_hf_model(levels)
    assert_matches_up_to_ties(
        torch.cat([torch.stack(rows) for rows in got]),
        torch.cat([reference_chunks(hf, p, c) for p, c in zip(prompts, chunks, strict=True)]),
        torch.cat([reference_chunks(plain, p, c) for p, c in zip(prompts, chunks, strict=True)]),
    )


def test_other_steps_take_the_torch_path(checkpoints):
    """Steps past the pass's rows, verification rows and models without native 4-bit copies
    never reach the native pass; the torch path computes the same step within rounding."""
    src, _ = checkpoints
    runner, blocks = runner_for(src, torch.float32)
    calls = []
    native = runner.native_pass

    class Counting:
        max_rows = native.max_rows

        def __call__(self, feeds):
            calls.append(feeds)
            return native(feeds)

    runner.native_pass = Counting()  # type: ignore[assignment]
    prompt = list(range(3, 3 + native.max_rows + 2))
    s = Sequence("a", prompt, None, 0)
    blocks.allocate(s.block_table, len(prompt) + 3)
    runner.execute([ScheduledSequence(s, 0, native.max_rows + 1)])
    assert not calls  # a prefill of more rows than the pass takes
    s.num_computed_tokens = native.max_rows + 1
    s.spec_token_ids = [4, 4]
    runner.execute([ScheduledSequence(s, s.num_computed_tokens, 1, num_spec=2)])
    assert not calls  # a verification
    s.clear_spec()
    _, fast = runner.execute([ScheduledSequence(s, s.num_computed_tokens, 1)])
    assert len(calls) == 1
    runner.native_pass = None
    _, slow = runner.execute([ScheduledSequence(s, s.num_computed_tokens, 1)])
    assert relative_error(fast, slow) < 0.05
    plain = LlamaModel.from_pretrained(src, dtype=torch.float32)
    assert ModelRunner(plain, num_blocks=8, block_size=BLOCK).native_pass is None


def test_rows_that_do_not_fit_are_refused(checkpoints):
    src, _ = checkpoints
    runner, _ = runner_for(src, torch.float32)
    native = runner.native_pass
    with pytest.raises(ValueError, match="do not fit"):
        native([([5, 6], 7, [0, 1])])  # positions 7-8 past a table of 2 blocks of 4
    with pytest.raises(ValueError, match="do not fit"):
        native([([256], 0, [0])])  # a token past the vocabulary
    with pytest.raises(ValueError, match="do not fit"):
        native([([5] * 17, 0, list(range(5)))])  # more rows than the pass takes
    with pytest.raises(ValueError, match="do not fit"):
        native([([5], 0, [64])])  # a block past the cache
