"""Multi-LoRA throughput: many adapters in one batch vs the base model vs peft, in one process.

Workload: N requests x 128 prompt tokens x 128 output tokens (ignore_eos), each assigned an
adapter (rank 8-16 on all seven projections of every layer) by a uniform or zipf draw over
K distinct adapters. Baselines in the same run: the base model alone on the same requests,
and peft serving the adapters the way people do today (one adapter at a time, each group a
static batch through ``generate``), on a seeded subset. Also: one request alone on one
adapter (batch 1) against the base model, and cold load of an adapter from disk to usable
(validated, in the host cache and in a device slot), p50 over the adapters.
Usage: ``python -m bench.lora [--adapters 1,8,32,128] [--out results.json]``; on a GPU,
``--device cuda``, and ``--random-weights`` where only the model's config.json is at hand
(the speed of a forward pass does not depend on the weights' values).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from bench.report import write_report
from bench.workloads import fixed_lengths

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class LoraRun:
    name: str
    num_requests: int
    distinct_adapters: int
    output_tokens: int
    elapsed_s: float
    output_tok_per_s: float
    note: str = ""


def make_adapters(model_path: Path, root: Path, count: int, seed: int = 0) -> list[Path]:
    """``count`` PEFT adapters (adapter_config.json + safetensors) with random A and B.

    One adapter is made with peft itself; the others reuse its file layout with fresh
    random weights and ranks 8 or 16 (peft would take minutes to build 128 of them).
    """
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    template = root / "template"
    if not (template / "adapter_config.json").exists():
        base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        peft_model = get_peft_model(
            base, LoraConfig(r=16, lora_alpha=32, target_modules=PROJECTIONS)
        )
        peft_model.save_pretrained(template, safe_serialization=True)
    config = json.loads((template / "adapter_config.json").read_text())
    from safetensors import safe_open

    with safe_open(template / "adapter_model.safetensors", framework="pt") as f:
        shapes = {name: f.get_slice(name).get_shape() for name in f.keys()}  # noqa: SIM118
    rng = torch.Generator().manual_seed(seed)
    paths = []
    for i in range(count):
        path = root / f"adapter-{i:03d}"
        rank = 8 if i % 2 else 16
        if not (path / "adapter_model.safetensors").exists():
            path.mkdir(parents=True, exist_ok=True)
            tensors = {}
            for name, (rows, cols) in shapes.items():
                shape = (rank, cols) if "lora_A" in name else (rows, rank)
                tensors[name] = (torch.randn(shape, generator=rng) * 0.02).to(torch.bfloat16)
            save_file(tensors, path / "adapter_model.safetensors")
            (path / "adapter_config.json").write_text(
                json.dumps({**config, "r": rank, "lora_alpha": 2 * rank})
            )
        paths.append(path)
    return paths


def random_weights_like(model_path: Path, out: Path) -> Path:
    """A checkpoint of ``model_path``'s config with random weights, saved as safetensors."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if not (out / "config.json").exists():
        config = AutoConfig.from_pretrained(model_path)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(out, safe_serialization=True)
    return out


def assign(num_requests: int, distinct: int, popularity: str, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    if popularity == "uniform":
        picks = np.arange(num_requests) % distinct  # every adapter used, evenly
        rng.shuffle(picks)
        return picks.tolist()
    weights = 1.0 / np.arange(1, distinct + 1) ** 1.0  # zipf, s = 1
    return rng.choice(distinct, num_requests, p=weights / weights.sum()).tolist()


def run_engine(
    engine, requests, adapters: list[str | list[tuple[str, float]] | None], name: str
) -> LoraRun:
    """Each request on its adapter: a name, a weighted mix [(name, weight), ...], or None."""
    from worker import SamplingParams

    start = time.monotonic()
    for i, (r, adapter) in enumerate(zip(requests, adapters, strict=True)):
        params = SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True)
        mix = adapter if isinstance(adapter, list) else None
        single = None if mix is not None else adapter
        engine.add_request(f"{name}-{i}", r.prompt_token_ids, params, adapter=single, mix=mix)
    tokens = 0
    while engine.has_unfinished_requests:
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    elapsed = time.monotonic() - start
    names = [n for a in adapters for n in ([x for x, _ in a] if isinstance(a, list) else [a])]
    distinct = len({n for n in names if n is not None})
    return LoraRun(name, len(requests), distinct, tokens, elapsed, tokens / elapsed)


