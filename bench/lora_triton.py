"""On a CUDA GPU: the Triton multi-LoRA kernels against torch, and against the projection
they ride on.

Per shape, rank, token count and number of adapters in the batch, ``y += scale * x @ A.T @
B.T`` with each token's own adapter, bf16 activations and stacks:

- ``triton``: ``switchboard_kernels.lora.add_lora`` as the engine calls it (for a decode batch
  the fused shrink + expand kernel, ``switchboard_kernels/lora_fused_triton.py``; SGMV over runs
  of one adapter otherwise);
- ``torch``: what a plain-torch server does: for decodes, gather each token's A and B and
  two batched matmuls; for prefill, a matmul pair per run of one adapter;
- ``base``: ``F.linear(x, W)``, the projection itself (cuBLAS), for scale: LoRA's cost is
  reported as a multiple of it;
- on decode batches, the split BGMV pair (two launches, the choice before the fused
  kernel) at several program sizes (``BgmvBlocks``), the fused kernel with other output
  shares per token (``FusedBlocks``), and SGMV over the batch's runs of one adapter: what
  ``switchboard_kernels.lora.FUSED_DECODE`` and the block sizes are chosen from.

Each method is checked against the fp32 reference of ``switchboard_kernels/lora_reference.py``
before it is timed (``triton.testing.do_bench``, median). Decode batches draw each token's
adapter at random; prefill batches are runs of equal length, one per adapter.
Usage: ``python -m bench.lora_triton [--out FILE]`` (needs CUDA).
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from bench.report import write_report
from switchboard_kernels import lora_fused_triton as fused
from switchboard_kernels import lora_reference as ref
from switchboard_kernels import lora_triton as tri
from switchboard_kernels.lora import LoraMapping, add_lora
from switchboard_kernels.lora_triton import GPU_BGMV, INTERPRETER_BGMV, MIN_DOT, BgmvBlocks

# (in, out): the default model's up and down projections, then a 7B model's q and up.
SHAPES = ((576, 1536), (1536, 576), (4096, 4096), (4096, 11008))
RANKS = (16, 64)
DECODE_TOKENS = (1, 32, 128)
PREFILL_TOKENS = (512, 2048)
ADAPTERS = (1, 32)


@dataclass
class KernelRun:
    in_features: int
    out_features: int
    rank: int
    tokens: int
    adapters: int
    phase: str  # decode (BGMV) or prefill (SGMV)
    micros: dict[str, float]  # per method: median microseconds per call
    max_errors: dict[str, float]  # per method: largest error over the reference's largest delta

    def over_base(self, method: str) -> float:
        return self.micros[method] / self.micros["base"]


def token_slots(tokens: int, adapters: int, phase: str, gen: torch.Generator) -> torch.Tensor:
    if phase == "decode":
        return torch.randint(0, adapters, (tokens,), generator=gen)
    per_run = max(1, tokens // adapters)
    return torch.arange(tokens) // per_run % adapters


def torch_lora(y, x, a_stack, b_stack, scales, slots_cpu: torch.Tensor, phase: str) -> None:
    """The plain-torch way, in the model's dtype."""
    if phase == "decode":
        slots = slots_cpu.to(x.device)
        h = torch.bmm(x[:, None, :], a_stack[slots].transpose(1, 2))  # [T, 1, R]
        delta = torch.bmm(h, b_stack[slots].transpose(1, 2))[:, 0]  # [T, out]
        y += delta * scales[slots][:, None].to(y.dtype)
        return
    run_slots, run_lens = torch.unique_consecutive(slots_cpu, return_counts=True)
    start = 0
    for slot, length in zip(run_slots.tolist(), run_lens.tolist(), strict=True):
        rows = slice(start, start + length)
        y[rows] += (x[rows] @ a_stack[slot].T @ b_stack[slot].T) * scales[slot].item()
        start += length


def reference_delta(x, a_stack, b_stack, scales, slots: torch.Tensor) -> torch.Tensor:
    y = torch.zeros(x.shape[0], b_stack.shape[1], dtype=torch.float32, device=x.device)
    h = ref.bgmv_shrink(x.float(), a_stack.float(), slots)
    ref.bgmv_expand(y, h, b_stack.float(), slots, scales)
    return y


def bgmv_variants() -> dict[str, BgmvBlocks]:
    """BGMV's program sizes to compare on decode batches: the default first."""
    return {
        "bgmv split": GPU_BGMV,
        "bgmv split m4 t2048 (interpreter's)": INTERPRETER_BGMV,
        "bgmv m1 t4096": BgmvBlocks(1, 4096, MIN_DOT),
        "bgmv m1 t8192": BgmvBlocks(1, 8192, MIN_DOT),
        "bgmv m1 t16384 whole rank": BgmvBlocks(1, 16384, None),
        "bgmv m2 t8192": BgmvBlocks(2, 8192, MIN_DOT),
    }


