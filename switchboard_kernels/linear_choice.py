"""Which kernel multiplies a step's rows by the projection weights, chosen by measurement on
the CPU at hand.

The candidates are our native panel kernels (``linear_cpu.c`` for fp32, ``linear_bf16_cpu.c``
for bf16), oneDNN's packed matmul, for bf16 weights where oneDNN packs no bf16 (AVX2-only CPUs)
its fp32 matmul over the weights widened once (``upcast``: the same products, rows widened and
the result rounded to bf16), and plain ``F.linear``. Which wins depends on the CPU and on
the rows: on a 2-core Zen 4 the bf16 panels beat oneDNN from 1 to 256 rows; on a Xeon with AMX
oneDNN's tiles are 3-7x faster from 8 rows up; on a Zen 3 the fp32 panels win decode and lose
long prefills by up to ~25% (docs/performance.md). So a ``LinearPlan`` names a kernel for small
row counts and one for large ones, and ``measure_plan`` times every candidate on weights of the
model's layer shapes (enough layers to stream from memory, as a step does) at ``ROW_BUCKETS``.
Measuring takes a few seconds once per CPU, model shape, dtype and library build: the plan is
cached on disk (beside the native kernels' builds). Holding two kernels holds two copies of the
weights: allowed while they stay within ``DUAL_MEMORY_FRACTION`` of the machine's memory, else
the one kernel with the least total time over the buckets. ``fixed_plan`` is the rule used when
nothing is measured.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import psutil
import torch

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

logger = logging.getLogger(__name__)

PANELS, ONEDNN, UPCAST, TORCH = "panels", "onednn", "upcast", "torch"
# Weights a measurement multiplies per step, at least: several times any CPU's last-level
# cache, so each product reads its weight from memory as a model's step does.
STREAM_BYTES = 256 << 20
MEASURE_SECONDS = 30.0  # larger buckets are left out past this (they take the largest's kernel)
# Without a measurement on an AMX CPU, the panels keep bf16 products of up to this many rows
# (a 2-core Sapphire Rapids: panels 12.7 vs oneDNN 15.9 ms a step at 1 row, 23.4 vs 15.7 at 8).
AMX_PANEL_ROWS = 4
# Two copies of the projection weights at most this share of the machine's memory.
DUAL_MEMORY_FRACTION = 0.25
# The one-call decode step (``decode_step_cpu.c``) multiplies through the small-row kernel
# only, and saves the torch path's ~330 dispatched ops a step: so at the rows a decode step
# holds, the panels' projection times count this much less when the plan is chosen. On a
# 2-core Zen 3 (fp32) oneDNN measured 4% faster than the panels at 64 rows in isolation, so the
# split fell at 16 rows; in the engine, decode steps of 32 and 64 rows then served 1.15-1.36x
# the tokens with the panels in one call than through torch with oneDNN (bench/README.md).
DECODE_STEP_CREDIT = 0.15
PLAN_VERSION = 3  # bump when a cached plan's meaning changes (3: the decode step's credit)

LinearPlan = KernelPlan  # the projections' plan: kernels named PANELS, ONEDNN, UPCAST, TORCH


@dataclass(frozen=True, slots=True)
class Measurement:
    """Seconds of one step's projections (all measured layers) by kernel and rows;
    ``cpu_share``: the CPU time our threads got over the wall time of all of them."""

    plan: LinearPlan
    seconds: Seconds
    layers: int
    elapsed: float
    cpu_share: float = 1.0

    def record(self) -> dict:
        return {
            "plan": self.plan.record(),
            "seconds": {k: {str(r): s for r, s in t.items()} for k, t in self.seconds.items()},
            "layers": self.layers,
            "elapsed": self.elapsed,
        }

    def summary(self) -> str:
        return (
            f"in {self.elapsed:.1f} s over {self.layers} layers: {self.plan.describe()}; "
            f"ms a step by rows: {describe_seconds(self.seconds)}"
        )


def available_kernels(dtype: torch.dtype) -> list[str]:
    """The kernels that can multiply ``dtype`` weights on this CPU, plain torch last (it is
    measured only where nothing else is: oneDNN's packed matmul is the same op without the
    reorder on every call)."""
    from switchboard_kernels.linear import can_pack
    from switchboard_kernels.linear_native import native_linear, native_linear_bf16

    found = []
    if (dtype == torch.float32 and native_linear() is not None) or (
        dtype == torch.bfloat16 and native_linear_bf16() is not None
    ):
        found.append(PANELS)
    if can_pack(torch.empty(0, 16, dtype=dtype)):
        found.append(ONEDNN)
    elif dtype == torch.bfloat16 and can_pack(torch.empty(0, 16)):
        found.append(UPCAST)
    return found or [TORCH]


def fixed_plan(
    dtype: torch.dtype, device: torch.device | str = "cpu", *, dual: bool = True
) -> LinearPlan:
    """Without a measurement: bf16 through the native panels wherever they build (on AMX
    CPUs on the tiles themselves from two rows up), except where the CPU has AMX tiles and the
    panels' build does not, where oneDNN's tiles win from a few rows up (the panels keep up to
    ``AMX_PANEL_ROWS`` rows when ``dual`` allows two copies); fp32 through the panels on CPUs
    whose widest vectors are AVX2's (with AVX-512, oneDNN's wider kernels); else oneDNN's
    packed matmul where it packs, else ``F.linear``."""
    from switchboard_kernels.linear_native import bf16_panels_use_amx

    if torch.device(device).type != "cpu":
        return LinearPlan(TORCH, TORCH)
    kernels = available_kernels(dtype)
    amx_panels = PANELS in kernels and bf16_panels_use_amx()
    if (
        dtype == torch.bfloat16
        and ONEDNN in kernels
        and torch.cpu._is_amx_tile_supported()
        and not amx_panels
    ):
        if dual and PANELS in kernels:
            return LinearPlan(PANELS, ONEDNN, AMX_PANEL_ROWS)
        return LinearPlan(ONEDNN, ONEDNN)
    if PANELS in kernels and (
        dtype == torch.bfloat16 or torch.backends.cpu.get_cpu_capability() == "AVX2"
    ):
        return LinearPlan(PANELS, PANELS)
    kernel = ONEDNN if ONEDNN in kernels else TORCH
    return LinearPlan(kernel, kernel)  # (upcast only by measurement: it holds 2x the bytes)


def invariant_plan(dtype: torch.dtype, device: torch.device | str = "cpu") -> LinearPlan | None:
    """Batch-invariant products: one kernel for every row count, whose sums for a row do not
    depend on the other rows of the call, the thread that runs it, or their number: our native
    panels in ``fixed_order`` (oneDNN picks its blocking, and so its summation order, by the
    rows). None where the panels cannot serve ``dtype`` (not a CPU, no compiler)."""
    if torch.device(device).type != "cpu" or PANELS not in available_kernels(dtype):
        return None
    return LinearPlan(PANELS, PANELS, source="invariant", fixed_order=True)


def measure_plan(
    shapes: Sequence[tuple[int, int]],
    dtype: torch.dtype,
    *,
    num_layers: int,
    max_rows: int,
    dual: bool,
    decode_rows: int = 0,
    seconds_limit: float = MEASURE_SECONDS,
) -> Measurement:
    """Time each available kernel on random weights of one layer's ``shapes`` ([out, in]),
    repeated over as many layers (up to ``num_layers``) as ``STREAM_BYTES`` needs, at each of
    ``measured_rows``, rounds outermost and kernels in a shuffled order. ``decode_rows``: the
    most rows of a decode step the one-call step may take (0: none; see
    ``decode_step_credited``)."""
    from switchboard_kernels.linear import make_kernel

    clock = CpuShare()
    kernels = available_kernels(dtype)
    layer_bytes = sum(o * i for o, i in shapes) * torch.empty(0, dtype=dtype).element_size()
    layers = max(1, min(num_layers, math.ceil(STREAM_BYTES / max(layer_bytes, 1))))
    gen = torch.Generator().manual_seed(0)
    weights = [
        (torch.randn(o, i, generator=gen) * i**-0.5).to(dtype)
        for _ in range(layers)
        for o, i in shapes
    ]
    built = {k: [make_kernel(k, w) for w in weights] for k in kernels}
    del weights
    buckets = measured_rows(max_rows, decode_rows)
    seconds: Seconds = {k: {} for k in kernels}
    order = random.Random(0)
    for _ in range(MEASURE_ROUNDS):
        for rows in buckets:
            if rows not in seconds[kernels[0]] and clock.elapsed() > seconds_limit:
                break
            for k in order.sample(kernels, len(kernels)):
                taken = fastest_of_short(partial(_time_step, built[k], rows, shapes, dtype))
                seconds[k][rows] = min(seconds[k].get(rows, math.inf), taken)
    plan = choose(decode_step_credited(seconds, decode_rows), dual=dual and len(kernels) > 1)
    return Measurement(plan, seconds, layers, clock.elapsed(), clock.share())


def measured_rows(max_rows: int, decode_rows: int = 0) -> list[int]:
    """``ROW_BUCKETS`` up to ``max_rows``, and a full decode step's ``decode_rows`` between
    them: the split may fall there (a Zen 3's decode steps of 96 rows served 1.2-1.3x the
    tokens in one call with the panels than through torch with oneDNN, which led at 256)."""
    rows = {r for r in ROW_BUCKETS if r <= max(1, max_rows)}
    if 0 < decode_rows <= max_rows:
        rows.add(decode_rows)
    return sorted(rows)


def decode_step_credited(seconds: Seconds, decode_rows: int) -> Seconds:
    """``seconds`` as the plan weighs them: the panels' at buckets up to ``decode_rows``
    less ``DECODE_STEP_CREDIT`` (what a decode step saves by running in one native call,
    which only the small-row kernel's panels allow)."""
    if PANELS not in seconds or decode_rows < 1:
        return seconds
    credited = dict(seconds)
    credited[PANELS] = {
        rows: s / (1 + DECODE_STEP_CREDIT) if rows <= decode_rows else s
        for rows, s in seconds[PANELS].items()
    }
    return credited


def _time_step(
    step: list[Callable[[torch.Tensor], torch.Tensor]],
    rows: int,
    shapes: Sequence[tuple[int, int]],
    dtype: torch.dtype,
) -> float:
    inputs = {i: torch.randn(rows, i).to(dtype) for _, i in shapes}
    per_layer = len(shapes)
    with torch.inference_mode():
        start = time.perf_counter()
        for n, kernel in enumerate(step):
            kernel(inputs[shapes[n % per_layer][1]])
        return time.perf_counter() - start


def dual_allowed(projection_bytes: int) -> bool:
    """Whether two copies of ``projection_bytes`` stay within ``DUAL_MEMORY_FRACTION`` of this
    machine's memory."""
    return 2 * projection_bytes <= DUAL_MEMORY_FRACTION * psutil.virtual_memory().total


def linear_plan(
    shapes: Sequence[tuple[int, int]],
    dtype: torch.dtype,
    *,
    num_layers: int,
    max_rows: int,
    decode_rows: int = 0,
    device: torch.device | str = "cpu",
    measure: bool = True,
) -> LinearPlan:
    """The plan for a model's projections: measured (or read from the cache) on CPU when
    ``measure``, else ``fixed_plan``. ``decode_rows``: see ``measure_plan``."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    dual = dual_allowed(num_layers * sum(o * i for o, i in shapes) * itemsize)
    if not measure or torch.device(device).type != "cpu" or len(available_kernels(dtype)) < 2:
        return fixed_plan(dtype, device, dual=dual)
    settings = {
        "num_layers": num_layers,
        "max_rows": max_rows,
        "dual": dual,
        "decode_rows": decode_rows,
    }
    return cached_or_measured(
        _cache_path(shapes, dtype, **settings),
        "projections",
        read=lambda record: LinearPlan.cached(record["plan"]),
        measure=lambda: _measured(measure_plan(shapes, dtype, **settings)),
        fixed=lambda: fixed_plan(dtype, device, dual=dual),
        describe=LinearPlan.describe,
    )


def _measured(result: Measurement) -> tuple[LinearPlan, Measurement]:
    return result.plan, result


def _cache_path(shapes, dtype, *, num_layers: int, max_rows: int, dual: bool, decode_rows: int):
    """Keyed by everything a measured plan depends on: the CPU, torch, our kernels' builds,
    the threads, the weights' shapes and dtype, the buckets measured, whether two copies
    fit and the decode step's rows."""
    return cache_path(
        "linear",
        *kernel_sources(
            "linear_cpu.c", "linear_bf16_cpu.c", "panels_f32.h", "panels_bf16.h", "amx_bf16.h",
            "amx.h", "bf16.h",
        ),
        json.dumps([PLAN_VERSION, available_kernels(dtype), [list(s) for s in shapes],
                    str(dtype), num_layers, measured_rows(max_rows, decode_rows), dual,
                    decode_rows]),
    )  # fmt: skip
