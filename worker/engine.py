"""The engine: requests in, one batched forward pass per step, token deltas out.

``step()`` is schedule → run → sample → postprocess; the server calls it in a loop from
its own thread, the offline ``LLM`` calls it until every request is done.
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import torch

from adapters.lora import LoraAdapter
from worker.block_manager import BlockManager
from worker.errors import InvalidRequestError, RequestTooLargeError
from worker.llama import LlamaModel
from worker.lora_manager import LoraManager, UnknownAdapterError
from worker.model_runner import ModelRunner, kv_bytes_per_block
from worker.outputs import RequestOutput
from worker.postprocess import Postprocessor
from worker.sampler import Sampler, SamplingRow
from worker.sampling_params import SamplingParams
from worker.scheduler import Scheduler
from worker.sequence import FinishReason, Sequence, SequenceStatus
from worker.tokenizer import load_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise InvalidRequestError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


class LLMEngine:
    def __init__(
        self,
        model: str | Path,
        *,
        dtype: str | torch.dtype = "bfloat16",
        block_size: int = 16,
        kv_cache_memory_gb: float = 1.0,
        num_kv_blocks: int | None = None,
        max_num_seqs: int = 128,
        max_num_batched_tokens: int = 1024,
        max_model_len: int | None = None,
        max_loras: int = 8,
        max_lora_rank: int = 32,
        lora_host_cache_gb: float = 2.0,
    ) -> None:
        torch_dtype = resolve_dtype(dtype)
        self.model = LlamaModel.from_pretrained(model, dtype=torch_dtype)
        self.config = self.model.config
        self.tokenizer = load_tokenizer(model)
        self.max_model_len = min(max_model_len or 10**9, self.config.max_position_embeddings)
        if num_kv_blocks is None:
            block_bytes = kv_bytes_per_block(self.config, block_size, torch_dtype)
            num_kv_blocks = max(1, int(kv_cache_memory_gb * 2**30) // block_bytes)
        self.block_manager = BlockManager(num_blocks=num_kv_blocks, block_size=block_size)
        self.scheduler = Scheduler(
            block_manager=self.block_manager,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            watermark_blocks=num_kv_blocks // 100,
            max_loras=max_loras,
        )
        # max_loras=0 turns LoRA off (no slot buffers are ever allocated).
        self.lora_manager = None
        if max_loras > 0:
            self.lora_manager = LoraManager(
                model,
                dtype=torch_dtype,
                max_loras=max_loras,
                max_lora_rank=max_lora_rank,
                host_cache_bytes=int(lora_host_cache_gb * 2**30),
            )
        self.runner = ModelRunner(
            self.model,
            num_blocks=num_kv_blocks,
            block_size=block_size,
            lora_manager=self.lora_manager,
        )
        self.sampler = Sampler()
        self.postprocessor = Postprocessor(
            eos_token_ids=self.config.eos_token_ids, max_model_len=self.max_model_len
        )
        self.requests: dict[str, Sequence] = {}
        self._rows: dict[str, SamplingRow] = {}
        self._arrivals = itertools.count()

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def load_adapter(self, name: str, path: str | Path) -> str:
        """Load, validate and name a PEFT LoRA adapter; returns its content id."""
        if self.lora_manager is None:
            raise InvalidRequestError("LoRA is disabled on this engine (max_loras=0)")
        return self.lora_manager.load(name, path)

    def add_adapter(self, name: str, adapter: LoraAdapter, path: str | Path) -> str:
        """Name an adapter read (and validated) elsewhere, e.g. in a thread off the step
        loop with `lora_manager.read(path)`; returns its content id."""
        if self.lora_manager is None:
            raise InvalidRequestError("LoRA is disabled on this engine (max_loras=0)")
        return self.lora_manager.add(name, adapter, path)

    def unload_adapter(self, name: str) -> None:
        """Forget a name; requests already running with it finish normally."""
        if self.lora_manager is None:
            raise UnknownAdapterError(f"adapter {name!r} is not loaded")
        self.lora_manager.unload(name)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        adapter: str | None = None,
    ) -> None:
        """Validate and queue a request; raises ``InvalidRequestError`` and queues nothing.

        ``adapter`` names a loaded LoRA adapter; None runs the base model.
        """
        params = params or SamplingParams()
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        adapter_id = None
        if adapter is not None:
            if self.lora_manager is None:
                raise UnknownAdapterError(f"adapter {adapter!r} is not loaded")
            adapter_id = self.lora_manager.resolve(adapter)
        prompt_ids = self._tokenize(prompt)
        self._validate(prompt_ids, params)
        seq = Sequence(
            request_id,
            prompt_ids,
            params,
            arrival_order=next(self._arrivals),
            adapter_id=adapter_id,
        )
        if params.seed is not None:
            seq.generator = torch.Generator().manual_seed(params.seed)
        self.postprocessor.attach(seq, self.tokenizer)
        self.requests[request_id] = seq
        self._rows[request_id] = SamplingRow(
            params, seq.output_token_ids, seq.prompt_token_ids, seq.generator
        )
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; None if it is unknown or already done."""
        seq = self.requests.get(request_id)
        if seq is None:
            return None
        seq.finish_reason = FinishReason.ABORT
        self._finish(seq)
        return self.postprocessor.output(seq, new_tokens=0, new_text="")

    def step(self) -> list[RequestOutput]:
        """One iteration: the outputs of every request that produced a token or finished."""
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        sampling, logits = self.runner.execute(sched.scheduled)
        for s in sched.scheduled:
            s.seq.num_computed_tokens += s.num_tokens
        sampled = self.sampler(logits, [self._rows[s.seq.request_id] for s in sampling])
        now = time.monotonic()
        outputs = []
        for s, token in zip(sampling, sampled, strict=True):
            seq = s.seq
            new_text = self.postprocessor.add_token(seq, token, now)
            if seq.finish_reason is not None:
                new_text += self.postprocessor.flush(seq)
                self._finish(seq)
            outputs.append(self.postprocessor.output(seq, new_tokens=1, new_text=new_text))
        return outputs

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.metrics.finished_time = time.monotonic()
        del self.requests[seq.request_id]
        del self._rows[seq.request_id]

    def _tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer: send token ids")
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        return [int(t) for t in prompt]

    def _validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty")
        vocab = self.config.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"unknown token ids {bad[:5]} (vocabulary size {vocab})")
        bad = [t for t in params.stop_token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"unknown stop_token_ids {bad[:5]} (vocabulary size {vocab})")
        if len(prompt_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(prompt_ids)} tokens; this model's context is "
                f"{self.max_model_len} tokens, leaving no room to generate"
            )
        longest = min(len(prompt_ids) + params.max_tokens, self.max_model_len)
        needed = self.block_manager.blocks_needed([], longest)
        if needed > self.block_manager.num_blocks:
            raise RequestTooLargeError(
                f"prompt plus max_tokens ({longest} tokens) needs {needed} KV blocks; "
                f"the whole cache has {self.block_manager.num_blocks}"
            )
