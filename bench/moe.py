"""A small Mixtral-style MoE against a dense Llama of the same active parameter count.

Both random, built by transformers in a temporary directory: the same attention, vocabulary and
layers; the MoE has ``--experts`` experts of ``--expert-intermediate`` features and routes each
token to ``--top-k`` of them, the dense model one MLP of ``top_k x expert_intermediate``
features, so a token multiplies by as many weights in both. Decode output tokens/s of the
offline engine at batch 1 and at ``--batch`` (alternated, ``--repeats`` times, medians), and
the weight bytes a batch-1 decode token reads (``LlamaModel.decode_weight_bytes``) beside the
whole checkpoint's. The MoE runs twice in each round: its experts through the native grouped
kernel where it serves the step (``switchboard_kernels.moe_native``) and its bf16 router through the
native panels ("moe"), and as before them ("moe_torch": the per-expert torch path and F.linear's
router, switched on the same engine). Last,
the MLP blocks alone (all layers, one row) of the three, alternated ``--block-rounds`` times.

    python -m bench.moe [--dtype bfloat16] [--batch 16] [--threads N] [--out bench/results/moe.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

SHAPE = {
    "vocab_size": 8192,
    "hidden_size": 768,
    "num_hidden_layers": 6,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "max_position_embeddings": 4096,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}


def build(root: Path, *, experts: int, top_k: int, expert_intermediate: int) -> dict[str, Path]:
    import transformers

    torch.manual_seed(0)
    moe = transformers.MixtralConfig(
        **SHAPE,
        intermediate_size=expert_intermediate,
        num_local_experts=experts,
        num_experts_per_tok=top_k,
    )
    dense = transformers.LlamaConfig(**SHAPE, intermediate_size=top_k * expert_intermediate)
    paths = {}
    for name, config, cls in (
        ("moe", moe, transformers.MixtralForCausalLM),
        ("dense", dense, transformers.LlamaForCausalLM),
    ):
        model = cls(config)
        with torch.no_grad():  # a decisive router: the routing varies across tokens
            for key, param in model.named_parameters():
                if key.endswith("gate.weight"):
                    param.normal_(0.0, 0.5)
        paths[name] = root / name
        model.save_pretrained(paths[name], safe_serialization=True)
    return paths


def decode_rate(
    llm, *, batch: int, prompt_len: int, output_len: int, seed: int
) -> tuple[float, float]:
    """Output tokens/s of ``batch`` requests generated together (prefill included), and the
    process's CPU milliseconds per output token (with ``--threads 1`` on a shared machine, the
    work itself: time spent waiting for a core is not counted)."""
    from worker import SamplingParams

    g = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(3, SHAPE["vocab_size"], (prompt_len,), generator=g).tolist()
        for _ in range(batch)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start, cpu = time.perf_counter(), time.process_time()
    outputs = llm.generate(prompts, params)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    tokens = sum(len(o.token_ids) for o in outputs)
    return tokens / elapsed, 1e3 * cpu / tokens


def use(sparse, kernels) -> None:
    """Each sparse layer's (grouped kernel, router panels): theirs, or (None, None)."""
    for moe, (native, router) in zip(sparse, kernels, strict=True):
        moe.native, moe.router_panels = native, router


