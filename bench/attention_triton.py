"""On a CUDA GPU: the Triton paged attention against its memory-bandwidth floor and the torch path.

Decode is bound by bytes: every step reads each sequence's keys and values once. So per
model shape (the default model's 9 query / 3 KV heads, a 1.7B Llama's 32 / 32; head dim 64)
and batch (sequences x context tokens x query rows: 1, or k + 1 verifying k drafts), in bf16:

- ``triton``: ``switchboard_kernels.paged_attention_triton.decode`` with the split-K the layout
  picks, and without splits where it picked some;
- ``torch``: the torch path's decode group (blocks gathered, then SDPA), on the same batch;
- ``floor``: the bytes it must move (K and V of every context token, the queries and the
  outputs) over the device's peak bandwidth (``--peak-gbs``, else a table of known GPUs,
  else the bandwidth of a device copy measured here), and the kernel's time as a multiple.

Also the K/V write of a 128-sequence decode step and a 2,048-token prefill against its
floor, and a 2,048-token prefill chunk over 2,048 cached tokens (bound by FLOPs: TFLOP/s).
Blocks are shuffled over the cache. Each kernel is checked against the reference of
``switchboard_kernels/paged_attention_reference.py`` before it is timed (CUDA graphs of the call,
median: ``triton.testing.do_bench_cudagraph``). Usage: ``python -m bench.attention_triton
[--out FILE]``; ``--quick`` runs tiny shapes, also on CPU under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from bench.report import write_report
from switchboard_kernels import paged_attention_reference as ref
from switchboard_kernels import paged_attention_triton as tri
from switchboard_kernels.paged_attention import AttentionMetadata, DecodeGroup, paged_attention
from switchboard_kernels.paged_layout import PagedLayout, PagedSequence

SHAPES = {"smollm2-135m": (9, 3), "llama-1.7b": (32, 32)}  # query heads, KV heads
HEAD_DIM = 64
SCALE = HEAD_DIM**-0.5
# (sequences, context tokens, query rows per sequence)
DECODE_BATCHES = ((1, 4096, 1), (32, 1024, 1), (128, 256, 1), (128, 1024, 1), (128, 1024, 4))
QUICK_BATCHES = ((2, 40, 1), (3, 20, 4))
PEAK_GBS = {"H200": 4800.0, "H100 SXM": 3350.0, "H100 80GB HBM3": 3350.0, "A100-SXM4-80GB": 2039.0}
BLOCK_SIZE = 16


@dataclass
class Timing:
    kernel: str
    shape: str
    batch: str
    splits: int
    seconds: float
    bytes_moved: int
    floor_s: float
    over_floor: float  # seconds / floor_s
    note: str = ""

    @classmethod
    def of(cls, kernel, shape, batch, splits, seconds, moved, peak, note="") -> Timing:
        floor = moved / peak
        return cls(kernel, shape, batch, splits, seconds, moved, floor, seconds / floor, note)


def peak_bandwidth(device: torch.device, given: float | None) -> tuple[float, str]:
    """Bytes per second and where the figure comes from."""
    if given:
        return given * 1e9, "--peak-gbs"
    if device.type != "cuda":
        return 30e9, "nominal (CPU)"
    name = torch.cuda.get_device_name(device)
    for key, gbs in PEAK_GBS.items():
        if key in name:
            return gbs * 1e9, f"spec sheet ({name})"
    x = torch.empty(2**28, dtype=torch.float32, device=device)
    seconds = bench(lambda: x.clone(), device)
    return 2 * x.numel() * 4 / seconds, f"measured copy ({name})"


def bench(fn: Callable[[], object], device: torch.device) -> float:
    """Median seconds per call."""
    if device.type == "cuda":
        import triton.testing

        try:  # replayed as a CUDA graph: the GPU's time, not Python's launches
            return triton.testing.do_bench_cudagraph(fn, return_mode="median") / 1e3
        except RuntimeError:  # not capturable: launched one call at a time
            return triton.testing.do_bench(fn, return_mode="median") / 1e3
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def make_batch(
    seqs: int, context: int, rows: int, kv_heads: int, device: torch.device
) -> tuple[list[PagedSequence], torch.Tensor, torch.Tensor]:
    """Sequences whose blocks are shuffled over a cache just large enough, and the cache."""
    per_seq = -(-(context + rows) // BLOCK_SIZE)
    pool = torch.randperm(seqs * per_seq).tolist()
    sequences = [
        PagedSequence(context, rows, pool[i * per_seq : (i + 1) * per_seq]) for i in range(seqs)
    ]
    shape = (seqs * per_seq, BLOCK_SIZE, kv_heads, HEAD_DIM)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    caches = [torch.randn(shape, dtype=dtype, device=device) for _ in "kv"]
    return sequences, *caches


def check(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    error = (got.float() - want.float()).abs().max().item()
    if error > 3e-2:
        raise AssertionError(f"{what}: off the reference by {error}")


def time_decode(
    name: str, heads: int, kv_heads: int, batch: tuple[int, int, int], peak: float, device
) -> list[Timing]:
    seqs, context, rows = batch
    group = heads // kv_heads
    sequences, key_cache, value_cache = make_batch(seqs, context, rows, kv_heads, device)
    query = torch.randn(seqs * rows, heads, HEAD_DIM, dtype=key_cache.dtype, device=device)
    out = torch.empty_like(query)
    elt = key_cache.element_size()
    moved = 2 * seqs * (context + rows) * kv_heads * HEAD_DIM * elt + 2 * query.numel() * elt
    label = f"{seqs} x {context} ctx x {rows} rows"
    auto = PagedLayout.build(sequences, num_kv_heads=kv_heads, group=group).to(device)
    layouts = [auto]
    if auto.decode.num_splits > 1:
        layouts.append(
            PagedLayout.build(sequences, num_kv_heads=kv_heads, group=group, num_splits=1).to(
                device
            )
        )
    want = torch.empty_like(query, dtype=torch.float32)
    ref.decode(query.float(), key_cache.float(), value_cache.float(), auto, SCALE, want)
    timings = []
    for layout in layouts:

        def run(layout: PagedLayout = layout) -> None:
            tri.decode(query, key_cache, value_cache, layout, SCALE, out)

        run()
        check(out, want, f"triton decode {name} {label}")
        splits = layout.decode.num_splits
        timings.append(
            Timing.of("triton decode", name, label, splits, bench(run, device), moved, peak)
        )
    meta = torch_decode_group(sequences, rows, group, device)
    fresh = query[:, :kv_heads]  # read for its shape only: decode groups read the cache

    def run_torch() -> torch.Tensor:
        return paged_attention(query, fresh, fresh, key_cache, value_cache, meta, SCALE)

    check(run_torch(), want, f"torch decode {name} {label}")
    timings.append(Timing.of("torch decode", name, label, 1, bench(run_torch, device), moved, peak))
    return timings


def torch_decode_group(
    sequences: list[PagedSequence], rows: int, group: int, device: torch.device
) -> AttentionMetadata:
    """The torch path's decode group for sequences of one context length (as the runner
    builds it: tables back to back, query i of a sequence seeing keys up to context + i)."""
    tables = torch.tensor([b for s in sequences for b in s.block_table], dtype=torch.int64)
    span = len(sequences[0].block_table) * BLOCK_SIZE
    last = sequences[0].context + torch.arange(rows)  # [rows]
    mask = (torch.arange(span)[None, :] <= last[:, None]).repeat(group, 1)  # [group*rows, span]
    mask = mask.expand(len(sequences), 1, *mask.shape)
    group_meta = DecodeGroup(0, len(sequences), rows, tables, mask)
    slots = torch.zeros(0, dtype=torch.int64)
    return AttentionMetadata(slots, [group_meta], []).to(device)


def time_write_and_prefill(name: str, heads: int, kv_heads: int, peak: float, device, quick):
    group = heads // kv_heads
    tokens = 64 if quick else 2048
    timings = []
    for count, label in ((128 if not quick else 4, "decode step"), (tokens, "prefill chunk")):
        sequences, key_cache, value_cache = make_batch(1, count, 0, kv_heads, device)
        key = torch.randn(count, kv_heads, HEAD_DIM, dtype=key_cache.dtype, device=device)
        value = torch.randn_like(key)
        slots = torch.randperm(key_cache.shape[0] * BLOCK_SIZE, device=device)[:count]
        args = (key, value, key_cache, value_cache, slots)
        tri.write_kv(*args)
        check(key_cache.view(-1, kv_heads, HEAD_DIM)[slots], key, f"write_kv {name}")
        seconds = bench(lambda args=args: tri.write_kv(*args), device)
        moved = 4 * key.numel() * key.element_size() + slots.numel() * 8  # read and write K, V
        batch = f"{count} tokens ({label})"
        timings.append(Timing.of("triton write_kv", name, batch, 1, seconds, moved, peak))
    # A chunk of `tokens` rows over as many cached tokens: FLOPs, not bytes, bound it.
    sequences, key_cache, value_cache = make_batch(1, tokens, tokens, kv_heads, device)
    layout = PagedLayout.build(sequences, num_kv_heads=kv_heads, group=group).to(device)
    query = torch.randn(tokens, heads, HEAD_DIM, dtype=key_cache.dtype, device=device)
    out = torch.empty_like(query)
    tri.prefill(query, key_cache, value_cache, layout, SCALE, out)
    want = torch.empty_like(query, dtype=torch.float32)
    ref.prefill(query.float(), key_cache.float(), value_cache.float(), layout, SCALE, want)
    check(out, want, f"triton prefill {name}")
    seconds = bench(lambda: tri.prefill(query, key_cache, value_cache, layout, SCALE, out), device)
    keys_seen = tokens * tokens + tokens * (tokens + 1) // 2
    flops = 4 * keys_seen * heads * HEAD_DIM
    note = f"{flops / seconds / 1e12:.1f} TFLOP/s"
    moved = 2 * 2 * tokens * kv_heads * HEAD_DIM * key_cache.element_size()
    batch = f"{tokens} rows over {tokens} cached"
    timings.append(Timing.of("triton prefill", name, batch, 1, seconds, moved, peak, note))
    return timings


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--peak-gbs", type=float, default=None, help="the device's peak GB/s")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (CPU interpreter)")
    parser.add_argument("--out", default="bench/results/attention_triton.json")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(0)
    peak, source = peak_bandwidth(device, args.peak_gbs)
    print(f"peak bandwidth {peak / 1e9:.0f} GB/s ({source})")
    timings: list[Timing] = []
    shapes = {"tiny": (6, 2)} if args.quick else SHAPES
    for name, (heads, kv_heads) in shapes.items():
        for batch in QUICK_BATCHES if args.quick else DECODE_BATCHES:
            timings += time_decode(name, heads, kv_heads, batch, peak, device)
        timings += time_write_and_prefill(name, heads, kv_heads, peak, device, args.quick)
    for t in timings:
        print(
            f"{t.kernel:16} {t.shape:13} {t.batch:34} splits {t.splits:2}  "
            f"{t.seconds * 1e6:9.1f} us  {t.over_floor:6.2f}x floor  {t.note}"
        )
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "peak_bandwidth_gbs": peak / 1e9,
        "peak_source": source,
        "timings": [asdict(t) for t in timings],
    }
    return write_report(report, args.out)


if __name__ == "__main__":
    main()
