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
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from switchboard_kernels.decode_step_native import NativeDecodeStep
from switchboard_kernels.draft_native import NativeDecodePass, native_draft
from switchboard_kernels.linear import Q4_MAX_ROWS, Linear
from switchboard_kernels.linear_choice import LinearPlan
from switchboard_kernels.paged_attention import AttentionMetadata, attend
from switchboard_kernels.rope_native import check_positions, native_rope
from worker.errors import ModelLoadError
from worker.model.architectures import Activation, QKNorm
from worker.model.checkpoint_files import load_safetensors
from worker.model.layer_lora import LayerLora
from worker.model.layers import load_layer, norm_weight
from worker.model.model_config import ModelConfig
from worker.model.moe import moe_mlp
from worker.model.op_choice import OpPlans, fixed_op_plans
from worker.model.quantize_on_load import OnLoad, output_layer
from worker.model.quantized_checkpoints import on_device
from worker.model.rope import (
    RopeTables,
    apply_partial_rope,
    apply_rope,
    long_rope_threshold,
    rotary_dim,
)
from worker.model.saved_modules import HeadPatch, apply_heads
from worker.model.sharding import Shard, check_divisible, weight_slicer
from worker.model.step_interrupt import StepInterrupt

if TYPE_CHECKING:
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
        # The residual stream (each layer's input and output) stays fp32 in a half-precision
        # model on CPU; the projections, norms' outputs and attention stay in ``dtype``. bf16
        # spaces the first token's massive activation (about 25,000 in one feature of the default
        # model from layer 11 on) 128 apart, and its rounding then reaches every later token
        # through attention: echoed prompt logprobs came out as far from fp32 as transformers'
        # bf16 ones, and half as far with this (bench.logit_fidelity). On CUDA the stream keeps
        # ``dtype`` (CUDA graphs' buffers and the Triton kernels take one dtype).
        half = dtype in (torch.bfloat16, torch.float16)
        self.residual_dtype = torch.float32 if half and self.device.type == "cpu" else dtype
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
        self.embed = self._vocab_padded(weights["model.embed_tokens.weight"])
        self.final_norm = norm_weight(weights, "model.norm.weight", c.block.norm_offset)
        head = "model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"
        if head not in weights:
            raise ModelLoadError(f"the checkpoint has no {head} (tie_word_embeddings is False)")
        self.output_token_ids = output_token_ids
        head_weight = self._vocab_padded(weights[head])
        if output_token_ids is not None:
            if group is not None:
                raise ValueError("a cut-down output layer is for a draft model, never split")
            self.output_token_ids = output_token_ids.to(self.device)
            head_weight = head_weight[self.output_token_ids].contiguous()
        self.quantization = quantization
        self.linear_plan = linear_plan
        # The other ops' kernels (RMSNorm, the activation; attention and LoRA for the runner
        # and the LoRA manager): measured on this CPU by the engine, else the fixed rule.
        self.ops = op_plans or fixed_op_plans(dtype, self.device)
        # fp32 out: the logits keep the product's fp32 sums through the sampler and logprobs
        # (rounded to bf16 they sit on a grid, 0.125 apart near the top, and tie).
        self.on_load = on_load
        head_weight = output_layer(on_load, head, head_weight)
        self.lm_head = Linear(
            head_weight, quantization=quantization, plan=linear_plan, fp32_out=True
        )
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
        # What one decode step reads (the embedding table is only gathered from): a small
        # batch's step time on CPU goes with it.
        # A sparse layer reads its router and top_k experts for one token.
        linears = [self.lm_head] + [lin for layer in self.layers for lin in layer.dense_linears]
        experts = sum(
            y.moe.routing.top_k * y.moe.expert_bytes
            + y.moe.router.numel() * y.moe.router.element_size()
            for y in self.layers
            if y.moe is not None
        )
        norms = [self.final_norm] + [
            n
            for y in self.layers
            for n in (y.input_norm, y.post_norm, y.attn_out_norm, y.mlp_out_norm)
            if n is not None
        ]
        self.decode_weight_bytes = (
            sum(lin.decode_bytes for lin in linears)
            + experts
            + sum(n.numel() * n.element_size() for n in norms)
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
        select = None
        if group is not None:
            check_divisible(config, group.size)
            select = weight_slicer(config, group.shard)
        loaded = load_safetensors(
            Path(path), dtype, select=select, quantization=config.quantization
        )
        weights = {k: on_device(v, device) for k, v in loaded.items()}
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

    def _vocab_padded(self, rows: torch.Tensor) -> torch.Tensor:
        """A vocabulary shard [ids, hidden] padded with zero rows to ``vocab_rows``."""
        missing = self.vocab_rows - rows.shape[0]
        if missing <= 0:
            return rows
        return torch.cat([rows, rows.new_zeros(missing, rows.shape[1])])

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
            hidden = self._row_parallel(layer.o, attn, hidden, adapters, "o")
            self.interrupt.check()  # the MLP: three quarters of a layer's products
            x = self.ops.rms_norm(hidden, layer.post_norm, c.rms_norm_eps)
            gate_up = layer.gate_up(x)
            if adapters is not None:
                adapters.add(gate_up, x, "gate_up")
            act = self.ops.silu_mul(gate_up)
            self.interrupt.check()
            hidden = self._row_parallel(layer.down, act, hidden, adapters, "down")
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
            y = self._projected(layer.o, attn.view(n, self.q_size), adapters, "o")
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
                y = self._projected(layer.down, act, adapters, "down")
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

    def _projected(
        self, linear: Linear, x: torch.Tensor, adapters: LayerLora | None, lora_group: str
    ) -> torch.Tensor:
        """``x @ W.T`` plus the LoRA delta, all-reduced under tensor parallelism."""
        y = linear(x)
        if adapters is not None:
            adapters.add(y, x, lora_group)
        if self.group is not None:
            self.group.all_reduce(y)
        return y

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

    def _row_parallel(
        self,
        linear: Linear,
        x: torch.Tensor,
        residual: torch.Tensor,
        adapters: LayerLora | None,
        lora_group: str,
    ) -> torch.Tensor:
        """``residual + x @ W.T`` plus the LoRA delta. Split by rows, each rank's product is
        a partial sum (the residual added on rank 0 only, the LoRA delta on its columns) and
        one all-reduce completes it."""
        if residual.dtype != x.dtype:
            return self._added_to_stream(linear, x, residual, adapters, lora_group)
        first = self.group is None or self.group.rank == 0
        y = linear.add_to(x, residual) if first else linear(x)
        if adapters is not None:
            adapters.add(y, x, lora_group, base=residual if first else None)
        if self.group is not None:
            self.group.all_reduce(y)
        return y

    def _added_to_stream(
        self,
        linear: Linear,
        x: torch.Tensor,
        residual: torch.Tensor,  # [T, hidden] fp32, this step's own
        adapters: LayerLora | None,
        lora_group: str,
    ) -> torch.Tensor:
        """``residual + x @ W.T`` plus the LoRA delta, into the fp32 residual stream: the
        product's fp32 sums take the residual before any rounding. An adapter's delta is
        computed apart and added after, so a base row's bits never depend on whether its
        neighbours have adapters (``batch_invariant``)."""
        if self.group is not None:  # each rank's partial sum: the stream added after
            return residual.add_(self._projected(linear, x, adapters, lora_group))
        y = linear.add_to(x, residual)  # [T, hidden] fp32
        if adapters is None or not adapters.stacks[lora_group].used:
            return y
        if adapters.dora and adapters.stacks[lora_group].dora is not None:
            # DoRA rescales the base product too: the delta against that product
            base = linear(x)
            adapted = base.clone()
            adapters.add(adapted, x, lora_group)
            return y.add_(adapted.float().sub_(base.float()))
        delta = x.new_zeros(y.shape)  # [T, hidden] in the rows' dtype, as the kernels add
        adapters.add(delta, x, lora_group)
        return y.add_(delta)

    def native_decode_pass(
        self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> NativeDecodePass | None:
        """Passes of a few tokens per sequence in one native call each
        (switchboard_kernels/draft_cpu.c), where this model's weights have native 4-bit copies (a
        draft model on CPU), else None. The rows then run in fp32 throughout, on fp32 RoPE
        tables."""
        if (
            self.quantization != "int4"
            or self.device.type != "cpu"
            or not self.llama_block
            or self.long_rope is not None
            or native_draft() is None
        ):
            return None
        c = self.config
        rope = RopeTables.build(c.head_dim, c.rope, c.max_position_embeddings, torch.float32)
        try:
            return NativeDecodePass(
                embed=self.embed.contiguous(),
                layers=self.layers,
                final_norm=self.final_norm,
                lm_head=self.lm_head,
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
        self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> NativeDecodeStep | None:
        """Decode steps in one native call each, exactly as ``forward`` and
        ``compute_logits`` compute them (switchboard_kernels/decode_step_cpu.c), where every
        kernel of this model's small-row path can be called from there: a Llama block on
        CPU, one rank, bf16 or fp32, no draft copies; else None. The runner still asks
        ``ops`` per step whether the norms, activation and attention plans pick the native
        kernels for its rows."""
        if (
            self.device.type != "cpu"
            or not self.llama_block
            or self.long_rope is not None
            or self.group is not None
            or self.quantization is not None
            or self.residual_dtype != torch.float32
        ):
            return None
        return NativeDecodeStep.build(
            embed=self.embed,
            layers=self.layers,
            final_norm=self.final_norm,
            lm_head=self.lm_head,
            cos=self.rope.cos,
            signed_sin=self.rope.signed_sin,
            kv_caches=kv_caches,
            heads=self.num_heads,
            eps=self.config.rms_norm_eps,
            scale=self.scale,
        )

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
            logits = self._shaped_logits(logits)
        if self.group is not None:
            gathered = self.group.gather_to_first(logits)
            return None if gathered is None else gathered[:, : self.config.vocab_size]
        if self.output_token_ids is None or kept_only:
            return logits
        return self.full_logits(logits)

    def _shaped_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Granite's logits scale and Gemma 2's final soft-cap (padded vocabulary rows stay 0)."""
        block = self.config.block
        if block.logits_scale != 1.0:
            logits = logits * block.logits_scale
        if block.final_softcap is not None:
            logits = torch.tanh(logits / block.final_softcap) * block.final_softcap
        return logits

    def full_logits(self, kept: torch.Tensor) -> torch.Tensor:
        """Logits over the kept tokens [rows, kept] -> [rows, vocab], -inf elsewhere."""
        if self.output_token_ids is None:
            return kept
        full = kept.new_full((kept.shape[0], self.config.vocab_size), float("-inf"))
        return full.index_copy_(1, self.output_token_ids, kept)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")
