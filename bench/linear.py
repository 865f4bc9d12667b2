"""Dense projections on CPU: the native panel kernel against oneDNN's packed matmul.

A "step" is every projection of the default model's shape (30 layers of q/k/v 576 -> 960,
o 576 -> 576, gate/up 576 -> 3072, down 1536 -> 576, then the output layer 576 -> 49152;
seeded random fp32 weights, 540 MB in all, so each step streams its weights from DRAM as a
decode step does) applied to R rows. Methods: ``onednn`` (the weight reordered once for
oneDNN, ``switchboard_kernels.linear``'s path on CPUs with AVX-512), ``panels``
(``switchboard_kernels/linear_cpu.c`` over fp32 panels, its path on AVX2-only CPUs) and
``panels-int8`` (int8 panels, a draft model's weights; a quarter of the bytes). With ``--dtype
bfloat16`` the weights are bf16 (270 MB) and the methods ``onednn`` and ``panels-bf16``
(``switchboard_kernels/linear_bf16_cpu.c``, the path on CPUs with AVX-512). ``-fixed``: the
panels as ``batch_invariant`` runs them (a lone row in one chain, as in a tile of many).
``--quantized`` (with bf16) adds ``wq-int4`` and ``wq-int8``: every layer's projections
quantized as ``--quantization`` does on load, through ``switchboard_kernels/wq_cpu.c``, the
output layer in bf16 panels as loaded (65 / 104 MB of levels, scales and zeros, and 57 MB).
Before timing, each method's output is checked against ``F.linear`` on one layer (the
quantized ones against their dequantized weight).

``--against FILE``: another version of the panels' source (linear_cpu.c, or
linear_bf16_cpu.c with ``--dtype bfloat16``; wq_cpu.c with ``--quantized``) timed beside ours
as ``-against``.
``--beside-spinner S``: a process that spins S seconds every 1-4 ms runs throughout, as a
server's event loop, gateway and Redis take a core for moments from the engine's two-thread
team (then the median step is the figure that shows it, not the fastest).

Timing: rounds outermost, then the row counts, then the methods in a shuffled order, so a
burst of load from other processes hits them all alike; the figures per method are its
fastest and its median step over the rounds. Usage:
``python -m bench.linear [--dtype float32|bfloat16] [--quantized] [--rows 1,2,4,8,16,32,64,256]
[--rounds 5] [--against FILE] [--beside-spinner S] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.kernel_builds import build_other, start_spinner
from bench.report import write_report
from switchboard_kernels.linear import can_pack
from switchboard_kernels.linear_native import (
    Bf16PanelLinear,
    NativeLinear,
    PanelLinear,
    bf16_kernel_of,
    native_linear,
    native_linear_bf16,
)
from switchboard_kernels.wq_native import NativeWq, WqLinear, native_wq
from worker.model.quantize_on_load import OnLoad

HIDDEN, INTERMEDIATE, LAYERS, VOCAB = 576, 1536, 30, 49152
LAYER_SHAPES = ((960, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE))

Projection = Callable[[torch.Tensor], torch.Tensor]


def default_model_weights(seed: int = 0, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [s for _ in range(LAYERS) for s in LAYER_SHAPES] + [(VOCAB, HIDDEN)]
    return [(torch.randn(out, inp, generator=gen) * inp**-0.5).to(dtype) for out, inp in shapes]


def onednn(weight: torch.Tensor) -> Projection:
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1024)
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def quantized_methods(
    weights: list[torch.Tensor], against: Path | None, references: dict[str, torch.Tensor]
) -> dict[str, list[Projection]]:
    """``wq-int4``, ``wq-int8`` (and ``wq-int4-against``): the layers quantized as on load,
    the output layer bf16 panels; each one's dequantized third weight into ``references``."""
    if native_wq() is None or native_linear_bf16() is None:
        return {}
    other = NativeWq(build_other(against, "wq_cpu.c")) if against is not None else None
    head = Bf16PanelLinear(weights[-1])
    found: dict[str, list[Projection]] = {}
    for method in ("int4", "int8"):
        rounded = [OnLoad.of(method)("bench", w) for w in weights[:-1]]
        kernels = {f"wq-{method}": None} | ({f"wq-{method}-against": other} if other else {})
        for name, kernel in kernels.items():
            found[name] = [WqLinear(q, kernel=kernel) for q in rounded] + [head]
            references[name] = rounded[2].dequantize()
        other = None  # the other build against int4 only
    return found


