"""CPU multi-LoRA options vs the base projection they ride on, per batch shape.

Shapes of the default model (hidden 576, intermediate 1536): the up projection 576 -> 1536
and the down projection 1536 -> 576; ranks 8 and 16; T = 1 ... 1024 tokens as
min(T, 32) sequences of T / min(T, 32) tokens each (decodes up to 32, then prefill chunks);
1, 8 or 32 adapters, drawn per sequence with uniform or zipf(1.5) popularity; a bf16 model
with bf16 or fp32 adapter stacks, and an fp32 model.

Candidates (``switchboard_kernels/lora_torch.py``): ``segments`` (SGMV in torch, a matmul pair
per run of one adapter), computing in fp32 or, for a bf16 model, in bf16 (suffix
``/bf16``); ``bucketed`` (BGMV as padded batched matmuls over the slot range, passes as
``switchboard_kernels.lora.bucket_passes`` picks them) and ``bucketed-1pass`` (one pass as wide as
the busiest slot), in the stacks' dtype; ``packed-pairs`` and ``fp32-pairs`` (bf16 stacks: a
pair per run with each slot's A and B cut to rank, prepacked or in fp32,
``switchboard_kernels.lora.SlotPairs``); ``native`` (bf16 stacks: the C kernel of
``switchboard_kernels/lora_cpu.c``, every token in one call,
``switchboard_kernels.lora.NativeSlots``); ``auto`` is ``switchboard_kernels.lora.add_lora``, the
dispatch, given what the LoRA manager would keep (the native slots where the kernel builds, else the
packed pairs). The baseline is ``F.linear(x, W)`` (and, for bf16, the prepacked
``switchboard_kernels.linear.Linear`` the model uses) on the same x.

Timing: rounds outermost, then every configuration, then its methods in a shuffled order,
so a burst of load from other processes on these shared 2-core machines hits them all
alike; each method is called once untimed and then ``--reps`` times (warm caches for all,
which flatters the base matmul a little: its weight no longer streams from DRAM). The
per-call time is the minimum over rounds of the mean of the reps (the median is kept in
the JSON too). Usage: ``python -m bench.lora_ops [--rounds 7] [--threads 1] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from switchboard_kernels import lora_torch
from switchboard_kernels.linear import Linear
from switchboard_kernels.lora import LoraMapping, NativeSlots, SlotPairs, add_lora, bucket_passes

PROJECTIONS = ((576, 1536), (1536, 576))
RANKS = (8, 16)
TOKENS = (1, 8, 32, 64, 128, 256, 1024)  # 64/128: where bf16 compute starts to pay
ADAPTERS = (1, 8, 32)
MAX_SEQS = 32
# (activations, adapter stacks): a bf16 model with bf16 stacks, or with fp32 stacks (no
# conversion when the small-batch path computes in fp32).
STACKS = (
    (torch.bfloat16, torch.bfloat16),
    (torch.bfloat16, torch.float32),
    (torch.float32, torch.float32),
)


@dataclass
class Case:
    dtype: str
    stacks: str  # dtype of the adapter stacks
    in_features: int
    out_features: int
    rank: int
    tokens: int
    adapters: int
    popularity: str
    distinct: int = 0  # adapters actually present in the batch
    runs: int = 0  # segments (runs of one adapter) in token order
    ms: dict[str, float] = field(default_factory=dict)
    ms_median: dict[str, float] = field(default_factory=dict)


def token_slots(tokens: int, adapters: int, popularity: str, rng: np.random.Generator) -> list[int]:
    """min(tokens, 32) sequences of equal length, each with one adapter drawn by popularity."""
    num_seqs = min(tokens, MAX_SEQS)
    weights = (
        np.ones(adapters) if popularity == "uniform" else 1.0 / np.arange(1, adapters + 1) ** 1.5
    )
    seq_slots = rng.choice(adapters, size=num_seqs, p=weights / weights.sum())
    return np.repeat(seq_slots, tokens // num_seqs).tolist()


def methods(x, y, a, b, scales, mapping: LoraMapping, weight) -> dict[str, Callable]:
    out = {"base": lambda: F.linear(x, weight)}
    if x.dtype == torch.bfloat16:
        packed = Linear(weight.clone())
        out["packed"] = lambda: packed(x)
    slots = mapping.token_slots
    bounds, run_slots = mapping.seg_starts.tolist(), mapping.seg_slots.tolist()
    runs = [(bounds[k], bounds[k + 1], s) for k, s in enumerate(run_slots) if s >= 0]
    rows = (slots >= 0).nonzero().squeeze(1).tolist()
    row_slots = slots[rows].tolist()
    one_pass = bucket_passes(rows, row_slots, width=max(Counter(row_slots).values()))
    passes = bucket_passes(rows, row_slots)
    computes = [torch.float32] + ([torch.bfloat16] if x.dtype == torch.bfloat16 else [])
    for cd in computes:
        tag = "" if cd == torch.float32 else "/bf16"
        out["segments" + tag] = lambda cd=cd: lora_torch.lora_segments(
            y, x, a, b, scales, runs, compute_dtype=cd
        )
    pairs = None
    if SlotPairs.wanted(a):
        pairs = SlotPairs(a.shape[0], a.dtype)
        for slot in range(a.shape[0]):
            pairs.refresh(slot, a, b)
        out["packed-pairs"] = lambda: lora_torch.lora_packed_segments(y, x, pairs, scales, runs)
        out["fp32-pairs"] = lambda: lora_torch.lora_packed_segments(
            y, x, pairs, scales, runs, fp32=True
        )
    out["bucketed"] = lambda: lora_torch.lora_bucketed(y, x, a, b, scales, passes)
    out["bucketed-1pass"] = lambda: lora_torch.lora_bucketed(y, x, a, b, scales, one_pass)
    out["auto"] = lambda: add_lora(y, x, a, b, scales, mapping, pairs=pairs)
    if NativeSlots.wanted(a):
        native = NativeSlots(a.shape[0], a.shape[2], [(0, b.shape[1])])
        for slot in range(a.shape[0]):
            native.refresh(slot, a[slot], b[slot])
        native_mapping = LoraMapping.build(slots, native=True)
        out["native"] = lambda: add_lora(y, x, a, b, scales, native_mapping, native=native)
        out["auto"] = out["native"]  # what the LoRA manager keeps for bf16 stacks
    return out


def build_cases(seed: int) -> list[tuple[Case, dict[str, Callable]]]:
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    cases = []
    for dtype, stacks in STACKS:
        for in_f, out_f in PROJECTIONS:
            weight = torch.randn(out_f, in_f, dtype=dtype) / in_f**0.5
            for rank in RANKS:
                slots = max(ADAPTERS)
                a = (torch.randn(slots, rank, in_f) / in_f**0.5).to(stacks)
                b = (torch.randn(slots, out_f, rank) / rank**0.5).to(stacks)
                scales = torch.full((slots,), 2.0 / rank)
                for tokens in TOKENS:
                    for adapters in ADAPTERS:
                        for popularity in ("uniform", "zipf") if adapters > 1 else ("uniform",):
                            case = Case(
                                str(dtype)[6:],
                                str(stacks)[6:],
                                in_f,
                                out_f,
                                rank,
                                tokens,
                                adapters,
                                popularity,
                            )
                            mapping = LoraMapping.build(
                                token_slots(tokens, adapters, popularity, rng)
                            )
                            case.distinct = len(set(mapping.token_slots.tolist()))
                            case.runs = len(mapping.seg_slots)
                            x = torch.randn(tokens, in_f, dtype=dtype)
                            y = torch.zeros(tokens, out_f, dtype=dtype)
                            cases.append((case, methods(x, y, a, b, scales, mapping, weight)))
    return cases


def run(rounds: int, reps: int, seed: int) -> list[Case]:
    cases = build_cases(seed)
    samples: list[dict[str, list[float]]] = [{k: [] for k in fns} for _, fns in cases]
    order = random.Random(seed)
    for _ in range(rounds):
        for (_, fns), times in zip(cases, samples, strict=True):
            names = list(fns)
            order.shuffle(names)
            for name in names:
                fn = fns[name]
                fn()  # same cache state for every method: its own data just touched
                start = time.perf_counter()
                for _ in range(reps):
                    fn()
                times[name].append((time.perf_counter() - start) / reps * 1e3)
    for (case, _), times in zip(cases, samples, strict=True):
        case.ms = {k: round(min(v), 4) for k, v in times.items()}
        case.ms_median = {k: round(statistics.median(v), 4) for k, v in times.items()}
    return [case for case, _ in cases]


def table(cases: list[Case]) -> str:
    """One line per case: baselines, the best candidate, and what the dispatch (auto) took."""
    lines = [
        "act      stacks   proj      r     T ad pop     dist runs |   base packed | best          "
        "    ms |   auto auto/base auto/best"
    ]
    for c in cases:
        lora = {k: v for k, v in c.ms.items() if k not in ("base", "packed", "auto")}
        best = min(lora, key=lora.__getitem__)
        base, auto = c.ms["base"], c.ms["auto"]
        lines.append(
            f"{c.dtype:8} {c.stacks:8} {c.in_features}>{c.out_features:<5} {c.rank:2} {c.tokens:5} "
            f"{c.adapters:2} {c.popularity:7} {c.distinct:4} {c.runs:4} | {base:6.3f} "
            f"{c.ms.get('packed', base):6.3f} | {best:13} {lora[best]:6.3f} | {auto:6.3f} "
            f"{auto / base:9.0%} {auto / lora[best]:9.2f}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default: torch's choice); 1 is steadier while other jobs run",
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results/lora_ops.json"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cases = run(args.rounds, args.reps, args.seed)
    print(table(cases))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {**vars(args), "out": str(args.out), "threads": torch.get_num_threads()}
    meta["torch"] = torch.__version__
    args.out.write_text(json.dumps({"meta": meta, "cases": [asdict(c) for c in cases]}, indent=1))


if __name__ == "__main__":
    main()
