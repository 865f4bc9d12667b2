"""Which kernel runs each of a step's ops besides the projections, chosen by measurement on
the CPU at hand: RMSNorm, SwiGLU's activation, multi-LoRA, attention over the decodes and
attention over prefill chunks, each our native kernel or torch's path. (Beside the model
rather than the kernels: a measurement runs the engine's own step inputs.)

The projections' choice (``linear_choice``) is the one that moves a step most; these move it
less, and which side wins still turns with the CPU: on an AMX Xeon the native RMSNorm is
2-7x faster than torch's at every row count, the native decode attention 2-5x (it reads the
cache in place, torch's path copies each sequence's blocks first), while SDPA beats the
native kernel on prefill chunks past some 16 tokens (a chunk of 4 tokens over 512 cached:
native 0.07 ms a layer, SDPA 0.13; of 256: 3.1 against 0.9); without AVX-512 only the
native kernels' plain loops run. So each op gets a ``KernelPlan`` (one kernel for up to
``split_rows`` rows, another above), measured once on tensors of the model's shapes at the
``ROW_BUCKETS`` the engine can feed (bounded by ``MEASURE_SECONDS``), cached beside the
projections' plan, and logged. ``fixed_op_plans`` is the rule when nothing is measured:
native wherever it builds (the activation only with a vector loop: AVX-512, or AVX2 with
FMA), SDPA for prefill chunks.

Rows, per op: a step's token rows (RMSNorm, the activation, LoRA), its decoding sequences
(decode attention), one prefill chunk's tokens (prefill attention).
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from functools import partial

import torch
import torch.nn.functional as F

from switchboard_kernels.activation_native import native_activation
from switchboard_kernels.attention_native import DTYPES as ATTENTION_DTYPES
from switchboard_kernels.attention_native import MAX_HEAD_DIM, native_attention
from switchboard_kernels.lora import LoraMapping, add_lora
from switchboard_kernels.lora_native import NativeSlots, native_library
from switchboard_kernels.measured_choice import (
    MEASURE_ROUNDS,
    ROW_BUCKETS,
    CpuShare,
    KernelPlan,
    Seconds,
    cache_path,
    cached_or_measured,
    choose,
    describe_seconds,
    fastest_of_short,
    kernel_sources,
)
from switchboard_kernels.norm_native import native_norm, torch_rms_norm
from switchboard_kernels.norm_native import rms_norm as native_rms_norm
from switchboard_kernels.paged_attention import attend
from worker.core.batch import ScheduledSequence
from worker.core.sequence import Sequence
from worker.model.step_inputs import prepare_step
from worker.sampling.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

NATIVE, TORCH = "native", "torch"
NATIVE_DTYPES = (torch.bfloat16, torch.float32)
MEASURE_SECONDS = 20.0  # buckets past this are left out (they take the largest's kernel)
DECODE_CONTEXT = 512  # tokens each decoding sequence has cached in a measurement
PREFILL_CONTEXT = 512  # a measured chunk runs once fresh and once over this many cached
LORA_RANK, LORA_ADAPTERS = 16, 8
# KV a decode measurement reads per step, at least (layers added up to the model's): more
# than a last-level cache, so the kernels read the cache from memory as a step does.
STREAM_BYTES = 64 << 20
PLAN_VERSION = 2  # bump when the meaning of a cached plan changes (2: short steps timed thrice)


@dataclass(frozen=True, slots=True)
class OpShapes:
    """What a measurement needs of the model and the engine."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    max_rows: int  # max_num_batched_tokens
    max_seqs: int  # max_num_seqs