def methods(
    weights: list[torch.Tensor], against: Path | None = None, *, quantized: bool = False,
    references: dict[str, torch.Tensor] | None = None,
) -> dict[str, list[Projection]]:  # fmt: skip
    found: dict[str, list[Projection]] = {}
    if quantized:  # beside the bf16 panels; --against is then the quantized kernel's source
        found = quantized_methods(weights, against, {} if references is None else references)
        if native_linear_bf16() is not None:
            found["panels-bf16"] = [Bf16PanelLinear(w) for w in weights]
        return found
    if can_pack(weights[0]):
        found["onednn"] = [onednn(w) for w in weights]
    if weights[0].dtype == torch.bfloat16:
        if native_linear_bf16() is not None:
            found["panels-bf16"] = [Bf16PanelLinear(w) for w in weights]
            found["panels-bf16-fixed"] = [Bf16PanelLinear(w, fixed_order=True) for w in weights]
            if against is not None:
                kernel = bf16_kernel_of(build_other(against, "linear_bf16_cpu.c"))
                found["panels-bf16-against"] = [Bf16PanelLinear(w, kernel=kernel) for w in weights]
    elif native_linear() is not None:
        found["panels"] = [PanelLinear(w) for w in weights]
        found["panels-fixed"] = [PanelLinear(w, fixed_order=True) for w in weights]
        found["panels-int8"] = [PanelLinear(w, int8=True) for w in weights]
        if against is not None:
            other = NativeLinear(build_other(against, "linear_cpu.c"))
            found["panels-against"] = [PanelLinear(w, kernel=other) for w in weights]
    return found


def check(
    name: str, projections: list[Projection], weight: torch.Tensor, dtype: torch.dtype
) -> None:
    """The method's third projection of ``dtype`` rows against ``F.linear`` over ``weight``."""
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(1)).to(dtype)
    want = F.linear(x.double(), weight.double())
    # int8 and bf16: within their rounding
    tolerance = 2e-2 if name.endswith("int8") or x.dtype == torch.bfloat16 else 1e-4
    error = (projections[2](x).double() - want).abs().max().item() / want.abs().max().item()
    if error > tolerance:
        raise AssertionError(f"{name}: relative error {error:.2e} against F.linear")


def time_step(projections: list[Projection], rows: int, dtype: torch.dtype) -> float:
    narrow, wide = torch.randn(rows, HIDDEN).to(dtype), torch.randn(rows, INTERMEDIATE).to(dtype)
    head = projections[-1]
    start = time.perf_counter()
    for i, projection in enumerate(projections[:-1]):
        projection(wide if i % 4 == 3 else narrow)
    head(narrow)
    return time.perf_counter() - start


def run(
    rows: list[int], rounds: int, seed: int = 0, dtype: torch.dtype = torch.float32, *,
    against: Path | None = None, spinner_s: float = 0.0, quantized: bool = False,
) -> dict:  # fmt: skip
    weights = default_model_weights(seed, dtype)
    references: dict[str, torch.Tensor] = {}
    candidates = methods(weights, against, quantized=quantized, references=references)
    for name, projections in candidates.items():
        check(name, projections, references.get(name, weights[2]), dtype)
    del weights
    order = random.Random(seed)
    steps: dict[tuple[str, int], list[float]] = {(n, r): [] for n in candidates for r in rows}
    spinner = start_spinner(spinner_s) if spinner_s > 0 else None
    try:
        for _ in range(rounds + 1):  # the first round warms up and is not counted
            warm = _ == 0
            for r in rows:
                names = list(candidates)
                order.shuffle(names)
                for name in names:
                    seconds = time_step(candidates[name], r, dtype)
                    if not warm:
                        steps[name, r].append(seconds)
    finally:
        if spinner is not None:
            spinner.kill()
    results = [
        {
            "rows": r,
            **{name: round(1000 * min(steps[name, r]), 2) for name in candidates},
            "median": {n: round(1000 * statistics.median(steps[n, r]), 2) for n in candidates},
        }
        for r in rows
    ]
    print(
        "rows  " + "  ".join(f"{name:>12}" for name in candidates) + "   (ms a step, best / median)"
    )
    for line in results:
        cells = (f"{line[n]:>5.1f} / {line['median'][n]:<5.1f}" for n in candidates)
        print(f"{line['rows']:>4}  " + "  ".join(f"{c:>12}" for c in cells))
    return {
        "threads": torch.get_num_threads(),
        "dtype": str(dtype).removeprefix("torch."),
        "rounds": rounds,
        "against": str(against) if against else None,
        "quantized": quantized,
        "beside_spinner_s": spinner_s,
        "steps": results,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,256")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--against", type=Path, default=None, help="another kernel's source")
    parser.add_argument("--quantized", action="store_true", help="int4 / int8 layers (bf16)")
    parser.add_argument("--beside-spinner", type=float, default=0.0, metavar="SECONDS")
    parser.add_argument("--out", default="bench/results/linear.json")
    args = parser.parse_args()
    if args.quantized and args.dtype != "bfloat16":
        parser.error("--quantized compares against the bf16 engine: add --dtype bfloat16")
    rows = [int(r) for r in args.rows.split(",")]
    report = run(
        rows, args.rounds, dtype=getattr(torch, args.dtype), against=args.against,
        spinner_s=args.beside_spinner, quantized=args.quantized,
    )  # fmt: skip
    write_report(report, args.out)


if __name__ == "__main__":
    main()