def median(runs: list[LoraRun]) -> LoraRun:
    return sorted(runs, key=lambda r: r.output_tok_per_s)[len(runs) // 2]


def alternate(engine, requests, adapters, name: str, repeats: int) -> tuple[LoraRun, LoraRun]:
    """The base model and the adapters on the same requests, alternated ``repeats`` times;
    the median run of each. A burst of load on these shared machines moved single runs of
    the base model by +-15%; alternating puts both sides under the same conditions."""
    runs = compare_sides(
        engine, requests, {f"base for {name}": [None] * len(requests), name: adapters}, repeats,
        warm=False,
    )  # fmt: skip
    return median(runs[f"base for {name}"]), median(runs[name])


def compare_sides(
    engine, requests, sides: dict[str, list], repeats: int, *, warm: bool = True
) -> dict[str, list[LoraRun]]:
    """Each side's runs: the same requests on each side's adapters (as ``run_engine`` takes
    them), the sides alternated ``repeats`` times, after one short untimed run of each that
    fills every slot (``warm``) and takes first-call costs out of the way."""
    if warm:
        first = requests[: min(4, len(requests))]
        for name, adapters in sides.items():
            run_engine(engine, first, adapters[: len(first)], f"warmup {name}")
    runs: dict[str, list[LoraRun]] = {name: [] for name in sides}
    for _ in range(repeats):
        for name, adapters in sides.items():
            runs[name].append(run_engine(engine, requests, adapters, name))
    return runs


def side_by_side_arguments(parser: argparse.ArgumentParser, *, adapters: int, name: str) -> None:
    """The options ``bench.dora`` and ``bench.mix`` share."""
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto", help="auto: as the engine chooses")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda[:N]")
    parser.add_argument("--adapters", type=int, default=adapters)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", default=f"/tmp/switchboard-bench-{name}")
    parser.add_argument("--out", default=f"bench/results/{name}.json")


