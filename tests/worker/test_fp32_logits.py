"""Logits in fp32: a bf16 model's output layer keeps its fp32 sums through the sampler, the
logprobs and the prompt logprobs, on every path.

The oracle is transformers running the same bf16 weights, its final-norm output (bf16) times
the output layer in fp32. The checkpoint is built so that two tokens' fp32 logits differ by
far less than bf16's spacing there: rounded to bf16 they tie, and the tie goes to the lower
id; in fp32 the higher id wins. Each test fails if the logits are rounded to bf16 anywhere.
"""

from __future__ import annotations

import pytest
import torch

from factories import make_checkpoint
from switchboard_kernels.linear import Linear, TorchLinear, UpcastLinear, can_pack, fp32_product
from switchboard_kernels.linear_choice import ONEDNN, PANELS, TORCH, LinearPlan
from switchboard_kernels.linear_native import Bf16PanelLinear, native_linear_bf16
from worker import LLM, SamplingParams

PROMPT = [5, 17, 42, 99, 7, 31]
LOW, HIGH = 10, 11  # the tied pair: fp32 says HIGH, a bf16 tie says LOW
LOGIT = 24.0  # the pair's logit: bf16's spacing there is 0.125


def _final_hidden(model, ids: list[int]) -> torch.Tensor:
    """transformers' final-norm output at the last position, [hidden] in the model's dtype."""
    with torch.no_grad():
        return model.model(torch.tensor([ids])).last_hidden_state[0, -1]


@pytest.fixture(scope="module")
def tie(tmp_path_factory):
    """A bf16 checkpoint whose lm_head rows LOW and HIGH differ in one weight by one bf16 step,
    so that at PROMPT's last position their fp32 logits differ by ``gap`` (> 0, far under
    bf16's 0.125 there) and round to the same bf16 value."""
    from transformers import AutoModelForCausalLM

    path = make_checkpoint(tmp_path_factory.mktemp("tie") / "base", tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    x = _final_hidden(model, PROMPT).float()
    head = model.lm_head.weight.data  # [vocab, hidden] bf16
    head[LOW] = (x * (LOGIT / x.square().sum())).bfloat16()
    order = x.abs().argsort(descending=True).tolist()
    for k in order:  # a feature whose one-step change keeps the pair inside one bf16 cell
        row = head[LOW].clone()
        w = row[k].float()
        step = (w.abs() * 2**-7).item()  # at least one bf16 step of |w|
        row[k] = (w + step * torch.sign(x[k])).bfloat16()
        logits = torch.stack([head[LOW], row]).float() @ x  # the oracle: fp32 sums
        gap = (logits[1] - logits[0]).item()
        if gap > 0 and logits.bfloat16()[0] == logits.bfloat16()[1]:
            head[HIGH] = row
            break
    else:
        pytest.fail("no feature gives a bf16 tie")
    model.save_pretrained(path, safe_serialization=True)
    return path, gap


def _pair_logprobs(top: list[tuple[int, float]]) -> tuple[float, float]:
    found = dict(top)
    return found[HIGH], found[LOW]


@pytest.mark.parametrize("options", [{}, {"batch_invariant": True}], ids=["plain", "invariant"])
def test_greedy_and_logprobs_keep_fp32_sums(tie, options):
    path, gap = tie
    llm = LLM(path, dtype="bfloat16", **options)
    out = llm.generate(
        [PROMPT, [*PROMPT, HIGH]],
        [
            SamplingParams(max_tokens=1, temperature=0.0, logprobs=5),
            SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=5),
        ],
    )
    sampled = out[0].logprobs[0]
    assert out[0].token_ids == [HIGH]  # a bf16 tie would give LOW
    high, low = _pair_logprobs(sampled.top_logprobs)
    assert high - low == pytest.approx(gap, rel=0.2)  # bf16: 0 or 0.125
    scored = out[1].prompt_logprobs[-1]  # the prompt's last token, HIGH, after PROMPT
    high, low = _pair_logprobs(scored.top_logprobs)
    assert high - low == pytest.approx(gap, rel=0.2)


