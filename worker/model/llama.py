"""Our decoder over a flattened, paged batch: the Llama block, and every family the architecture
registry (``worker.model.architectures``) describes as departures from it (q/k norms, norm
placement, multipliers, GeLU, soft-caps, sliding windows, per-layer RoPE, fused checkpoints, sparse
MoE MLPs: ``worker.model.moe``). A Llama-block checkpoint runs the Llama loop as it always has; the
others run ``_forward_block``.

Plain tensors and functions rather than ``nn.Module``s: no hooks or parameter bookkeeping
on the hot path. q/k/v and gate/up projections are fused into one matmul each (fewer,
larger GEMMs); their HF weights are concatenated at load time.

Under tensor parallelism each rank holds its shard (``worker.model.sharding``: Megatron-LM's
split) and the forward pass adds the collectives: an all-reduce after the vocabulary-parallel
embedding and after each row-parallel projection (o, down, a sparse layer's experts), the logits
gathered to rank 0.

Beside it: the output layer (``worker.model.lm_head``), how a projection joins the residual stream
(``worker.model.residual_stream``) and the decode paths in one native call
(``worker.model.native_decode``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from switchboard_kernels.linear_choice import LinearPlan
from switchboard_kernels.paged_attention import AttentionMetadata, attend
from switchboard_kernels.rope_native import check_positions, native_rope
from worker.errors import ModelLoadError
from worker.model.architectures import Activation, QKNorm
from worker.model.checkpoint_files import load_weights
from worker.model.layer_lora import LayerLora
from worker.model.layers import decode_weight_bytes, load_layer, norm_weight
from worker.model.lm_head import full_logits, load_lm_head, shaped_logits, vocab_padded
from worker.model.model_config import ModelConfig
from worker.model.moe import moe_mlp
from worker.model.native_decode import native_decode_pass, native_decode_step
from worker.model.op_choice import OpPlans, fixed_op_plans
from worker.model.quantize_on_load import OnLoad
from worker.model.residual_stream import projected, row_parallel, stream_dtype
from worker.model.rope import (
    RopeTables,
    apply_partial_rope,
    apply_rope,
    long_rope_threshold,
    rotary_dim,
)
from worker.model.saved_modules import HeadPatch, apply_heads
from worker.model.sharding import Shard
from worker.model.step_interrupt import StepInterrupt

if TYPE_CHECKING:
    from switchboard_kernels.decode_step_native import NativeDecodeStep
    from switchboard_kernels.draft_native import NativeDecodePass
    from worker.model.lora_manager import LoraBatch
    from worker.model.parallel_group import TensorParallelGroup


def projection_shapes(c: ModelConfig) -> list[tuple[int, int]]:
    """One layer's projections as [out, in]: qkv, o, gate_up, down (what ``LlamaModel``
    multiplies a step's rows by; ``linear_choice`` times its kernels on them)."""
    attention = c.num_heads * c.head_dim
    qkv = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    return [
        (qkv, c.hidden_size),
        (c.hidden_size, attention),
        (2 * c.intermediate_size, c.hidden_size),
        (c.hidden_size, c.intermediate_size),
    ]


