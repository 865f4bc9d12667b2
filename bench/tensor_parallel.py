"""Tensor parallelism's cost on this machine: two ranks of one thread against one rank of two.

Decode tokens/s at a few batch sizes (prompts of 32 tokens, then ``--steps`` decode steps
timed), alternating the two engines ``--repeats`` times in one process (medians), so noise
hits both. Both engines stay loaded; each run sets the threads its ranks use (rank 0 is this
process). The model is the default one where two ranks can split it; SmolLM2-135M's 9
attention heads and 3 KV heads cannot be, so by default the benchmark writes a random
checkpoint of its shapes with 8 heads and 2 KV heads (hidden size, layers, MLP and
vocabulary unchanged) and says so. A second, draft-sized model (the first 4 layers of it,
as ``switchboard draft distill`` sizes drafts) shows what the collectives cost where a
step's own work is small: why a draft model runs on rank 0 alone. First, what one gloo
all-reduce of one token's hidden state costs between two processes here.

Usage: ``python -m bench.tensor_parallel [--batch-sizes 1,8,32] [--steps 32] [--repeats 3]
[--model DIR] [--out bench/results/tensor_parallel.json]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from bench.report import write_report

PROMPT_LEN = 32
DRAFT_LAYERS = 4


def shaped_checkpoint(source: Path, out: Path, *, num_layers: int | None = None) -> Path:
    """Random weights of ``source``'s shapes with 8 heads and 2 KV heads (so that two ranks
    split it), and ``num_layers`` layers if given; written once to ``out``."""
    if (out / "model.safetensors").is_file():
        return out
    config = json.loads((source / "config.json").read_text())
    hidden = config["hidden_size"]
    config.update(num_attention_heads=8, num_key_value_heads=2, head_dim=hidden // 8)
    if num_layers is not None:
        config["num_hidden_layers"] = num_layers
    head_dim, inter = hidden // 8, config["intermediate_size"]
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    weights = {"model.embed_tokens.weight": rand(config["vocab_size"], hidden)}
    weights["model.norm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    if not config.get("tie_word_embeddings", False):
        weights["lm_head.weight"] = rand(config["vocab_size"], hidden)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes = {
            "self_attn.q_proj": (8 * head_dim, hidden),
            "self_attn.k_proj": (2 * head_dim, hidden),
            "self_attn.v_proj": (2 * head_dim, hidden),
            "self_attn.o_proj": (hidden, 8 * head_dim),
            "mlp.gate_proj": (inter, hidden),
            "mlp.up_proj": (inter, hidden),
            "mlp.down_proj": (hidden, inter),
        }
        weights |= {p + name + ".weight": rand(*shape) for name, shape in shapes.items()}
        for norm in ("input_layernorm", "post_attention_layernorm"):
            weights[p + norm + ".weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def all_reduce_rounds(rank: int, port: int, hidden: int, rounds: int) -> float:
    """Seconds per gloo all-reduce of [1, hidden] bf16 between two processes, one thread
    each (``rank`` 0 opens the store on ``port``; 0: any free one, told to rank 1)."""
    torch.set_num_threads(1)
    store = dist.TCPStore(
        "127.0.0.1", port, 2, is_master=rank == 0, timeout=datetime.timedelta(seconds=60),
        wait_for_workers=False,
    )  # fmt: skip
    peer = None
    if rank == 0:
        command = [sys.executable, "-m", "bench.tensor_parallel", "--collective-peer"]
        peer = subprocess.Popen([*command, f"{store.port},{hidden},{rounds}"])
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    x = torch.zeros(1, hidden, dtype=torch.bfloat16)
    for _ in range(rounds // 10):
        dist.all_reduce(x)
    start = time.perf_counter()
    for _ in range(rounds):
        dist.all_reduce(x)
    elapsed = time.perf_counter() - start
    dist.destroy_process_group()
    if peer is not None:
        peer.wait()
    return elapsed / rounds


def decode_rate(llm, batch: int, steps: int) -> float:
    """Output tokens/s over ``steps`` decode steps of ``batch`` requests (prefills untimed)."""
    from worker import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)
    g = torch.Generator().manual_seed(batch)
    ids = [f"tp-{batch}-{i}-{time.monotonic_ns()}" for i in range(batch)]
    for request_id in ids:
        prompt = torch.randint(10, 1000, (PROMPT_LEN,), generator=g).tolist()
        engine.add_request(request_id, prompt, params)
    started: set[str] = set()
    while len(started) < batch:  # prefills, and each request's first token
        started |= {out.request_id for out in engine.step() if out.token_ids}
    tokens = 0
    start = time.perf_counter()
    for _ in range(steps):
        tokens += sum(len(out.new_token_ids) for out in engine.step())
    elapsed = time.perf_counter() - start
    for request_id in ids:
        engine.abort(request_id)
    return tokens / elapsed


def compare(
    model: Path, *, batch_sizes: list[int], steps: int, repeats: int, rank_alone: bool = False
) -> list[dict]:
    """Each batch size's decode tok/s, one rank of all cores vs two ranks of half each;
    ``rank_alone``: also one rank of a rank's threads (what a whole draft gets on rank 0)."""
    from worker import LLM

    cores = len(os.sched_getaffinity(0))
    options = dict(kv_cache_memory_gb=0.25, max_loras=0)
    one = LLM(model, **options)
    two = LLM(model, **options, tensor_parallel_size=2)
    rank_threads = torch.get_num_threads()  # the group set it: cores // 2
    runs = [("one", one, cores), ("two", two, rank_threads)]
    if rank_alone:
        runs.append(("alone", one, rank_threads))
    rates: dict[tuple[str, int], list[float]] = {}
    try:
        for batch in batch_sizes:  # warm-up: kernels built, caches touched
            for _, llm, threads in runs:
                torch.set_num_threads(threads)
                decode_rate(llm, batch, 4)
        for _ in range(repeats):
            for batch in batch_sizes:
                for name, llm, threads in runs:
                    torch.set_num_threads(threads)
                    rates.setdefault((name, batch), []).append(decode_rate(llm, batch, steps))
    finally:
        two.shutdown()
        torch.set_num_threads(cores)
    rows = []
    for batch in batch_sizes:
        one_rate = statistics.median(rates[("one", batch)])
        two_rate = statistics.median(rates[("two", batch)])
        rows.append(
            {
                "batch": batch,
                "one_rank_tok_s": round(one_rate, 1),
                "two_ranks_tok_s": round(two_rate, 1),
                "two_over_one": round(two_rate / one_rate, 3),
                "one_rank_runs": [round(r, 1) for r in rates[("one", batch)]],
                "two_ranks_runs": [round(r, 1) for r in rates[("two", batch)]],
            }
        )
        print(
            f"batch {batch:3d}: 1 rank x {cores} threads {one_rate:7.1f} tok/s, "
            f"2 ranks x {rank_threads} thread(s) {two_rate:7.1f} tok/s: {two_rate / one_rate:.2f}x"
        )
        if rank_alone:
            alone = statistics.median(rates[("alone", batch)])
            rows[-1]["one_rank_of_rank_threads_tok_s"] = round(alone, 1)
            print(f"           1 rank x {rank_threads} thread(s) {alone:7.1f} tok/s")
    return rows


