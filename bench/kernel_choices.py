"""Every kernel choice the engine makes on this CPU, measured afresh.

Runs ``switchboard_kernels.linear_choice.measure_plan`` on the default model's layer shapes
(or a checkpoint's) in each dtype this CPU can serve: every available kernel (native panels,
oneDNN's packed matmul; ``F.linear`` only where neither is) timed on a step's projections at
each row bucket, then the plan the engine would take from those times; then
``worker.model.op_choice.measure_op_plans``: the other ops (RMSNorm, the activation, LoRA,
decode and prefill attention), native kernel against torch's, and their plans. Nothing is
read from or written to the plan cache. Usage: ``python -m bench.kernel_choices [--model DIR]
[--dtypes float32,bfloat16] [--max-rows 1024] [--max-seqs 256]
[--out bench/results/kernel_choices.json]``.
"""

from __future__ import annotations

import argparse

import torch

from bench.report import write_report
from switchboard_kernels.linear_choice import available_kernels, dual_allowed, measure_plan
from worker.core.config import EngineConfig
from worker.engine.assembly import op_shapes
from worker.model.llama import projection_shapes
from worker.model.model_config import ModelConfig
from worker.model.op_choice import measure_op_plans

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", help="checkpoint directory (default: the default model)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--max-rows", type=int, default=1024)
    parser.add_argument("--max-seqs", type=int, default=256)
    parser.add_argument("--out", default="bench/results/kernel_choices.json")
    args = parser.parse_args(argv)
    if args.model is None:
        from worker.model.default_model import resolve_model_path

        args.model = resolve_model_path(None)
    config = ModelConfig.from_pretrained(args.model)
    shapes = projection_shapes(config)
    report: dict = {"model": str(args.model), "shapes": shapes, "dtypes": {}}
    for name in args.dtypes.split(","):
        dtype = DTYPES[name]
        kernels = available_kernels(dtype)
        bytes_ = config.num_layers * sum(o * i for o, i in shapes) * dtype.itemsize
        result = measure_plan(
            shapes,
            dtype,
            num_layers=config.num_layers,
            max_rows=args.max_rows,
            dual=dual_allowed(bytes_) and len(kernels) > 1,
            decode_rows=args.max_seqs,  # the default model's decode steps run in one call
        )
        report["dtypes"][name] = {
            "kernels": kernels,
            "layers": result.layers,
            "ms": {k: {r: 1000 * s for r, s in t.items()} for k, t in result.seconds.items()},
            "plan": result.plan.describe(),
            "seconds": result.elapsed,
        }
        print(f"{name}: {result.layers} layers of {shapes}, measured in {result.elapsed:.1f} s")
        rows = sorted({r for t in result.seconds.values() for r in t})
        print("  ms a step".ljust(14) + "".join(f"{r:>10}" for r in rows))
        for kernel, times in result.seconds.items():
            print(f"  {kernel:12}" + "".join(f"{1000 * times[r]:>10.1f}" for r in rows))
        print(f"  plan: {result.plan.describe()}", flush=True)
        engine = EngineConfig(max_num_batched_tokens=args.max_rows, max_num_seqs=args.max_seqs)
        ops = measure_op_plans(op_shapes(config, engine), dtype)
        report["dtypes"][name]["ops"] = {
            op: {
                "ms": {k: {r: 1000 * s for r, s in t.items()} for k, t in seconds.items()},
                "plan": getattr(ops.plans, op).describe(),
            }
            for op, seconds in ops.seconds.items()
        }
        print(f"  other ops, ms a step, measured in {ops.elapsed:.1f} s:")
        for op, seconds in ops.seconds.items():
            rows = sorted({r for t in seconds.values() for r in t})
            print(f"  {op:18}" + "".join(f"{r:>9}" for r in rows))
            for kernel, times in seconds.items():
                print(f"    {kernel:16}" + "".join(f"{1000 * times[r]:>9.2f}" for r in rows))
            print(f"    plan: {getattr(ops.plans, op).describe()}", flush=True)
    return write_report(report, args.out)


if __name__ == "__main__":
    main()