def block_times(llms, kernels, *, rounds: int) -> dict[str, dict[str, float]]:
    """Milliseconds of one batch-1 token's MLP blocks, every layer, outside the engine: the
    MoE's with and without the native kernel, the dense model's (gate_up, SwiGLU, down),
    alternated ``rounds`` times; the median and the fastest round (a shared machine's noise
    only slows a round down)."""
    import torch.nn.functional as F

    from switchboard_kernels.activation_native import silu_mul
    from worker.model.moe import moe_mlp

    sparse = [y.moe for y in llms["moe"].engine.model.layers if y.moe is not None]
    dense = [(y.gate_up, y.down) for y in llms["dense"].engine.model.layers]
    dtype = sparse[0].router.dtype
    x = torch.randn(1, SHAPE["hidden_size"], generator=torch.Generator().manual_seed(0))
    x = x.to(dtype)

    def moe(natives) -> float:
        use(sparse, natives)
        start = time.perf_counter()
        for layer in sparse:
            moe_mlp(x, layer, F.silu)
        return time.perf_counter() - start

    def mlp() -> float:
        start = time.perf_counter()
        for gate_up, down in dense:
            down(silu_mul(gate_up(x)))
        return time.perf_counter() - start

    runs = {"moe": lambda: moe(kernels), "moe_torch": lambda: moe([(None, None)] * len(sparse))}
    runs["dense"] = mlp
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    with torch.inference_mode():
        for n in range(rounds + 5):  # 5 rounds of warm-up
            for name, run in runs.items():
                taken = run()
                if n >= 5:
                    seconds[name].append(taken)
    use(sparse, kernels)
    return {
        name: {"median_ms": 1e3 * statistics.median(v), "min_ms": 1e3 * min(v)}
        for name, v in seconds.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--expert-intermediate", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--block-rounds", type=int, default=200)
    # A machine shared with other work: 1 thread keeps OpenMP's teams from waiting on a
    # descheduled partner (2 threads there read 5-10x slower, every path alike)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default="bench/results/moe.json")
    args = parser.parse_args()

    from worker import LLM
    from worker.model.llama import LlamaModel

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    result: dict = {"args": vars(args), "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        paths = build(
            Path(tmp),
            experts=args.experts,
            top_k=args.top_k,
            expert_intermediate=args.expert_intermediate,
        )
        llms = {}
        for name, path in paths.items():
            model = LlamaModel.from_pretrained(path, dtype=dtype)
            total = sum(f.stat().st_size for f in path.glob("*.safetensors"))
            result["models"][name] = {
                "decode_weight_bytes": model.decode_weight_bytes,
                "checkpoint_bytes_fp32": total,
            }
            del model
            llms[name] = LLM(path, dtype=args.dtype)
            plan = llms[name].engine.model.linear_plan
            result["models"][name]["linear_plan"] = plan.describe() if plan else "fixed rule"
            decode_rate(llms[name], batch=2, prompt_len=8, output_len=4, seed=9)  # warm-up
        sparse = [y.moe for y in llms["moe"].engine.model.layers if y.moe is not None]
        kernels = [(moe.native, moe.router_panels) for moe in sparse]
        result["models"]["moe"]["native_experts"] = all(k is not None for k, _ in kernels)
        runs = {"dense": (llms["dense"], kernels), "moe": (llms["moe"], kernels)}
        runs["moe_torch"] = (llms["moe"], [(None, None)] * len(sparse))
        result["models"]["moe_torch"] = {}
        for batch in (1, args.batch):
            rates: dict[str, list[float]] = {name: [] for name in runs}
            cpu: dict[str, list[float]] = {name: [] for name in runs}
            for repeat in range(args.repeats):
                for name, (llm, natives) in runs.items():
                    use(sparse, natives)
                    rate, cpu_ms = decode_rate(
                        llm,
                        batch=batch,
                        prompt_len=args.prompt_len,
                        output_len=args.output_len,
                        seed=repeat,
                    )
                    rates[name].append(rate)
                    cpu[name].append(cpu_ms)
            for name, values in rates.items():
                result["models"][name][f"tok_s_batch_{batch}"] = statistics.median(values)
                cpu_ms = statistics.median(cpu[name])
                result["models"][name][f"cpu_ms_per_token_batch_{batch}"] = cpu_ms
            for name in ("moe", "moe_torch"):
                ratio = statistics.median(rates[name]) / statistics.median(rates["dense"])
                result[f"{name}_over_dense_batch_{batch}"] = ratio
        result["blocks_batch_1"] = block_times(llms, kernels, rounds=args.block_rounds)
    for name, figures in result["models"].items():
        print(name, json.dumps(figures))
    print("MLP blocks of a batch-1 token, ms:", json.dumps(result["blocks_batch_1"]))
    for key, value in result.items():
        if "_over_dense" in key:
            print(f"{key}: {value:.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