def main() -> None:
    from worker.errors import TensorParallelConfigError
    from worker.model.default_model import resolve_model_path
    from worker.model.model_config import ModelConfig
    from worker.model.sharding import check_divisible

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="checkpoint (default: the default model, or its shape)")
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed per run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--draft-batch-sizes", default="1", help="'' skips the draft-sized model")
    parser.add_argument("--out", default="bench/results/tensor_parallel.json")
    parser.add_argument("--collective-peer", help=argparse.SUPPRESS)  # PORT,HIDDEN,ROUNDS
    args = parser.parse_args()
    if args.collective_peer:
        port, hidden, rounds = (int(v) for v in args.collective_peer.split(","))
        all_reduce_rounds(1, port, hidden, rounds)
        return

    model = Path(args.model) if args.model else resolve_model_path(None)
    note = ""
    try:
        check_divisible(ModelConfig.from_pretrained(model), 2)
    except TensorParallelConfigError as exc:
        shaped = Path(args.out).parent / "tensor-parallel-model"
        note = f"{model.name}: {exc}; measured on random weights of its shapes with 8/2 heads"
        print(note)
        source, model = model, shaped_checkpoint(model, shaped)
    else:
        source = model
    print(f"model {model}")
    hidden = json.loads((model / "config.json").read_text())["hidden_size"]
    latency = all_reduce_rounds(0, 0, hidden, 1000)
    print(f"one gloo all-reduce of [1, {hidden}] bf16, two processes: {latency * 1e6:.0f} us")
    report = {
        "model": str(model),
        "note": note,
        "cores": len(os.sched_getaffinity(0)),
        "all_reduce_us": round(latency * 1e6, 1),
        "steps": args.steps,
        "repeats": args.repeats,
        "decode": compare(
            model,
            batch_sizes=[int(b) for b in args.batch_sizes.split(",")],
            steps=args.steps,
            repeats=args.repeats,
        ),
    }
    if args.draft_batch_sizes:
        draft = shaped_checkpoint(
            source, Path(args.out).parent / "tensor-parallel-draft", num_layers=DRAFT_LAYERS
        )
        print(f"draft-sized model ({DRAFT_LAYERS} layers) {draft}")
        report["draft_sized"] = compare(
            draft,
            batch_sizes=[int(b) for b in args.draft_batch_sizes.split(",")],
            steps=args.steps,
            repeats=args.repeats,
            rank_alone=True,
        )
    write_report(report, args.out)


if __name__ == "__main__":
    main()
