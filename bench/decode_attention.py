"""Decode attention's read of the paged KV cache, in GB/s, beside a plain streaming read.

The native decode kernel (``switchboard_kernels/attention_cpu.c``) on the default model's
attention shape (9 query heads over 3 KV heads of 64, bf16; ``--dtype float32`` as an AVX2-only
CPU serves it): S sequences of T cached tokens,
one query each, their blocks drawn from a shuffled pool as in a long-running server (blocks
anywhere in the cache; ``--in-order`` gives each sequence consecutive blocks), the caches on
2 MB pages as the engine keeps them (``--small-pages``: ordinary 4 KB pages). A call reads
every cached key and value once: S * (T + 1) * 3 * 64 * 2 (K and V) * 2 (or 4) bytes, which is
the figure divided by the call's time. The streaming read is torch's ``sum`` over an fp32 tensor
of the same bytes, the most a read can get from this machine's memory. ``--against FILE``
also times another version of the kernel's source (e.g. ``git show
main:switchboard_kernels/attention_cpu.c > /tmp/a.c``), built with the headers beside ours,
and checks that both give the same outputs.

Regimes (``--regimes``): ``dram``, 96 sequences of 3,000 tokens (221 MB, far over the L3),
``l3``, 8 of 1,000 (6 MB: the cache stays in the L3 between calls), and ``one``, a lone
sequence of 30,000 (23 MB: its three KV heads on two cores).

Timing: rounds outermost, the methods in a shuffled order within each, so a burst of load
from other processes hits them all alike; the figure per method is its fastest call, the
median beside it. A smaller regime runs more rounds (up to 50x), about as many bytes as
``dram``'s. Usage: ``python -m bench.decode_attention [--block-sizes 16,64]
[--regimes dram,l3,one] [--dtype bfloat16|float32] [--small-pages] [--rounds 7] [--threads N]
[--against FILE] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.kernel_builds import build_other
from bench.report import write_report
from switchboard_kernels.attention_native import NativeAttention, NativeDecodes, native_attention
from switchboard_kernels.huge_pages import zeros_on_huge_pages

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # the default model's attention
REGIMES = {"dram": (96, 3000), "l3": (8, 1000), "one": (1, 30000)}  # sequences, cached tokens


def load_other(source: Path) -> NativeAttention:
    """Another version of attention_cpu.c, built beside copies of our headers."""
    return NativeAttention(build_other(source, "attention_cpu.c"))


def make_case(
    seqs: int,
    tokens: int,
    block_size: int,
    *,
    in_order: bool,
    small_pages: bool = False,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, NativeDecodes]:
    """Query [S, heads, dim], the two caches and the decodes: every sequence at ``tokens``
    cached tokens plus its new one, its blocks from a shuffled pool (or consecutive)."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = -(-(tokens + 1) // block_size)
    num_blocks = seqs * per_seq
    shape = (num_blocks, block_size, KV_HEADS, HEAD_DIM)
    key_cache = torch.randn(shape, generator=gen).to(dtype)
    value_cache = torch.randn(shape, generator=gen).to(dtype)
    if not small_pages:  # where the engine keeps its caches (model_runner)
        key_cache = zeros_on_huge_pages(shape, dtype).copy_(key_cache)
        value_cache = zeros_on_huge_pages(shape, dtype).copy_(value_cache)
    pool = (
        list(range(num_blocks)) if in_order else torch.randperm(num_blocks, generator=gen).tolist()
    )
    tables = [pool[s * per_seq : (s + 1) * per_seq] for s in range(seqs)]
    decodes = NativeDecodes.build([tokens] * seqs, [1] * seqs, tables)
    query = torch.randn(seqs, HEADS, HEAD_DIM, generator=gen).to(dtype)
    return query, key_cache, value_cache, decodes


def time_methods(methods: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in methods}
    for fn in methods.values():  # warm: first-touch of scratch, the kernel loaded
        fn()
    for _ in range(rounds):
        order = list(methods)
        random.shuffle(order)
        for name in order:
            start = time.perf_counter()
            methods[name]()
            times[name].append(time.perf_counter() - start)
    return times


def run_case(
    regime: str,
    block_size: int,
    kernels: dict[str, NativeAttention],
    *,
    rounds: int,
    in_order: bool,
    small_pages: bool = False,
    dtype: torch.dtype = torch.bfloat16,
) -> dict:
    seqs, tokens = REGIMES[regime]
    query, key_cache, value_cache, decodes = make_case(
        seqs, tokens, block_size, in_order=in_order, small_pages=small_pages, dtype=dtype
    )
    scale = HEAD_DIM**-0.5
    outs = {name: torch.empty_like(query) for name in kernels}
    methods: dict[str, Callable[[], object]] = {
        name: (lambda k=k, o=outs[name]: k.decode(query, o, key_cache, value_cache, decodes, scale))
        for name, k in kernels.items()
    }
    nbytes = seqs * (tokens + 1) * KV_HEADS * HEAD_DIM * 2 * key_cache.element_size()
    stream = torch.ones(nbytes // 4, dtype=torch.float32)
    methods["stream"] = stream.sum
    dram_bytes = REGIMES["dram"][0] * (REGIMES["dram"][1] + 1) * KV_HEADS * HEAD_DIM * 2 * 2
    dram_bytes *= key_cache.element_size() // 2
    times = time_methods(methods, rounds * min(50, max(1, dram_bytes // nbytes)))
    first = next(iter(outs.values()))
    for name, out in outs.items():
        if not torch.equal(out, first):
            diff = (out.float() - first.float()).abs().max().item()
            print(f"  note: {name} differs from the first kernel by up to {diff:.3g}")
    row = {"regime": regime, "sequences": seqs, "tokens": tokens, "block_size": block_size}
    row["bytes"] = nbytes
    for name, ts in times.items():
        row[f"{name}_gbs_best"] = round(nbytes / min(ts) / 1e9, 2)
        row[f"{name}_gbs_median"] = round(nbytes / statistics.median(ts) / 1e9, 2)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--block-sizes", default="16,64")
    parser.add_argument("--regimes", default="dram,l3,one")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--in-order", action="store_true", help="consecutive blocks per sequence")
    parser.add_argument(
        "--small-pages", action="store_true", help="caches in 4 KB pages (not as the engine's)"
    )
    parser.add_argument("--against", type=Path, default=None, help="another attention_cpu.c")
    parser.add_argument("--out", default="bench/results/decode_attention.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ours = native_attention()
    if ours is None:
        raise SystemExit("the native attention kernel did not build (see the log)")
    kernels = {"kernel": ours}
    if args.against is not None:
        kernels["against"] = load_other(args.against)
    dtype = getattr(torch, args.dtype)
    rows = []
    for regime in args.regimes.split(","):
        for block_size in (int(b) for b in args.block_sizes.split(",")):
            row = run_case(
                regime, block_size, kernels, rounds=args.rounds, in_order=args.in_order,
                small_pages=args.small_pages, dtype=dtype,
            )  # fmt: skip
            rows.append(row)
            figures = ", ".join(
                f"{name} {row[f'{name}_gbs_best']:.1f} (median {row[f'{name}_gbs_median']:.1f})"
                for name in [*kernels, "stream"]
            )
            print(f"{regime} block {block_size} ({row['bytes'] / 1e6:.0f} MB), GB/s: {figures}")
    config = {
        "threads": torch.get_num_threads(),
        "dtype": args.dtype,
        "in_order": args.in_order,
        "rounds": args.rounds,
        "against": str(args.against) if args.against else None,
    }
    write_report({"config": config, "results": rows}, args.out)


if __name__ == "__main__":
    main()
