"""Runs the model once per step over the paged KV cache, and returns the logits to sample.

The KV cache is allocated here once, as ``num_blocks * block_size`` slots per layer, on the
model's device (and a swap pool in host memory); the scheduler's block moves are made here.
A step's inputs are flattened on the host (``worker.model.step_inputs``) and copied to the
device once; decode steps may replay as CUDA graphs (``worker.model.cuda_graphs``), and a
draft model's small passes run in one native call.
"""

from __future__ import annotations

import torch

from switchboard_kernels.attention_native import DTYPES as NATIVE_ATTENTION_DTYPES
from switchboard_kernels.attention_native import MAX_HEAD_DIM, native_attention
from switchboard_kernels.huge_pages import zeros_on_huge_pages
from worker.core.batch import BlockMove, MoveKind, ScheduledSequence
from worker.errors import InvalidRequestError
from worker.model.cuda_graphs import DecodeGraphs
from worker.model.llama import LlamaModel
from worker.model.lora_manager import LoraBatch, LoraManager
from worker.model.model_config import ModelConfig
from worker.model.op_choice import NATIVE
from worker.model.prompt_logprobs import record_prompt_logprobs, wants_prompt_logprobs
from worker.model.step_inputs import StepInputs, prepare_step
from worker.model.step_interrupt import StepAbandoned