@dataclass(frozen=True, slots=True)
class OpPlans:
    """Each op's kernels; the model, the runner and the LoRA manager ask it per call or step."""

    norm: KernelPlan
    activation: KernelPlan
    lora: KernelPlan
    decode_attention: KernelPlan
    prefill_attention: KernelPlan

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if self.norm.kernel_for(_rows(x)) == NATIVE:
            return native_rms_norm(x, weight, eps)  # torch's op where the kernel cannot serve
        return torch_rms_norm(x, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` over the two halves of ``gate_up``'s last dim."""
        if self.activation.kernel_for(_rows(gate_up)) == NATIVE and _native_activation_fits(
            gate_up
        ):
            return native_activation().silu_mul(gate_up)  # type: ignore[union-attr]
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def native_lora(self, tokens: int) -> bool:
        return self.lora.kernel_for(tokens) == NATIVE

    def native_decodes(self, sequences: int) -> bool:
        return self.decode_attention.kernel_for(sequences) == NATIVE

    def native_chunk(self, tokens: int) -> bool:
        return self.prefill_attention.kernel_for(tokens) == NATIVE

    def describe(self) -> str:
        return "; ".join(f"{f.name} {getattr(self, f.name).describe()}" for f in fields(self))

    def for_native_step(self) -> OpPlans:
        """The plans once a one-call native decode step is built (it runs only where the
        norm, activation and decode attention plans pick native for its rows): each of those
        that picks native for larger row counts picks it for every count. The step saves
        the ~330 ops a decode step dispatches from Python (1.8x a batch-1 decode on a Zen 3),
        where an op timed alone at a few rows prefers torch by microseconds (the activation
        up to 4 rows on a Zen 3); the torch path calls the same kernels, so both agree."""

        def widened(plan: KernelPlan) -> KernelPlan:
            return replace(plan, small=NATIVE, split_rows=0) if plan.large == NATIVE else plan

        plans = replace(
            self,
            norm=widened(self.norm),
            activation=widened(self.activation),
            decode_attention=widened(self.decode_attention),
        )
        return self if plans == self else plans


def _rows(x: torch.Tensor) -> int:
    return x.shape[0] if x.dim() > 1 else 1


def _native_activation_fits(gate_up: torch.Tensor) -> bool:
    return (
        gate_up.dim() == 2
        and gate_up.device.type == "cpu"
        and gate_up.dtype in NATIVE_DTYPES
        and gate_up.stride(1) == 1
        and native_activation() is not None
    )


def available_kernels(op: str, dtype: torch.dtype, shapes: OpShapes | None = None) -> list[str]:
    """The kernels ``op`` can run on for ``dtype`` on this CPU (torch's always)."""
    if dtype not in NATIVE_DTYPES:
        return [TORCH]
    built = {
        "norm": native_norm() is not None,
        "activation": native_activation() is not None,
        "lora": native_library() is not None,
        "decode_attention": native_attention() is not None
        and dtype in ATTENTION_DTYPES
        and (shapes is None or shapes.head_dim <= MAX_HEAD_DIM),
    }
    built["prefill_attention"] = built["decode_attention"]
    return [NATIVE, TORCH] if built[op] else [TORCH]


OPS = ("norm", "activation", "lora", "decode_attention", "prefill_attention")


def fixed_op_plans(dtype: torch.dtype, device: torch.device | str = "cpu") -> OpPlans:
    """Without a measurement: the native kernels wherever they build (the activation only
    with a vector loop: torch's vectorized ops outpace the kernel's plain loop), SDPA
    for every prefill chunk; torch's ops off the CPU."""
    on_cpu = torch.device(device).type == "cpu"

    def plan(op: str, native_wins: bool = True) -> KernelPlan:
        native = on_cpu and native_wins and NATIVE in available_kernels(op, dtype)
        kernel = NATIVE if native else TORCH
        return KernelPlan(kernel, kernel)

    activation = native_activation()
    return OpPlans(
        norm=plan("norm"),
        activation=plan("activation", activation is not None and activation.has_vector_loop),
        lora=plan("lora"),
        decode_attention=plan("decode_attention"),
        prefill_attention=KernelPlan(TORCH, TORCH),
    )


@dataclass(frozen=True, slots=True)
class OpMeasurement:
    plans: OpPlans
    seconds: dict[str, Seconds]  # by op
    elapsed: float
    cpu_share: float

    def record(self) -> dict:
        return {
            "plans": {op: getattr(self.plans, op).record() for op in OPS},
            "seconds": {
                op: {k: {str(r): t for r, t in times.items()} for k, times in s.items()}
                for op, s in self.seconds.items()
            },
            "elapsed": self.elapsed,
        }

    def summary(self) -> str:
        timings = " | ".join(f"{op}: {describe_seconds(s)}" for op, s in self.seconds.items())
        return f"in {self.elapsed:.1f} s: {self.plans.describe()}; ms a step by rows: {timings}"


def measure_op_plans(
    shapes: OpShapes,
    dtype: torch.dtype,
    *,
    seconds_limit: float = MEASURE_SECONDS,
    ops: tuple[str, ...] = OPS,
) -> OpMeasurement:
    """Time each op's kernels on tensors of ``shapes`` at each bucket it can meet, rounds
    outermost and kernels in a shuffled order; ops left out of ``ops`` keep the fixed rule."""
    clock = CpuShare()
    fixed = fixed_op_plans(dtype)
    steps = {op: _STEPS[op](shapes, dtype) for op in ops}
    candidates = {op: available_kernels(op, dtype, shapes) for op in ops}
    limit = {"decode_attention": shapes.max_seqs}
    seconds: dict[str, Seconds] = {op: {k: {} for k in candidates[op]} for op in ops}
    order = random.Random(0)
    for _ in range(MEASURE_ROUNDS):
        for op in ops:
            if len(candidates[op]) < 2:
                continue
            buckets = [r for r in ROW_BUCKETS if r <= max(1, limit.get(op, shapes.max_rows))]
            for rows in buckets:
                first = seconds[op][candidates[op][0]]
                if rows not in first and clock.elapsed() > seconds_limit:
                    break
                for kernel in order.sample(candidates[op], len(candidates[op])):
                    taken = fastest_of_short(partial(steps[op], kernel, rows))
                    seconds[op][kernel][rows] = min(seconds[op][kernel].get(rows, math.inf), taken)
    chosen = {
        op: choose(seconds[op], dual=True)
        if len(candidates.get(op, ())) > 1 and all(seconds[op].values())
        else getattr(fixed, op)
        for op in OPS
    }
    measured = {op: s for op, s in seconds.items() if len(s) > 1}
    return OpMeasurement(OpPlans(**chosen), measured, clock.elapsed(), clock.share())


def op_plans(
    shapes: OpShapes,
    dtype: torch.dtype,
    *,
    device: torch.device | str = "cpu",
    measure: bool = True,
) -> OpPlans:
    """The plans for a model's ops: measured (or read from the cache) on CPU when
    ``measure``, else ``fixed_op_plans``."""
    fixed = fixed_op_plans(dtype, device)
    if not measure or torch.device(device).type != "cpu" or dtype not in NATIVE_DTYPES:
        return fixed
    return cached_or_measured(
        cache_path(
            "ops",
            *kernel_sources(
                "norm_cpu.c", "activation_cpu.c", "swiglu.h", "lora_cpu.c", "attention_cpu.c"
            ),
            json.dumps([PLAN_VERSION, str(dtype), _shape_key(shapes)]),
        ),
        "the other ops",
        read=lambda record: OpPlans(**{op: KernelPlan.cached(record["plans"][op]) for op in OPS}),
        measure=lambda: _measured(measure_op_plans(shapes, dtype)),
        fixed=lambda: fixed,
        describe=OpPlans.describe,
    )


def _measured(result: OpMeasurement) -> tuple[OpPlans, OpMeasurement]:
    return result.plans, result


def _shape_key(shapes: OpShapes) -> list[int]:
    return [getattr(shapes, f.name) for f in fields(shapes)]


# --- one step's worth of each op, timed ---------------------------------------------------

Step = Callable[[str, int], float]  # (kernel, rows) -> seconds


def _timed(fn: Callable[[], object]) -> float:
    with torch.inference_mode():
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start


def _norm_step(shapes: OpShapes, dtype: torch.dtype) -> Step:
    """A step's RMSNorms: two a layer and the final one, over [rows, hidden]."""
    weight = torch.rand(shapes.hidden_size).to(dtype) + 0.5
    plans = {k: _only(k) for k in (NATIVE, TORCH)}
    calls = 2 * shapes.num_layers + 1

    def step(kernel: str, rows: int) -> float:
        x = torch.randn(rows, shapes.hidden_size).to(dtype)
        plan = plans[kernel]
        return _timed(lambda: [plan.rms_norm(x, weight, 1e-6) for _ in range(calls)])

    return step


def _activation_step(shapes: OpShapes, dtype: torch.dtype) -> Step:
    """A step's SwiGLU activations: one a layer over [rows, 2 * intermediate]."""
    plans = {k: _only(k) for k in (NATIVE, TORCH)}

    def step(kernel: str, rows: int) -> float:
        gate_up = torch.randn(rows, 2 * shapes.intermediate_size).to(dtype)
        plan = plans[kernel]
        return _timed(lambda: [plan.silu_mul(gate_up) for _ in range(shapes.num_layers)])

    return step


def _only(kernel: str) -> OpPlans:
    plan = KernelPlan(kernel, kernel)
    return OpPlans(plan, plan, plan, plan, plan)


def _lora_step(shapes: OpShapes, dtype: torch.dtype) -> Step:
    """A step's LoRA on every projection of every layer (rank 16, eight adapters): up to 32
    rows as decodes, each on an adapter in turn; more as four prefill chunks."""
    h, i = shapes.hidden_size, shapes.intermediate_size
    attention = shapes.num_heads * shapes.head_dim
    qkv = (shapes.num_heads + 2 * shapes.num_kv_heads) * shapes.head_dim
    gen = torch.Generator().manual_seed(0)
    groups = []
    for out, inp in ((qkv, h), (h, attention), (2 * i, h), (h, i)):
        a = (torch.randn(LORA_ADAPTERS, LORA_RANK, inp, generator=gen) * inp**-0.5).to(dtype)
        b = (torch.randn(LORA_ADAPTERS, out, LORA_RANK, generator=gen) * 0.01).to(dtype)
        native = None
        if NativeSlots.wanted(a):
            native = NativeSlots(LORA_ADAPTERS, inp, [(0, out)], dtype)
            for slot in range(LORA_ADAPTERS):
                native.refresh(slot, a[slot], b[slot])
        groups.append((a, b, native))
    scales = torch.full((LORA_ADAPTERS,), 2.0)

    def step(kernel: str, rows: int) -> float:
        if rows <= 32:
            token_slots = [r % LORA_ADAPTERS for r in range(rows)]
        else:
            token_slots = [min(4 * r // rows, 3) for r in range(rows)]
        inputs = {a.shape[2]: torch.randn(rows, a.shape[2]).to(dtype) for a, _, _ in groups}
        outputs = [torch.zeros(rows, b.shape[1], dtype=dtype) for _, b, _ in groups]

        def run() -> None:
            mapping = LoraMapping.build(token_slots, native=kernel == NATIVE)
            for _ in range(shapes.num_layers):
                for (a, b, native), y in zip(groups, outputs, strict=True):
                    add_lora(y, inputs[a.shape[2]], a, b, scales, mapping, native=native)

        return _timed(run)

    return step


def _attention_step(shapes: OpShapes, dtype: torch.dtype, *, decode: bool) -> Step:
    """A step's attention on the engine's paged cache: ``rows`` decoding sequences over
    ``DECODE_CONTEXT`` cached tokens each, or one prefill chunk of ``rows`` tokens fresh and
    over ``PREFILL_CONTEXT`` cached; as many layers as stream ``STREAM_BYTES`` (decodes) or
    one (a chunk), through the engine's own step inputs and ``attend``."""

    def step(kernel: str, rows: int) -> float:
        if decode:
            return _attention_case(shapes, dtype, kernel == NATIVE, rows, 1, DECODE_CONTEXT)
        return sum(
            _attention_case(shapes, dtype, kernel == NATIVE, 1, rows, context)
            for context in (0, PREFILL_CONTEXT)
        )

    return step


def _attention_case(
    shapes: OpShapes, dtype: torch.dtype, native: bool, count: int, fed: int, context: int
) -> float:
    """Seconds ``count`` sequences feeding ``fed`` tokens each over ``context`` cached take to
    attend, decodes (``fed`` 1) on the native kernel or torch's groups, a chunk on the native
    kernel or SDPA."""
    bs, kv, d, heads = shapes.block_size, shapes.num_kv_heads, shapes.head_dim, shapes.num_heads
    decode = fed == 1 and context > 0
    blocks = -(-(context + fed) // bs)
    layers = 1
    if decode:
        layer_bytes = 2 * count * blocks * bs * kv * d * dtype.itemsize
        layers = max(1, min(shapes.num_layers, math.ceil(STREAM_BYTES / layer_bytes)))
    shape = (count * blocks + 1, bs, kv, d)
    caches = [(torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)) for _ in range(layers)]
    scheduled = []
    for n in range(count):
        seq = Sequence(f"m{n}", [0] * (context + fed), SamplingParams(), n)
        seq.block_table.extend(range(1 + n * blocks, 1 + (n + 1) * blocks))
        scheduled.append(ScheduledSequence(seq, context, fed))
    inputs = prepare_step(
        scheduled,
        block_size=bs,
        native_decodes=native or not decode,
        triton_attention=False,
        num_kv_heads=kv,
        heads_per_kv_head=heads // kv,
        device_type="cpu",
        native_chunk=None if decode else lambda _: native,
    )
    q = torch.randn(count * fed, heads, d).to(dtype)
    k, v = (torch.randn(count * fed, kv, d).to(dtype) for _ in "kv")
    return _timed(lambda: [attend(q, k, v, *c, inputs.meta, d**-0.5) for c in caches])


_STEPS: dict[str, Callable[[OpShapes, torch.dtype], Step]] = {
    "norm": _norm_step,
    "activation": _activation_step,
    "lora": _lora_step,
    "decode_attention": lambda s, d: _attention_step(s, d, decode=True),
    "prefill_attention": lambda s, d: _attention_step(s, d, decode=False),
}
