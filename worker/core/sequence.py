"""One request's life in the engine: its tokens, its KV blocks, its progress."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from switchboard_kernels.mirrored_ints import MirroredInts
from worker.sampling.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from worker.core.adapter_mix import AdapterMix
    from worker.sampling.grammar import GrammarState
    from worker.text.byte_level import ByteLevelDetokenizer
    from worker.text.detokenizer import IncrementalDetokenizer
    from worker.text.stop_checker import StopChecker


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted, its K/V parked in the host pool
    FINISHED = "finished"


class Band(enum.IntEnum):
    """Which work a sequence is: interactive requests are scheduled ahead of batch work (the
    Batch API's lines), which fills idle capacity and gives it back (``worker.core.scheduler``).
    The values are the gRPC contract's ``Priority``."""

    INTERACTIVE = 0
    BATCH = 1


class FinishReason(enum.StrEnum):
    """Why a sequence ended; the values are OpenAI's ``finish_reason`` strings."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(slots=True)
class RequestMetrics:
    """Wall-clock timestamps (``time.monotonic``) for latency reporting."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass(eq=False, slots=True)
class Sequence:
    """A request being generated. ``tokens`` is prompt + output; the KV holds a prefix of it."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_order: int
    # Content id of the LoRA adapter this request runs with; None for the base model. For a
    # weighted mix of adapters, the mix's key (``AdapterMix.key``), and the mix itself below.
    adapter_id: str | None = None
    adapter_mix: AdapterMix | None = None
    # Who sent it, and that tenant's weight under fair scheduling (``worker.core.fairness``).
    tenant: str = ""
    tenant_weight: float = 1.0
    band: Band = Band.INTERACTIVE
    status: SequenceStatus = SequenceStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    # Tokens whose K/V are in the cache; the rest still need a forward pass.
    num_computed_tokens: int = 0
    # Read whole by every step's inputs: kept as an array too (``MirroredInts``).
    block_table: list[int] = field(default_factory=MirroredInts)
    # While SWAPPED: the host-pool blocks holding the K/V of its computed tokens.
    host_block_table: list[int] = field(default_factory=list)
    # Prefix caching: the hash chain's seed (adapter, salt), the hashes of the full blocks
    # of ``tokens`` computed so far, how many leading blocks of ``block_table`` are
    # registered in the cache, and how many prompt tokens the first admission found cached.
    cache_root: bytes = b""
    block_hashes: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0
    num_cached_tokens: int = 0
    # LongRoPE: its K/V rotate with the long factors (``worker.engine.long_rope``).
    long_rope: bool = False
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    # Steps this request was passed over for want of a free adapter slot, and for want of
    # room (seats or KV blocks) while its tenant was under its fair share.
    lora_wait_steps: int = 0
    share_wait_steps: int = 0
    # While its tenant decodes more rows than its share of a step's decode budget, its
    # rows take turns (``DecodeTurns.within_budget``): when it was last placed.
    last_decode_turn: int = 0
    # Tokens of ``tokens`` whose computation was charged to the tenant (a recompute after
    # preemption is not charged again).
    num_charged_tokens: int = 0
    # Speculative decoding: draft tokens to feed after the real ones this step, verified
    # after it (never part of ``tokens``: only accepted ones are appended), and their
    # layout: draft j sits at position offset ``spec_offsets[j]`` past the real tokens fed
    # and attends the step's first ``num_tokens + spec_offsets[j]`` rows and itself. Empty
    # offsets: 0, 1, 2, ... (each draft follows the one before). The speculator decides
    # what the rows mean; the runner only lays them out.
    spec_token_ids: list[int] = field(default_factory=list)
    spec_offsets: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    # A structured output's matcher (``worker.sampling.grammar``): which tokens may come next.
    grammar: GrammarState | None = None
    detokenizer: IncrementalDetokenizer | ByteLevelDetokenizer | None = None
    stop_checker: StopChecker | None = None
    # The text so far, in the pieces each step added (joined when read: appending to one
    # string would copy all of it for each token).
    text_pieces: list[str] = field(default_factory=list)
    logprobs: list | None = None
    # Asked for prompt logprobs: entry p, for prompt token p + 1, filled by the pass that
    # computes position p (``worker.model.prompt_logprobs``); None until then.
    prompt_logprobs: list | None = None
    # Monotonic time of each generated token, for inter-token latency.
    token_times: list[float] = field(default_factory=list)
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.monotonic()))

    def __post_init__(self) -> None:
        if not self.tokens:
            self.tokens = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.tokens) - self.num_computed_tokens

    @property
    def adapter_ids(self) -> tuple[str, ...]:
        """The content ids of the adapters it runs with, each holding a slot while it runs."""
        if self.adapter_mix is not None:
            return self.adapter_mix.ids
        return () if self.adapter_id is None else (self.adapter_id,)

    def draft_offsets(self, num_spec: int) -> list[int]:
        """The position offsets of the first ``num_spec`` drafts (see ``spec_offsets``)."""
        return self.spec_offsets[:num_spec] if self.spec_offsets else list(range(num_spec))

    def clear_spec(self) -> None:
        self.spec_token_ids = []
        self.spec_offsets = []

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.tokens.append(token_id)
