"""The decoder's output layer (``lm_head``) as loaded, and what turns its product into the
vocabulary's logits.

Split by vocabulary under tensor parallelism (``worker.model.sharding``), each rank holds its
ids' rows, padded with zero rows to ``Shard.vocab_rows`` (the embedding is padded alike). A
draft model may keep a cut-down layer instead, over the tokens it predicts only: for a small
model the full one is most of a step. Families that shape their logits (Granite's scale, Gemma
2's soft-cap) are shaped here, as the architecture registry's ``Block`` says.
"""

from __future__ import annotations

import torch

from switchboard_kernels.linear import Linear
from switchboard_kernels.linear_choice import LinearPlan
from worker.errors import ModelLoadError
from worker.model.architectures import Block
from worker.model.model_config import ModelConfig
from worker.model.quantize_on_load import OnLoad, output_layer


def vocab_padded(rows: torch.Tensor, vocab_rows: int) -> torch.Tensor:
    """A vocabulary shard [ids, hidden] padded with zero rows to ``vocab_rows``."""
    missing = vocab_rows - rows.shape[0]
    if missing <= 0:
        return rows
    return torch.cat([rows, rows.new_zeros(missing, rows.shape[1])])


def load_lm_head(
    weights: dict[str, torch.Tensor],
    config: ModelConfig,
    *,
    vocab_rows: int,
    kept_token_ids: torch.Tensor | None,
    split: bool,
    quantization: str | None,
    plan: LinearPlan | None,
    on_load: OnLoad | None,
) -> Linear:
    """The output layer over this rank's ``vocab_rows``, or over ``kept_token_ids`` only (on
    the model's device; never ``split`` over ranks). fp32 out: the logits keep the product's
    fp32 sums through the sampler and logprobs (rounded to bf16 they sit on a grid, 0.125
    apart near the top, and tie)."""
    head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    if head not in weights:
        raise ModelLoadError(f"the checkpoint has no {head} (tie_word_embeddings is False)")
    head_weight = vocab_padded(weights[head], vocab_rows)
    if kept_token_ids is not None:
        if split:
            raise ValueError("a cut-down output layer is for a draft model, never split")
        head_weight = head_weight[kept_token_ids].contiguous()
    head_weight = output_layer(on_load, head, head_weight)
    return Linear(head_weight, quantization=quantization, plan=plan, fp32_out=True)


def shaped_logits(logits: torch.Tensor, block: Block) -> torch.Tensor:
    """Granite's logits scale and Gemma 2's final soft-cap (padded vocabulary rows stay 0)."""
    if block.logits_scale != 1.0:
        logits = logits * block.logits_scale
    if block.final_softcap is not None:
        logits = torch.tanh(logits / block.final_softcap) * block.final_softcap
    return logits


def full_logits(
    kept: torch.Tensor, kept_token_ids: torch.Tensor | None, vocab_size: int
) -> torch.Tensor:
    """Logits over the kept tokens [rows, kept] -> [rows, vocab], -inf elsewhere; ``kept``
    itself where every token is kept (``kept_token_ids`` None)."""
    if kept_token_ids is None:
        return kept
    full = kept.new_full((kept.shape[0], vocab_size), float("-inf"))
    return full.index_copy_(1, kept_token_ids, kept)