def run_peft(
    model_path: Path,
    paths: list[Path],
    requests,
    picks: list[int],
    subset: int,
    dtype: torch.dtype,
    device: torch.device,
) -> LoraRun:
    """peft as commonly deployed: group requests by adapter, one static batch per group."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, GenerationConfig

    rng = np.random.default_rng(2)
    chosen = sorted(rng.choice(len(requests), min(subset, len(requests)), replace=False).tolist())
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
    groups: dict[int, list[int]] = {}
    for i in chosen:
        groups.setdefault(picks[i], []).append(i)
    names = {k: f"a{k}" for k in groups}
    first = next(iter(groups))
    model = PeftModel.from_pretrained(base, paths[first], adapter_name=names[first])
    for k in groups:
        if k != first:
            model.load_adapter(paths[k], adapter_name=names[k])
    model.to(device).eval()
    start = time.monotonic()
    tokens = 0
    for k, rows in groups.items():
        model.set_adapter(names[k])
        ids = torch.tensor([requests[i].prompt_token_ids for i in rows], device=device)
        new = requests[rows[0]].output_len
        config = GenerationConfig(
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        with torch.inference_mode():
            model.generate(input_ids=ids, generation_config=config)
        tokens += new * len(rows)
    elapsed = time.monotonic() - start
    note = f"seeded subset of {len(chosen)} requests in {len(groups)} adapter groups"
    return LoraRun(
        "peft one-adapter-at-a-time",
        len(chosen),
        len(groups),
        tokens,
        elapsed,
        tokens / elapsed,
        note,
    )


def cold_load_p50(engine, paths: list[Path]) -> float:
    """Disk -> validated -> host cache -> device slot, per adapter; the median in seconds."""
    times = []
    for i, path in enumerate(paths):
        start = time.monotonic()
        adapter_id = engine.load_adapter(f"cold-{i}", path)
        engine.lora_manager.prepare([adapter_id], all_decode=True)
        times.append(time.monotonic() - start)
    return float(np.median(times))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto", help="auto: as the engine chooses")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda[:N]")
    parser.add_argument(
        "--random-weights",
        action="store_true",
        help="random weights in the model's shape (only its config.json is read)",
    )
    parser.add_argument("--adapters", default="1,8,32,128")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-loras", type=int, default=32)
    parser.add_argument("--peft-subset", type=int, default=8, help="0: no peft baseline")
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="runs of each case, alternating with the base model; the median counts",
    )
    parser.add_argument("--kv-cache-gb", type=float, default=1.0, help="the engine's KV cache")
    parser.add_argument("--workdir", default="/tmp/switchboard-bench-lora")
    parser.add_argument("--out", default="bench/results/lora.json")
    args = parser.parse_args(argv)

    from worker import LLMEngine, engine_config
    from worker.model.default_model import resolve_model_path

    model_path = resolve_model_path(args.model)
    if args.random_weights:
        model_path = random_weights_like(model_path, Path(args.workdir) / "random-weights")
    counts = [int(c) for c in args.adapters.split(",")]
    paths = make_adapters(model_path, Path(args.workdir), max(counts))
    engine = LLMEngine(
        model_path,
        engine_config(
            dtype=args.dtype,
            device=args.device,
            max_loras=args.max_loras,
            max_lora_rank=16,
            max_num_seqs=max(128, args.requests),
            kv_cache_memory_gb=args.kv_cache_gb,
        ),
    )
    for i, path in enumerate(paths):
        engine.load_adapter(f"adapter-{i}", path)
    dtype = str(engine.model.dtype).removeprefix("torch.")
    report: dict = {
        "model": str(model_path),
        "dtype": dtype,
        "device": str(engine.device),
        "attention_backend": engine.attention_backend,
        "max_loras": args.max_loras,
    }
    warm = fixed_lengths(4, prompt_len=16, output_len=8, vocab=engine.config.vocab_size, seed=9)
    second = f"adapter-{min(1, len(paths) - 1)}"
    run_engine(engine, warm, ["adapter-0", None, second, None], "warmup")
    runs = []
    for count in counts:
        num_requests = max(args.requests, count)
        requests = fixed_lengths(
            num_requests, prompt_len=128, output_len=128, vocab=engine.config.vocab_size
        )
        for popularity in ["uniform", "zipf"] if count > 1 else ["uniform"]:
            picks = assign(num_requests, count, popularity)
            names = [f"adapter-{k}" for k in picks]
            base, run = alternate(
                engine,
                requests,
                names,
                f"{count} adapters {popularity}",
                args.repeats,
            )
            run.note = f"{run.output_tok_per_s / base.output_tok_per_s:.1%} of base"
            runs += [base, run]
            print(json.dumps(asdict(run)))
        if count == 32 and args.peft_subset > 0:
            peft = run_peft(
                model_path,
                paths,
                requests,
                assign(num_requests, count, "uniform"),
                args.peft_subset,
                engine.model.dtype,  # the same precision as the engine's
                engine.device,
            )
            runs.append(peft)
            print(json.dumps(asdict(peft)))
    # One stream: every decode step is a single token on one adapter (interactive use).
    single = fixed_lengths(1, prompt_len=128, output_len=128, vocab=engine.config.vocab_size)
    base, run = alternate(engine, single, ["adapter-0"], "1 adapter, batch 1", args.repeats)
    run.note = f"{run.output_tok_per_s / base.output_tok_per_s:.1%} of base"
    runs += [base, run]
    print(json.dumps(asdict(run)))
    report["runs"] = [asdict(r) for r in runs]
    report["cold_load_p50_s"] = cold_load_p50(engine, paths[: min(16, len(paths))])
    print(f"cold load p50: {report['cold_load_p50_s'] * 1e3:.1f} ms")
    return write_report(report, args.out)


if __name__ == "__main__":
    main()
