"""The engine: requests in, one batched forward pass per step, token deltas out.

``step()`` is schedule → run → sample → postprocess; the server calls it in a loop from
its own thread, the offline ``LLM`` calls it until every request is done. A request that
fails a step alone (``worker.engine.isolation``) ends there, with ``finish_reason`` "abort" and
its error in ``take_failures()``; the others go on.

Sampled tokens become outputs in ``worker.engine.output_stage``. With ``async_output`` (on
CUDA by default) that is split: what the next step needs is done at once, the rest in the next
step, while the device runs its forward pass; outputs come one step later, and a request a
stop string ends has computed one token more, which is dropped.
"""

from __future__ import annotations

import itertools
import logging
import time
from pathlib import Path

import torch

from adapters.lora import LoraAdapter
from worker.core.adapter_mix import MAX_MIX_ADAPTERS, AdapterMix
from worker.core.batch import ScheduledSequence
from worker.core.config import EngineConfig
from worker.core.forks import PendingForks
from worker.core.outputs import RequestOutput
from worker.core.prefix_cache import PrefixCacheStats, root_hash
from worker.core.sequence import Band, RequestMetrics, Sequence
from worker.core.step_budget import DecodeStepBudget, StepTimes, default_budget
from worker.engine.assembly import assemble
from worker.engine.isolation import (
    drop_unusable_drafts,
    execute_isolating,
    plain_rows,
    sample_isolating,
    with_adapter_named,
)
from worker.engine.long_rope import LongRopeSwitch
from worker.engine.output_stage import OutputStage
from worker.engine.request_checks import check_request, check_tenant_weight
from worker.engine.token_processor import TokenProcessor
from worker.engine.warmup import (
    SCORING_TOKENS,
    WarmupReport,
    measure_decode_times,
    measure_scoring_cost,
    measure_step_times,
    warm_up,
)
from worker.errors import (
    EngineError,
    InvalidRequestError,
    SequenceFailedError,
    UnknownAdapterError,
)
from worker.model.step_interrupt import StepAbandoned
from worker.sampling.grammar import GrammarCompiler, MaskBatch
from worker.sampling.rows import SamplingRow
from worker.sampling.sampler import Sampler
from worker.sampling.sampling_params import SamplingParams
from worker.spec_decode.speculator import Verified
from worker.spec_decode.stats import SpecDecodeStats

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, model: str | Path, config: EngineConfig | None = None) -> None:
        """The checkpoint at ``model``, served as ``config`` says (`worker.core.config`)."""
        config = config or EngineConfig()
        self.engine_config = config
        parts = assemble(model, config)
        self.device = parts.device
        self.attention_backend = parts.attention_backend
        self.tensor_parallel = parts.tensor_parallel
        self.model = parts.model
        self.config = self.model.config
        self.tokenizer = parts.tokenizer
        self.max_model_len = parts.max_model_len
        self.block_manager = parts.block_manager
        self.share_base_model_prefixes = config.share_base_model_prefixes
        self.scheduler = parts.scheduler
        self.lora_manager = parts.lora_manager
        self.runner = parts.runner
        self.speculator = parts.speculator
        self.async_output = parts.async_output
        threshold = self.model.long_rope
        self.long_rope = None if threshold is None else LongRopeSwitch(threshold)
        self.sampler = Sampler()
        self.grammars = GrammarCompiler(
            self.tokenizer,
            vocab_size=self.config.vocab_size,
            eos_token_ids=self.config.eos_token_ids,
        )
        self._masks = MaskBatch(self.config.vocab_size)
        ledger = self.scheduler.ledger
        self.token_processor = TokenProcessor(
            eos_token_ids=self.config.eos_token_ids,
            max_model_len=self.max_model_len,
            first_token=lambda seq: ledger.record_first_token(seq.tenant, seq.metrics.ttft or 0.0),
        )
        self.requests: dict[str, Sequence] = {}
        self._rows: dict[str, SamplingRow] = {}
        self._forks = PendingForks(self.scheduler)  # n > 1 (see add_samples)
        self._arrivals = itertools.count()
        self.output_stage = OutputStage(
            self.token_processor,
            self.scheduler,
            self._forks,
            self.speculator,
            self.requests,
            self._rows,
            eviction=None if self.lora_manager is None else self.lora_manager.eviction,
        )
        if config.decode_step_budget_ms:  # a set budget learns what steps cost as they run
            seconds = config.decode_step_budget_ms / 1000
            self.scheduler.step_budget = DecodeStepBudget(StepTimes(), seconds)
        if config.warmup:
            self.warm_up()

    def warm_up(self) -> WarmupReport:
        """Run the step shapes serving will use once (`worker.engine.warmup`), leaving no
        trace; call it on the thread that will step the engine, before any request."""
        if self.requests:
            raise EngineError("warm up an engine before it takes requests")
        row_limit = min(self.engine_config.max_num_batched_tokens, self.max_model_len)
        report = warm_up(
            self.runner.execute,
            self.sampler,
            self.block_manager,
            max_num_seqs=self.engine_config.max_num_seqs,
            row_limit=row_limit,
            max_model_len=self.max_model_len,
            vocab_size=self.config.vocab_size,
            cpu_lora=self.lora_manager is not None and self.device.type == "cpu",
        )
        if self.engine_config.decode_step_budget_ms != 0:
            self._measure_step_budget(row_limit)
        return report

    def _measure_step_budget(self, row_limit: int) -> None:
        """The decode step budget's curve from a sweep of step sizes, and, unless one was
        set, its budget: a few of a lone stream's decode steps
        (`worker.core.step_budget.default_budget`)."""
        measured = measure_step_times(
            self.runner.execute,
            self.block_manager,
            row_limit=row_limit,
            max_model_len=self.max_model_len,
            vocab_size=self.config.vocab_size,
        )
        self._measure_scoring_cost(measured)
        decodes = measure_decode_times(
            self.runner.execute,
            self.block_manager,
            max_rows=self.engine_config.max_num_seqs,
            row_limit=row_limit,
            max_model_len=self.max_model_len,
            vocab_size=self.config.vocab_size,
        )
        set_ms = self.engine_config.decode_step_budget_ms
        seconds = set_ms / 1000 if set_ms else default_budget(measured, decodes)
        if seconds is None:
            return
        budget = DecodeStepBudget(StepTimes(measured), seconds, StepTimes(decodes))
        self.scheduler.step_budget = budget
        logger.info("decode step budget: %s", budget.describe())

    def _measure_scoring_cost(self, plain: dict[int, float]) -> None:
        """What scoring a prompt position costs here, in plain prompt tokens, for fairness and
        the step's token limits: measured at a size the sweep ran, never below the model's
        shapes' estimate (``worker.core.prompt_scoring``)."""
        tokens = min(SCORING_TOKENS, max(plain, default=0))
        measured = measure_scoring_cost(
            self.runner.execute,
            self.block_manager,
            tokens=tokens,
            vocab_size=self.config.vocab_size,
        )
        if measured is None:
            return
        cost = max(self.scheduler.scored_token_cost, measured)
        self.scheduler.scored_token_cost = self.scheduler.ledger.scored_token_cost = cost
        logger.info("a scored prompt position costs %.2f prompt tokens here", cost)

    def shutdown(self) -> None:
        """Stop the other ranks of a tensor-parallel engine (nothing to do on one rank)."""
        if self.tensor_parallel is not None:
            self.tensor_parallel.shutdown()

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def has_pending_forks(self) -> bool:
        """Samples of an n > 1 request still waiting for their first sample's prompt."""
        return bool(self._forks)

    @property
    def spec_decode_stats(self) -> SpecDecodeStats | None:
        """Speculative decoding counters; None when speculation is off."""
        return self.speculator.stats if self.speculator is not None else None

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return self.block_manager.stats

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix; running requests keep their blocks."""
        self.block_manager.reset_cache()

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
        mix: list[tuple[str, float]] | None = None,
        tenant: str | None = None,
        tenant_weight: float = 1.0,
        band: Band = Band.INTERACTIVE,
    ) -> None:
        """Validate and queue a request; raises ``InvalidRequestError`` and queues nothing.

        ``adapter`` names a loaded LoRA adapter; None runs the base model. ``mix`` instead
        names several, with weights: the request gets the weighted sum of their deltas. ``tenant``
        isolates the request's prefix cache from other tenants', and is served its share,
        ``tenant_weight`` relative to the other tenants' weights, under fair scheduling.
        """
        self.add_samples(
            [request_id],
            prompt,
            [params or SamplingParams()],
            adapter=adapter,
            mix=mix,
            tenant=tenant,
            tenant_weight=tenant_weight,
            band=band,
        )

    def add_samples(
        self,
        request_ids: list[str],
        prompt: str | list[int],
        params: list[SamplingParams],
        *,
        adapter: str | None = None,
        mix: list[tuple[str, float]] | None = None,
        tenant: str | None = None,
        tenant_weight: float = 1.0,
        arrival_time: float | None = None,
        band: Band = Band.INTERACTIVE,
    ) -> None:
        """Several samples of one prompt (``n > 1``), each its own request with its own params.

        The prompt is computed once, by the first; when its prefill ends the others fork
        from it, sharing its blocks (the partly filled last one is copied on first write),
        and sample their first tokens from the same logits. Validates all, queues all or none.
        ``arrival_time`` (``time.monotonic()``): when the request reached the server, if it
        waited for the step loop since (its queue time and TTFT count from there); else now.
        """
        if len(params) != len(request_ids) or not request_ids:
            raise InvalidRequestError("one sampling params per sample id is required")
        for request_id in request_ids:
            if request_id in self.requests or request_ids.count(request_id) > 1:
                raise InvalidRequestError(f"request id {request_id!r} is already in use")
        adapter_id = None
        if adapter is not None:
            if self.lora_manager is None:
                raise UnknownAdapterError(f"adapter {adapter!r} is not loaded")
            adapter_id = self.lora_manager.resolve(adapter)
        adapter_mix = None
        if mix is not None:
            if adapter is not None:
                raise InvalidRequestError("a request names one adapter or a mix, not both")
            adapter_mix = self._resolve_mix(mix)
            adapter_id = adapter_mix.key
        check_tenant_weight(tenant_weight)
        if self.tensor_parallel is not None and any(p.prompt_logprobs is not None for p in params):
            # Its ranks would have to join the scoring rows' vocabulary gather.
            raise InvalidRequestError("prompt logprobs are not served under tensor parallelism")
        prompt_ids = self._tokenize(prompt)
        for p in params:
            check_request(
                prompt_ids,
                p,
                vocab_size=self.config.vocab_size,
                max_model_len=self.max_model_len,
                blocks=self.block_manager,
            )
        salt = None if adapter_id is None and self.share_base_model_prefixes else tenant
        root = root_hash(adapter_id, salt)
        seqs = []
        for request_id, p in zip(request_ids, params, strict=True):
            seq = Sequence(
                request_id,
                prompt_ids,
                p,
                arrival_order=next(self._arrivals),
                adapter_id=adapter_id,
                adapter_mix=adapter_mix,
                tenant=tenant or "",
                tenant_weight=tenant_weight,
                band=Band(band),
                cache_root=root,
                metrics=RequestMetrics(arrival_time or time.monotonic()),
            )
            if self.long_rope is not None:
                self.long_rope.admit(seq)
            if p.seed is not None:
                seq.generator = torch.Generator().manual_seed(p.seed)
            if p.structured_output is not None:
                seq.grammar = self.grammars.matcher(p.structured_output, seq.tenant)
            self.token_processor.attach(seq, self.tokenizer)
            self.requests[request_id] = seq
            self._rows[request_id] = SamplingRow(
                p, seq.output_token_ids, seq.prompt_token_ids, seq.generator
            )
            seqs.append(seq)
        self.scheduler.add(seqs[0])
        self._forks.add(seqs[0], seqs[1:])
        if self.lora_manager is not None and seqs[0].adapter_ids:
            self.lora_manager.eviction.arrived(seqs[0].adapter_ids, sequences=len(seqs))

    def _resolve_mix(self, mix: list[tuple[str, float]]) -> AdapterMix:
        """Names to content ids, checked: known, distinct, at most ``MAX_MIX_ADAPTERS`` and the
        slots there are (a larger mix could never start), and summable (plain LoRA)."""
        names = [name for name, _ in mix]
        if len(set(names)) != len(names):
            raise InvalidRequestError("a mix names each adapter at most once")
        manager = self.lora_manager
        limit = 0 if manager is None else min(MAX_MIX_ADAPTERS, manager.max_loras)
        if not 1 <= len(names) <= limit:  # the count first: it is the error, not the names
            raise InvalidRequestError(
                f"a mix names 1 to {limit} adapters on this worker; this one names {len(names)}"
            )
        assert manager is not None
        ids = [manager.resolve(name) for name in names]
        adapter_mix = AdapterMix.of(
            [(i, w) for i, (_, w) in zip(ids, mix, strict=True)], max_adapters=limit
        )
        by_id = dict(zip(ids, names, strict=True))
        manager.check_mix([by_id[i] for i in adapter_mix.ids], adapter_mix)
        return adapter_mix

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; None if it is unknown or already done."""
        seq = self.requests.get(request_id)
        return None if seq is None else self.output_stage.abort(seq)

    def step(self) -> list[RequestOutput]:
        """One iteration: the outputs of every request that produced a token or finished.
        A request whose forward pass, sampling or postprocessing fails alone is finished
        (its output says "abort"; ``take_failures`` says why); the others are not touched."""
        if self.long_rope is not None:
            self.long_rope.switch(self.scheduler)
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running, self._rows)
        sched = self.scheduler.schedule()
        self.runner.move_blocks(sched.moves)
        stage = self.output_stage
        if sched.is_empty:
            return stage.render_committed()
        start = time.perf_counter()
        interrupt = self.runner.model.interrupt
        abandonable = self._abandonable(sched.scheduled)
        if abandonable:
            interrupt.arm()
        try:
            executed = execute_isolating(self.runner.execute, sched.scheduled)
        except StepAbandoned:  # interactive work arrived: nothing of this step counts
            interrupt.abandoned += 1
            return stage.render_committed()
        finally:
            if abandonable:
                interrupt.disarm()
        sampling, logits = executed.sampling, executed.logits
        # A step of decodes only prices a draft model's passes (a prefill would inflate it).
        decodes_only = executed.parts == 1 and all(s.num_tokens == 1 for s in sched.scheduled)
        step_seconds = time.perf_counter() - start if decodes_only else None
        self.scheduler.mark_computed(sched)
        failed: list[tuple[Sequence, EngineError]] = list(executed.failed.items())
        verified: list[Verified] = []
        if self.speculator is not None and sampling:
            sampling, logits, unusable = drop_unusable_drafts(sampling, logits)
            failed += unusable.items()
        failed += self._apply_grammars(sampling, logits)
        if self.speculator is not None and sampling:
            sampling, logits, verified, lost = self._verify(sampling, logits, step_seconds)
            failed += lost
        if self._forks and sampling:
            sampling, logits = self._forks.join(sampling, logits)
        rows = [self._rows[s.seq.request_id] for s in sampling]
        # async_output: the last step's tokens, rendered while the device runs this pass
        # (sampling waits for it).
        outputs = stage.render_committed()
        sampled, failures = sample_isolating(self.sampler, logits, rows)
        failed += [
            (sampling[j].seq, with_adapter_named(sampling[j].seq, exc))
            for j, exc in failures.items()
        ]
        if self.scheduler.step_budget is not None and executed.parts == 1:
            self.scheduler.step_budget.observe(
                sched.num_tokens,
                all(s.plain_decode for s in sched.scheduled),
                time.perf_counter() - start,
            )
        now = time.monotonic()
        for j, (s, token) in enumerate(zip(sampling, sampled, strict=True)):
            if j in failures:
                continue
            if self.async_output:
                stage.commit(s.seq, token, now, failed)
            else:
                outputs += stage.emit(s.seq, [token], now, failed)
        for v in verified:
            outputs += stage.emit(v.seq, v.tokens, now, failed, verified=True)
        return outputs + [
            stage.fail(seq, exc) for seq, exc in failed if seq.request_id in self.requests
        ]

    def stop_batch_step(self) -> bool:
        """From any thread, when interactive work arrives: the step in flight, if it is batch
        work alone, stops at its next check and is dropped (``worker.model.step_interrupt``);
        whether one was in flight."""
        return self.runner.model.interrupt.request()

    def _abandonable(self, scheduled: list[ScheduledSequence]) -> bool:
        """Whether a step may be stopped midway: batch work alone, no drafts to verify (their
        proposals belong to the step), where the scheduler counts on it (``BatchBand.steps_stop``:
        the whole pass in this process)."""
        return self.scheduler.batch_band.steps_stop and all(
            s.seq.band is Band.BATCH and not s.num_spec for s in scheduled
        )

    def take_failures(self) -> dict[str, EngineError]:
        """Requests that failed a step alone since the last call, with their errors."""
        return self.output_stage.take_failures()

    def _apply_grammars(
        self, sampling: list[ScheduledSequence], logits: torch.Tensor
    ) -> list[tuple[Sequence, EngineError]]:
        """Forbid, in place, the tokens each structured output does not allow next: in a
        sequence's row, and in each draft's row after the drafts before it (a constrained
        sequence verifies a chain only: no alternatives). If masking raises, the
        constrained sequences fail (the failures returned) and their rows stay as they are."""
        rows, row = [], 0
        for s in sampling:
            if s.seq.grammar is not None:
                rows.append((s.seq.grammar, row, s.seq.spec_token_ids[: s.num_spec]))
            row += 1 + s.num_spec
        try:
            self._masks.apply_(logits, rows)
            return []
        except Exception as exc:
            logger.exception("masking the step's structured outputs failed")
            error = SequenceFailedError(f"applying the structured output failed: {exc!r}")
            return [(s.seq, error) for s in sampling if s.seq.grammar is not None]

    def _verify(
        self, sampling: list[ScheduledSequence], logits: torch.Tensor, step_seconds: float | None
    ) -> tuple[
        list[ScheduledSequence], torch.Tensor, list[Verified], list[tuple[Sequence, EngineError]]
    ]:
        """The speculator's verification; if it raises, the speculating sequences (its
        state for them is spent) fail and the plain ones are sampled as usual."""
        assert self.speculator is not None
        try:
            plain, logits, verified = self.speculator.verify(
                sampling, logits, self._rows, step_seconds
            )
            return plain, logits, verified, []
        except Exception as exc:
            logger.exception("verifying drafts failed; the speculating sequences end")
            error = SequenceFailedError(f"verifying draft tokens failed: {exc!r}")
            plain, logits = plain_rows(sampling, logits)
            return plain, logits, [], [(s.seq, error) for s in sampling if s.num_spec]

    def _tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer: send token ids")
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        return [int(t) for t in prompt]