class LlamaModel:
    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype,
        output_token_ids: torch.Tensor | None = None,
        *,
        quantization: str | None = None,
        group: TensorParallelGroup | None = None,
        linear_plan: LinearPlan | None = None,
        op_plans: OpPlans | None = None,
        on_load: OnLoad | None = None,
    ):
        """``weights`` on the device the model runs on (``switchboard_kernels.linear`` packs on
        CPU).

        ``output_token_ids``: compute logits for these tokens only, the rest -inf (a draft
        model's cut-down output layer: for a small model the full one is most of a step).
        ``quantization``: "int8" or "int4" copies of the projections and the output layer
        (``switchboard_kernels.linear``): approximate, for a draft model only. ``group``: this
        rank's tensor-parallel group, ``weights`` then being its shard (``from_pretrained``).
        ``linear_plan``: the projections' kernels (``switchboard_kernels.linear_choice``; None:
        its fixed rule); ``op_plans`` the other ops' (``worker.model.op_choice``; None: its
        fixed rule). ``on_load``: a served base's projections quantized as they load
        (``worker.model.quantize_on_load``: weight-only, exact up to the weights' rounding;
        not the draft's ``quantization``)."""
        if on_load is not None and quantization is not None:
            raise ValueError("a base quantized on load takes no draft quantization")
        self.config = config
        self.dtype = dtype
        self.device = weights["model.embed_tokens.weight"].device
        self.residual_dtype = stream_dtype(dtype, self.device)
        self.group = group
        # An armed step of batch work stops at a layer's start when interactive work arrives
        # (``worker.model.step_interrupt``; the engine arms it, never under a group).
        self.interrupt = StepInterrupt()
        c = config
        self.shard = group.shard if group is not None else Shard(0, 1)
        self.num_heads = c.num_heads // self.shard.size  # this rank's heads
        self.num_kv_heads = c.num_kv_heads // self.shard.size
        self.q_size = self.num_heads * c.head_dim
        self.kv_size = self.num_kv_heads * c.head_dim
        block = c.block
        self.scale = block.attention_scale or c.head_dim**-0.5
        # The Llama block exactly: the Llama loop, the native draft pass (RoPE on whole heads).
        self.llama_block = block.is_llama and rotary_dim(c.head_dim, c.rope) == c.head_dim
        # Vocabulary-parallel: this rank's rows of the embedding and the output layer, ids
        # vocab_start .. vocab_start + rows, padded with zero rows to vocab_rows.
        self.vocab_start = self.shard.vocab_span(c.vocab_size).start
        self.vocab_rows = self.shard.vocab_rows(c.vocab_size)
        self.embed = vocab_padded(weights["model.embed_tokens.weight"], self.vocab_rows)
        self.final_norm = norm_weight(weights, "model.norm.weight", c.block.norm_offset)
        self.output_token_ids = (
            None if output_token_ids is None else output_token_ids.to(self.device)
        )
        self.lm_head = load_lm_head(
            weights,
            c,
            vocab_rows=self.vocab_rows,
            kept_token_ids=self.output_token_ids,
            split=group is not None,
            quantization=quantization,
            plan=linear_plan,
            on_load=on_load,
        )
        self.quantization = quantization
        self.linear_plan = linear_plan
        # The other ops' kernels (RMSNorm, the activation; attention and LoRA for the runner
        # and the LoRA manager): measured on this CPU by the engine, else the fixed rule.
        self.ops = op_plans or fixed_op_plans(dtype, self.device)
        self.on_load = on_load
        self.layers = [
            load_layer(
                weights,
                i,
                c,
                quantization=quantization,
                plan=linear_plan,
                shards=self.shard.size,
                on_load=on_load,
            )
            for i in range(c.num_layers)
        ]
        self.decode_weight_bytes = decode_weight_bytes(
            self.layers, lm_head=self.lm_head, final_norm=self.final_norm
        )
        ropes = block.ropes or (c.rope,)
        self.ropes = [
            RopeTables.build(c.head_dim, r, c.max_position_embeddings, dtype).to(self.device)
            for r in ropes
        ]
        self.rope = self.ropes[0]
        # RoPE in place over the fused q/k rows where the native kernel serves the dtype.
        self._native_rope = self.device.type == "cpu" and dtype in (torch.bfloat16, torch.float32)
        # LongRoPE: a sequence longer than this rotates with the long factors (its rows look up
        # ``rope_positions``: see ``forward``); None: positions are all RoPE needs.
        self.long_rope = long_rope_threshold(c.rope)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        output_token_ids: torch.Tensor | None = None,
        quantization: str | None = None,
        group: TensorParallelGroup | None = None,
        linear_plan: LinearPlan | None = None,
        op_plans: OpPlans | None = None,
        on_load: OnLoad | None = None,
    ) -> LlamaModel:
        """``group``: load this rank's shard only (each tensor's slice read from the file)."""
        config = ModelConfig.from_pretrained(path)
        if on_load is not None and config.quantization is not None:
            raise ModelLoadError(
                f"{path} is published quantized ({config.quantization.method}): it is served as "
                "it is, not quantized again on load (drop --quantization)"
            )
        shard = None if group is None else group.shard
        weights = load_weights(Path(path), config, dtype=dtype, device=device, shard=shard)
        return cls(
            config,
            weights,
            dtype,
            output_token_ids,
            quantization=quantization,
            group=group,
            linear_plan=linear_plan,
            op_plans=op_plans,
            on_load=on_load,
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer, [num_slots, kv_heads, dim]
        meta: AttentionMetadata,
        lora: LoraBatch | None = None,
        rope_positions: torch.Tensor | None = None,  # [num_tokens] int64
    ) -> torch.Tensor:  # [num_tokens, hidden]
        """``rope_positions``: the rows of the RoPE tables to rotate with (LongRoPE: a long
        sequence's positions past the short rows; ``StepInputs.rope_positions``), else
        ``positions``."""
        rotary = positions if rope_positions is None else rope_positions
        if not self.llama_block:
            return self._forward_block(input_ids, positions, rotary, kv_caches, meta, lora)
        c = self.config
        rope = native_rope() if self._native_rope else None
        if rope is not None:
            check_positions(rotary, self.rope.cos.shape[0])
        else:
            cos, sin = self.rope.lookup(rotary)  # each [num_tokens, 1, head_dim]
        hidden = self._embed(input_ids)
        if lora is not None and lora.saved is not None:
            lora.saved.embed(hidden, input_ids)  # rows whose adapter has embedding rows
        num_tokens = hidden.shape[0]
        for index, (layer, (key_cache, value_cache)) in enumerate(
            zip(self.layers, kv_caches, strict=True)
        ):
            self.interrupt.check()
            adapters = None if lora is None else LayerLora(lora, index, self.group)
            x = self.ops.rms_norm(hidden, layer.input_norm, c.rms_norm_eps)
            qkv = layer.qkv(x)
            if adapters is not None:
                adapters.add(qkv, x, "qkv", base=layer.qkv.bias)
            qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
            # q and k rotate together: [num_tokens, heads + kv_heads, head_dim]
            if rope is not None:  # in place in qkv, the same bits
                heads = self.num_heads + self.num_kv_heads
                rope.rotate_(
                    qkv, heads, c.head_dim, rotary, self.rope.cos, self.rope.signed_sin,
                    positions_checked=True,
                )  # fmt: skip
                qk = qk.view(num_tokens, heads, c.head_dim)
            else:
                qk = apply_rope(qk.view(num_tokens, -1, c.head_dim), cos, sin)
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            v = v.view(num_tokens, self.num_kv_heads, c.head_dim)
            attn = attend(q, k, v, key_cache, value_cache, meta, self.scale)
            attn = attn.view(num_tokens, self.q_size)
            hidden = row_parallel(layer.o, attn, hidden, adapters, "o", group=self.group)
            self.interrupt.check()  # the MLP: three quarters of a layer's products
            x = self.ops.rms_norm(hidden, layer.post_norm, c.rms_norm_eps)
            gate_up = layer.gate_up(x)
            if adapters is not None:
                adapters.add(gate_up, x, "gate_up")
            act = self.ops.silu_mul(gate_up)
            self.interrupt.check()
            hidden = row_parallel(layer.down, act, hidden, adapters, "down", group=self.group)
        return hidden

    def _forward_block(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        rope_positions: torch.Tensor,  # [num_tokens] int64
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer
        meta: AttentionMetadata,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        """``forward`` for a block that departs from Llama's, as ``config.block`` describes."""
        c, block = self.config, self.config.block
        eps, hd = c.rms_norm_eps, c.head_dim
        rotations = [rope.lookup(rope_positions) for rope in self.ropes]
        hidden = self._embed(input_ids)
        if lora is not None and lora.saved is not None:
            lora.saved.embed(hidden, input_ids)  # rows whose adapter has embedding rows
        if block.embedding_scale != 1.0:
            hidden = hidden * block.embedding_scale
        n = hidden.shape[0]
        residual_scale = block.residual_multiplier
        activation = _gelu_tanh if block.activation is Activation.GELU_TANH else F.silu
        across = block.qk_norm is QKNorm.ACROSS_HEADS
        for index, (layer, (key_cache, value_cache)) in enumerate(
            zip(self.layers, kv_caches, strict=True)
        ):
            self.interrupt.check()
            adapters = None if lora is None else LayerLora(lora, index, self.group)
            x = (
                hidden.to(self.dtype)
                if layer.input_norm is None
                else self.ops.rms_norm(hidden, layer.input_norm, eps)
            )
            qkv = layer.qkv(x)
            if adapters is not None:
                adapters.add(qkv, x, "qkv", base=layer.qkv.bias)
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            if across:  # OLMo 2: over the whole projection, before the heads split
                q, k = self._norm_across_heads(q, k, layer.q_norm, layer.k_norm)
            q = q.reshape(n * self.num_heads, hd)
            k = k.reshape(n * self.num_kv_heads, hd)
            if layer.q_norm is not None and not across:  # per head, before RoPE
                q, k = (
                    self.ops.rms_norm(q, layer.q_norm, eps),
                    self.ops.rms_norm(k, layer.k_norm, eps),
                )
            cos, sin = rotations[layer.rope]
            q = apply_partial_rope(q.view(n, self.num_heads, hd), cos, sin)
            k = apply_partial_rope(k.view(n, self.num_kv_heads, hd), cos, sin)
            v = v.reshape(n, self.num_kv_heads, hd)
            attn = attend(
                q,
                k,
                v,
                key_cache,
                value_cache,
                meta,
                self.scale,
                window=layer.window,
                softcap=block.attention_softcap,
                positions=positions,
            )
            y = projected(layer.o, attn.view(n, self.q_size), adapters, "o", group=self.group)
            if layer.attn_out_norm is not None:
                y = self.ops.rms_norm(y, layer.attn_out_norm, eps)
            hidden = torch.add(hidden, y, alpha=residual_scale)
            self.interrupt.check()  # before the MLP, most of a layer's products
            x = (
                hidden.to(self.dtype)
                if layer.post_norm is None
                else self.ops.rms_norm(hidden, layer.post_norm, eps)
            )
            if layer.moe is not None:
                experts = None if lora is None else lora.expert_lora(index)
                y = moe_mlp(x, layer.moe, activation, experts)
                if self.group is not None:  # each rank's experts' slices: a partial sum
                    self.group.all_reduce(y)
            else:
                assert layer.gate_up is not None and layer.down is not None
                gate_up = layer.gate_up(x)
                if adapters is not None:
                    adapters.add(gate_up, x, "gate_up")
                if activation is F.silu:
                    act = self.ops.silu_mul(gate_up)
                else:
                    gate, up = gate_up.chunk(2, dim=-1)
                    act = activation(gate) * up
                self.interrupt.check()
                y = projected(layer.down, act, adapters, "down", group=self.group)
            if layer.mlp_out_norm is not None:
                y = self.ops.rms_norm(y, layer.mlp_out_norm, eps)
            hidden = torch.add(hidden, y, alpha=residual_scale)
        return hidden

    def _norm_across_heads(
        self, q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """OLMo 2's RMSNorm over all of q's (k's) heads. Split by heads, each rank holds its
        heads' features: one all-reduce sums the squares of both, in fp32 as HF does."""
        eps = self.config.rms_norm_eps
        if self.group is None:
            return self.ops.rms_norm(q, q_weight, eps), self.ops.rms_norm(k, k_weight, eps)
        qf, kf = q.float(), k.float()
        squares = torch.stack([qf.square().sum(-1), kf.square().sum(-1)], dim=-1)  # [n, 2]
        self.group.all_reduce(squares)
        mean = squares / squares.new_tensor([q.shape[-1], k.shape[-1]]) / self.shard.size
        inv = torch.rsqrt(mean + eps)
        q = (q_weight.float() * (qf * inv[:, :1])).to(q.dtype)
        k = (k_weight.float() * (kf * inv[:, 1:])).to(k.dtype)
        return q, k

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden]
        """The embedding rows; split by vocabulary, each rank looks up the ids it holds
        (zeros for the rest) and one all-reduce sums them."""
        if self.group is None:
            return F.embedding(input_ids, self.embed).to(self.residual_dtype)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_rows)
        hidden = F.embedding(local.masked_fill(outside, 0), self.embed).to(self.residual_dtype)
        hidden.masked_fill_(outside[:, None], 0)
        return self.group.all_reduce(hidden)

    def native_decode_pass(
        self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> NativeDecodePass | None:
        """A draft model's passes in one native call each, else None
        (``worker.model.native_decode``)."""
        return native_decode_pass(self, kv_caches)

    def native_decode_step(
        self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> NativeDecodeStep | None:
        """Decode steps in one native call each, exactly as ``forward`` and
        ``compute_logits`` compute them, else None (``worker.model.native_decode``)."""
        return native_decode_step(self, kv_caches)

    def compute_logits(
        self, hidden: torch.Tensor, *, kept_only: bool = False, heads: list[HeadPatch] | None = None
    ) -> torch.Tensor | None:
        """[rows, hidden] -> [rows, vocab] fp32, for the rows that sample only; with
        ``kept_only``, [rows, len(output_token_ids)] for a cut-down output layer. Split by
        vocabulary, the ranks' columns are gathered to rank 0 (the others return None).
        ``heads``: rows whose adapter changes the output layer (modules_to_save, tokens)."""
        x = self.ops.rms_norm(hidden, self.final_norm, self.config.rms_norm_eps)
        logits = self.lm_head(x)  # fp32, never rounded to the model's dtype

        if heads:
            apply_heads(logits, x, heads)
        if not self.llama_block:
            logits = shaped_logits(logits, self.config.block)
        if self.group is not None:
            gathered = self.group.gather_to_first(logits)
            return None if gathered is None else gathered[:, : self.config.vocab_size]
        if self.output_token_ids is None or kept_only:
            return logits
        return self.full_logits(logits)

    def full_logits(self, kept: torch.Tensor) -> torch.Tensor:
        """Logits over the kept tokens [rows, kept] -> [rows, vocab], -inf elsewhere."""
        return full_logits(kept, self.output_token_ids, self.config.vocab_size)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")
