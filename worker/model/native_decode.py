"""A model's decode work in one native call: which models qualify, and the call built from
their weights.

Two paths, each for the models whose every kernel the C side can call (a Llama block on CPU,
RoPE on whole heads, no LongRoPE): a draft model's passes of a few tokens per sequence over its
4-bit copies (``switchboard_kernels/draft_cpu.c``), and a served model's decode steps, exact
(``switchboard_kernels/decode_step_cpu.c``). Kept beside ``worker.model.llama`` as
``worker.model.cuda_graphs`` is: each reads the model's weights and runs its steps another way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from switchboard_kernels.decode_step_native import NativeDecodeStep
from switchboard_kernels.draft_native import NativeDecodePass, native_draft
from switchboard_kernels.linear import Q4_MAX_ROWS
from worker.model.rope import RopeTables

if TYPE_CHECKING:
    from worker.model.llama import LlamaModel


def native_decode_pass(
    model: LlamaModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
) -> NativeDecodePass | None:
    """Passes of a few tokens per sequence in one native call each
    (switchboard_kernels/draft_cpu.c), where the model's weights have native 4-bit copies (a
    draft model on CPU), else None. The rows then run in fp32 throughout, on fp32 RoPE
    tables."""
    if (
        model.quantization != "int4"
        or model.device.type != "cpu"
        or not model.llama_block
        or model.long_rope is not None
        or native_draft() is None
    ):
        return None
    c = model.config
    rope = RopeTables.build(c.head_dim, c.rope, c.max_position_embeddings, torch.float32)
    try:
        return NativeDecodePass(
            embed=model.embed.contiguous(),
            layers=model.layers,
            final_norm=model.final_norm,
            lm_head=model.lm_head,
            cos=rope.cos.contiguous(),
            signed_sin=rope.signed_sin.contiguous(),
            kv_caches=kv_caches,
            heads=c.num_heads,
            eps=c.rms_norm_eps,
            max_rows=Q4_MAX_ROWS,
        )
    except (RuntimeError, ValueError):  # a projection without a native 4-bit copy
        return None


def native_decode_step(
    model: LlamaModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
) -> NativeDecodeStep | None:
    """Decode steps in one native call each, exactly as ``forward`` and ``compute_logits``
    compute them (switchboard_kernels/decode_step_cpu.c), where every kernel of the model's
    small-row path can be called from there: a Llama block on CPU, one rank, bf16 or fp32, no
    draft copies; else None. The runner still asks ``ops`` per step whether the norms,
    activation and attention plans pick the native kernels for its rows."""
    if (
        model.device.type != "cpu"
        or not model.llama_block
        or model.long_rope is not None
        or model.group is not None
        or model.quantization is not None
        or model.residual_dtype != torch.float32
    ):
        return None
    return NativeDecodeStep.build(
        embed=model.embed,
        layers=model.layers,
        final_norm=model.final_norm,
        lm_head=model.lm_head,
        cos=model.rope.cos,
        signed_sin=model.rope.signed_sin,
        kv_caches=kv_caches,
        heads=model.num_heads,
        eps=model.config.rms_norm_eps,
        scale=model.scale,
    )