def test_speculative_verification_keeps_fp32_sums(tie):
    """Prompt lookup proposes from the prompt; the verifying rows pick HIGH as plain decoding."""
    path, _ = tie
    llm = LLM(path, dtype="bfloat16", speculative_model="ngram", num_speculative_tokens=2)
    prompt = [*PROMPT, HIGH, *PROMPT]  # the lookup proposes HIGH after PROMPT
    plain = LLM(path, dtype="bfloat16").generate(
        [prompt], SamplingParams(max_tokens=4, temperature=0.0)
    )
    spec = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0))
    assert spec[0].token_ids == plain[0].token_ids
    assert spec[0].token_ids[0] == HIGH


def _weights(rows: int = 96, features: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(rows, features, generator=g) * 0.5).bfloat16()
    x = torch.randn(5, features, generator=g).bfloat16()
    return w, x


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.double() @ w.double().T).float()


def _assert_unrounded(y: torch.Tensor, ref: torch.Tensor) -> None:
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    assert (y != y.bfloat16().float()).any()  # values off bf16's grid: never rounded


def test_fp32_product_and_torch_kernel_are_unrounded():
    w, x = _weights()
    _assert_unrounded(fp32_product(x, w), _reference(x, w))
    _assert_unrounded(TorchLinear(w, fp32_out=True)(x), _reference(x, w))


@pytest.mark.skipif(native_linear_bf16() is None, reason="no native bf16 kernel on this CPU")
@pytest.mark.parametrize("fixed_order", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 8, 11])
def test_bf16_panels_fp32_out(fixed_order, rows):
    w, _ = _weights(rows=70)  # a partial last panel
    x = torch.randn(rows, w.shape[1]).bfloat16()
    y = Bf16PanelLinear(w, fixed_order=fixed_order, fp32_out=True)(x)
    _assert_unrounded(y, _reference(x, w))
    rounded = Bf16PanelLinear(w, fixed_order=fixed_order)(x)
    assert torch.equal(rounded, y.bfloat16())  # the same sums, one rounding apart


@pytest.mark.skipif(not can_pack(torch.zeros(2, 2)), reason="oneDNN does not pack here")
def test_upcast_kernel_fp32_out():
    w, x = _weights()
    _assert_unrounded(UpcastLinear(w, fp32_out=True)(x), _reference(x, w))


@pytest.mark.parametrize("plan", [(PANELS, PANELS), (ONEDNN, ONEDNN), (TORCH, TORCH)])
def test_output_layer_is_fp32_whatever_the_plan(plan):
    """oneDNN's bf16 matmul writes bf16 only: an output layer never takes it."""
    w, x = _weights()
    linear = Linear(w, plan=LinearPlan(*plan), fp32_out=True)
    _assert_unrounded(linear(x), _reference(x, w))


def test_saved_output_layer_rows_are_fp32():
    """An adapter's modules_to_save copy of lm_head, and its trainable token rows, write fp32
    sums into their rows' logits."""
    from worker.model.saved_modules import HeadPatch, Tokens, apply_heads

    w, x = _weights()
    logits = torch.zeros(x.shape[0], w.shape[0])
    apply_heads(logits, x, [HeadPatch(torch.tensor([1, 3]), w, None)])
    _assert_unrounded(logits[[1, 3]], _reference(x[[1, 3]], w))
    ids = torch.tensor([4, 9])
    tokens = Tokens(ids=ids, rows=w[ids], in_head=True)
    logits = torch.zeros(x.shape[0], w.shape[0])
    apply_heads(logits, x, [HeadPatch(torch.tensor([0]), None, tokens)])
    _assert_unrounded(logits[0, ids], _reference(x[:1], w[ids])[0])


@pytest.mark.parametrize("kernel", ["native", "torch"])
def test_draft_4bit_output_layer_is_fp32(kernel):
    """A draft's 4-bit output layer (native, or torch's int4 kernel) returns fp32 too."""
    from switchboard_kernels.linear import Int4Weight, can_quantize_int4, can_quantize_q4

    w, x = _weights(features=128)
    if kernel == "native":
        if not can_quantize_q4(w):
            pytest.skip("no native 4-bit kernel here")
        y = Linear(w, quantization="int4", fp32_out=True)(x)
    else:
        if not can_quantize_int4(w):
            pytest.skip("no torch int4 kernel here")
        y = Int4Weight(w, fp32_out=True)(x)
    assert y.dtype == torch.float32
    assert (y != y.bfloat16().float()).any()