def fused_variants(device: torch.device) -> dict[str, fused.FusedBlocks]:
    """The fused kernel's output shares per token to compare (``triton`` uses the default)."""
    default = fused.FusedBlocks.for_device(device)
    return {
        f"fused {programs} programs": fused.FusedBlocks(1, default.tile, programs)
        for programs in sorted(
            {1, max(1, default.target_programs // 4), default.target_programs * 4}
        )
    }


def measure(
    in_f: int, out_f: int, rank: int, tokens: int, adapters: int, phase: str, dev: str = "cuda"
) -> KernelRun:
    from triton.testing import do_bench

    gen = torch.Generator().manual_seed(tokens * 7 + adapters)
    dt = torch.bfloat16 if dev == "cuda" else torch.float32  # the interpreter's bf16 is off
    x = (torch.randn(tokens, in_f, generator=gen)).to(dev, dt)
    weight = (torch.randn(out_f, in_f, generator=gen) / in_f**0.5).to(dev, dt)
    a_stack = (torch.randn(adapters, rank, in_f, generator=gen) / in_f**0.5).to(dev, dt)
    b_stack = (torch.randn(adapters, out_f, rank, generator=gen) / rank**0.5).to(dev, dt)
    scales = torch.full((adapters,), 2.0, device=dev)
    slots_cpu = token_slots(tokens, adapters, phase, gen)
    slots = slots_cpu.to(dev)
    mapping = LoraMapping.build(slots_cpu, device=dev, all_decode=phase == "decode")
    expected = reference_delta(x, a_stack, b_stack, scales, slots)
    peak = expected.abs().max().item()

    def add_bgmv(blocks: BgmvBlocks):
        def run(y):
            h = tri.bgmv_shrink(x, a_stack, slots, blocks=blocks)
            tri.bgmv_expand(y, h, b_stack, slots, scales, blocks=blocks)

        return run

    methods = {
        "triton": lambda y: add_lora(y, x, a_stack, b_stack, scales, mapping),
        "torch": lambda y: torch_lora(y, x, a_stack, b_stack, scales, slots_cpu, phase),
    }
    if phase == "decode":
        variants = bgmv_variants()
        methods |= {name: add_bgmv(blocks) for name, blocks in variants.items()}
        for name, blocks in fused_variants(x.device).items():
            methods[name] = lambda y, blocks=blocks: fused.bgmv_fused(
                y, x, a_stack, b_stack, slots, scales, blocks=blocks
            )
        sgmv = LoraMapping.build(slots_cpu, device=dev, all_decode=False)
        methods["sgmv over runs"] = lambda y: add_lora(y, x, a_stack, b_stack, scales, sgmv)
    errors = {}
    for name, fn in methods.items():
        y = torch.zeros(tokens, out_f, dtype=dt, device=dev)
        fn(y)
        errors[name] = (y.float() - expected).abs().max().item() / peak
    out = torch.zeros(tokens, out_f, dtype=dt, device=dev)

    def micros_per_call(fn) -> float:
        return do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e3

    micros = {"base": micros_per_call(lambda: F.linear(x, weight))}
    for name, fn in methods.items():
        micros[name] = micros_per_call(lambda fn=fn: fn(out))
    return KernelRun(in_f, out_f, rank, tokens, adapters, phase, micros, errors)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="bench/results/lora_triton.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.lora_triton needs a CUDA device")
    runs = []
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}")
    print("in->out rank tokens adapters phase | microseconds per call (x base), max error")
    for in_f, out_f in SHAPES:
        for rank in RANKS:
            for phase, counts in (("decode", DECODE_TOKENS), ("prefill", PREFILL_TOKENS)):
                for tokens in counts:
                    for adapters in ADAPTERS:
                        run = measure(in_f, out_f, rank, tokens, adapters, phase)
                        runs.append(run)
                        cells = [
                            f"{name} {us:.1f} ({run.over_base(name):.2f}x) "
                            f"{run.max_errors.get(name, 0.0):.0e}"
                            for name, us in run.micros.items()
                        ]
                        print(
                            f"{in_f}->{out_f} r{rank} T{tokens} a{adapters} {phase} | "
                            + " | ".join(cells),
                            flush=True,
                        )
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "runs": [asdict(r) for r in runs],
    }
    return write_report(report, args.out)


if __name__ == "__main__":
    main()
