"""The offline API (vLLM's names): build an engine, generate for a list of prompts."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path

from tqdm import tqdm

from worker.core.config import engine_config
from worker.core.outputs import RequestOutput
from worker.engine.llm_engine import LLMEngine
from worker.sampling.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """``LLM(path, dtype=...)``; extra keyword arguments are `worker.core.config.engine_config`'s
    options (the engine's settings, ``speculative_*`` for speculative decoding)."""

    def __init__(self, model: str | Path, *, dtype: str = "auto", **engine_options) -> None:
        self.engine = LLMEngine(model, engine_config(dtype=dtype, **engine_options))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def load_adapter(self, name: str, path: str | Path) -> str:
        """Make a PEFT LoRA adapter usable as ``adapters=[name]``; returns its content id."""
        return self.engine.load_adapter(name, path)

    def unload_adapter(self, name: str) -> None:
        self.engine.unload_adapter(name)

    def shutdown(self) -> None:
        """Stop the other ranks of a tensor-parallel engine (nothing to do on one rank)."""
        self.engine.shutdown()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        adapters: Sequence[str | list[tuple[str, float]] | None] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the prompts' order.

        ``adapters`` gives each prompt's adapter name (None: the base model), or a weighted
        mix of adapters as a list of (name, weight).
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt, as text or as token ids
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        adapters = list(adapters) if adapters is not None else [None] * len(prompts)
        if len(adapters) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(adapters)} adapters")
        ids = [f"offline-{next(self._ids)}" for _ in prompts]
        added = []
        try:
            for request_id, prompt, p, adapter in zip(ids, prompts, params, adapters, strict=True):
                if isinstance(adapter, list):
                    self.engine.add_request(request_id, prompt, p, mix=adapter)
                else:
                    self.engine.add_request(request_id, prompt, p, adapter=adapter)
                added.append(request_id)
            return self._run(ids, use_tqdm)
        finally:
            for request_id in added:  # only left over if generation raised
                self.engine.abort(request_id)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), disable=not use_tqdm, desc="generate") as bar:
            while len(results) < len(ids):
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
        return [results[i] for i in ids]