def kv_bytes_per_block(
    config: ModelConfig, block_size: int, dtype: torch.dtype, *, tensor_parallel_size: int = 1
) -> int:
    """Bytes one block takes across all layers (keys and values), on each rank: a rank of
    a tensor-parallel group holds its share of the KV heads."""
    kv_heads = config.num_kv_heads // tensor_parallel_size
    per_token = 2 * config.num_layers * kv_heads * config.head_dim
    return per_token * block_size * torch.tensor([], dtype=dtype).element_size()


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        *,
        num_blocks: int,
        block_size: int,
        lora_manager: LoraManager | None = None,
        num_host_blocks: int = 0,
        attention_backend: str = "torch",
        cuda_graphs: bool = False,
        max_num_seqs: int = 128,
        max_model_len: int = 2048,
        batch_invariant: bool = False,
    ) -> None:
        """``cuda_graphs``: replay decode steps as CUDA graphs (``worker.model.cuda_graphs``;
        CUDA and the triton backend only), their buffers sized by the last two.
        ``batch_invariant``: prefill chunks attend through the native kernel too (every row
        then attends in one order); refused where that kernel does not serve."""
        self.model = model
        self.device = model.device
        self.lora_manager = lora_manager
        self.block_size = block_size
        self.triton_attention = attention_backend == "triton"
        c = model.config
        self.heads_per_kv_head = c.num_heads // c.num_kv_heads
        kv_heads = model.num_kv_heads  # this rank's, under tensor parallelism
        # Decodes read the cache in place where the native kernel serves (CPU, bf16 or fp32).
        self.native_decodes = (
            not self.triton_attention
            and self.device.type == "cpu"
            and model.dtype in NATIVE_ATTENTION_DTYPES
            and c.head_dim <= MAX_HEAD_DIM
            and native_attention() is not None
        )
        if batch_invariant and not self.native_decodes:
            raise InvalidRequestError(
                "batch_invariant needs the native attention kernel (CPU, bf16 or fp32, "
                f"head_dim <= {MAX_HEAD_DIM}, a C compiler, the torch attention backend)"
            )
        self.native_prefills = batch_invariant
        shape = (num_blocks, block_size, kv_heads, c.head_dim)
        self.kv_caches = [
            tuple(self._zeros(shape, model.dtype) for _ in "kv") for _ in range(c.num_layers)
        ]
        # The swap pool: same layout in host memory (pinned when the cache is on a GPU).
        host_shape = (num_host_blocks, *shape[1:])
        pin = self.kv_caches[0][0].is_cuda
        self.host_caches = [
            (
                torch.zeros(host_shape, dtype=model.dtype, pin_memory=pin),
                torch.zeros(host_shape, dtype=model.dtype, pin_memory=pin),
            )
            for _ in range(c.num_layers if num_host_blocks else 0)
        ]
        # A draft model's small passes in one native call (None: the torch path only).
        self.native_pass = model.native_decode_pass(self.kv_caches)
        # A served model's decode steps in one native call, exact (None: the torch path).
        self.native_step = model.native_decode_step(self.kv_caches) if self.native_decodes else None
        if self.native_step is not None:
            model.ops = model.ops.for_native_step()
        self.graphs = None
        if cuda_graphs and model.long_rope is None:  # graphs capture no ``rope_positions``
            self.graphs = DecodeGraphs(
                model,
                self.kv_caches,
                max_batch=max_num_seqs,
                max_blocks=-(-max_model_len // block_size),
                block_size=block_size,
            )

    def _zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A zeroed cache tensor: on CPU in memory advised as 2 MB pages (huge_pages)."""
        if self.device.type == "cpu":
            return zeros_on_huge_pages(shape, dtype)
        return torch.zeros(shape, dtype=dtype, device=self.device)

    @torch.inference_mode()
    def move_blocks(self, moves: list[BlockMove]) -> None:
        """Make the scheduler's block moves in order, a run of moves of one kind at a time."""
        start = 0
        while start < len(moves):
            kind = moves[start].kind
            end = start + 1
            while end < len(moves) and moves[end].kind is kind:
                end += 1
            src = torch.tensor([m.src for m in moves[start:end]], dtype=torch.int64)
            dst = torch.tensor([m.dst for m in moves[start:end]], dtype=torch.int64)
            for layer, device in enumerate(self.kv_caches):
                host = self.host_caches[layer] if kind is not MoveKind.COPY else device
                source, target = (host, device) if kind is MoveKind.SWAP_IN else (device, host)
                for s, t in zip(source, target, strict=True):  # keys, then values
                    picked = s.index_select(0, src.to(s.device))  # [n, block, kv_heads, dim]
                    t.index_copy_(0, dst.to(t.device), picked.to(t.device))
            start = end

    @torch.inference_mode()
    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        """Copy the K/V of cache slots ``src`` to slots ``dst``, every layer (a draft row
        kept whose slot is not its position's)."""
        src_index, dst_index = self._indices(src), self._indices(dst)
        for caches in self.kv_caches:
            for cache in caches:  # keys, then values
                flat = cache.view(-1, *cache.shape[2:])
                flat.index_copy_(0, dst_index, flat.index_select(0, src_index))

    @torch.inference_mode()
    def execute(
        self, scheduled: list[ScheduledSequence], *, kept_only: bool = False
    ) -> tuple[list[ScheduledSequence], torch.Tensor]:
        """Run one step; returns the sampling sequences and their logits, one row per
        sampling sequence, or ``num_spec + 1`` consecutive rows for one verifying draft
        tokens: [sum of rows, vocab] (``kept_only``: a cut-down output layer's columns)."""
        native = self._execute_native(scheduled, kept_only)
        if native is None:
            native = self._execute_native_step(scheduled, kept_only)
        if native is not None:
            return native
        inputs = self.prepare(scheduled)
        lora = self.lora_batch(inputs)
        scoring = not kept_only and any(wants_prompt_logprobs(s) for s in scheduled)
        eager = kept_only or scoring or (lora is not None and lora.eager)
        if self.graphs is not None and not eager and self.graphs.fits(inputs):
            logits = self.graphs.run(inputs, lora)
        else:
            logits = self.run(inputs.to(self.device), lora, kept_only=kept_only, scoring=scoring)
        assert logits is not None
        return [s for s in inputs.order if s.samples], logits

    def lora_batch(self, inputs: StepInputs) -> LoraBatch | None:
        """This step's adapters in slots and each token's slot; None when no sequence has one
        (the per-token list is only built then)."""
        if self.lora_manager is None or not any(s.seq.adapter_id for s in inputs.order):
            return None
        token_adapters = [
            a for s in inputs.order for a in [s.seq.adapter_mix or s.seq.adapter_id] * s.num_fed
        ]
        return self.lora_manager.prepare(token_adapters, all_decode=inputs.meta.all_decode)

    def run(
        self,
        inputs: StepInputs,
        lora: LoraBatch | None,
        *,
        kept_only: bool = False,
        scoring: bool = False,
    ) -> torch.Tensor | None:
        """The forward pass over prepared inputs: the sampling rows' logits (None on a rank
        of a tensor-parallel group other than 0, which only lends its share of the pass);
        ``scoring``: the prompt logprobs asked for are recorded on their sequences too."""
        hidden = self.model.forward(
            inputs.input_ids,
            inputs.positions,
            self.kv_caches,
            inputs.meta,
            lora,
            rope_positions=inputs.rope_positions,
        )
        saved = None if lora is None else lora.saved
        if scoring:
            record_prompt_logprobs(self.model, hidden, inputs.order, saved=saved)
        heads = None if saved is None else saved.heads(inputs.logit_rows)
        return self.model.compute_logits(
            hidden[inputs.logit_rows], kept_only=kept_only, heads=heads
        )

    def _execute_native(
        self, scheduled: list[ScheduledSequence], kept_only: bool
    ) -> tuple[list[ScheduledSequence], torch.Tensor] | None:
        """The step through ``native_pass`` if it fits one: sequences that each feed a few
        tokens (up to the pass's rows in all) and sample after them, no drafts to verify,
        no adapters; else None."""
        native = self.native_pass
        if (
            native is None
            or not scheduled
            or sum(s.num_tokens for s in scheduled) > native.max_rows
            or any(s.num_spec or not s.samples or s.seq.adapter_id for s in scheduled)
            or any(wants_prompt_logprobs(s) for s in scheduled)
        ):
            return None
        logits = native(
            [
                (s.seq.tokens[s.start : s.start + s.num_tokens], s.start, s.seq.block_table)
                for s in scheduled
            ]
        )
        return list(scheduled), logits if kept_only else self.model.full_logits(logits)

    def _execute_native_step(
        self, scheduled: list[ScheduledSequence], kept_only: bool
    ) -> tuple[list[ScheduledSequence], torch.Tensor] | None:
        """The step through ``native_step`` if it is one: every sequence decoding (one token
        after cached ones) and sampling, no drafts or prompt logprobs, adapters only plain ones
        already in slots, and the model's plans picking the native norm, activation, attention
        (and LoRA) for so many rows: the kernels the torch path would call. Else None, having
        changed nothing."""
        step, rows = self.native_step, len(scheduled)
        if step is None or not 0 < rows <= step.max_rows:
            return None
        ops = self.model.ops
        if (
            ops.norm.kernel_for(rows) != NATIVE
            or ops.activation.kernel_for(rows) != NATIVE
            or ops.decode_attention.kernel_for(rows) != NATIVE
        ):
            return None
        adapters: list[str | None] = []
        for s in scheduled:
            seq = s.seq
            if not s.plain_decode or seq.adapter_mix or wants_prompt_logprobs(s):
                return None
            adapters.append(seq.adapter_id)
        lora = None
        if any(adapters):
            manager = self.lora_manager
            if manager is None or not ops.native_lora(rows) or not manager.plain_in_slots(adapters):
                return None  # a load, DoRA or saved modules: the torch path's
            lora = manager.prepare(adapters, all_decode=True)
        feeds = [(s.seq.tokens[s.start], s.start, s.seq.block_table) for s in scheduled]
        logits = step(feeds, lora, interrupt=self.model.interrupt.address)
        if logits is None:
            raise StepAbandoned
        return list(scheduled), logits if kept_only else self.model.full_logits(logits)

    def _indices(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64).to(self.device)

    def prepare(self, scheduled: list[ScheduledSequence]) -> StepInputs:
        """The step's inputs, laid out for this runner's attention path (``step_inputs``)."""
        native_decodes = self.native_decodes
        plan = self.model.ops.decode_attention
        if native_decodes and not self.native_prefills:
            if len(plan.kernels) == 1:  # no count needed
                native_decodes = plan.small == NATIVE
            else:  # a split plan: torch's path for steps of so many decodes (op_choice)
                decoding = sum(1 for s in scheduled if s.num_tokens == 1 and s.start > 0)
                native_decodes = decoding == 0 or plan.kernel_for(decoding) == NATIVE
        inputs = prepare_step(
            scheduled,
            block_size=self.block_size,
            native_decodes=native_decodes,
            triton_attention=self.triton_attention,
            num_kv_heads=self.model.num_kv_heads,
            heads_per_kv_head=self.heads_per_kv_head,
            device_type=self.device.type,
            native_prefills=self.native_prefills,
            native_chunk=self.model.ops.native_chunk,
        )
        if self.model.long_rope is not None:
            inputs.rope_positions = long_rope_positions(inputs, self.model.config)
        return inputs


def long_rope_positions(inputs: StepInputs, config: ModelConfig) -> torch.Tensor:
    """LongRoPE: each row's row of the RoPE tables, its position past the short factors' rows
    where its sequence rotates with the long ones (``Sequence.long_rope``)."""
    rows = [s.seq.long_rope for s in inputs.order for _ in range(s.num_fed)]
    long = torch.tensor(rows, dtype=torch.int64)
    return inputs.positions + long * config.max_position_embeddings
