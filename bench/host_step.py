"""The host's work in a decode step: what bounds tok/s once the device is fast.

On a GPU the default model's forward pass at batch 128 takes a few milliseconds, so the
Python around it (schedule, lay the inputs out, append, detokenize and check each token,
build the outputs) decides tok/s: at 128 sequences, a step of H ms of host work caps
throughput at 128 / H tokens per ms however fast the device is, and H is paid again on top
of the device time unless the two overlap. This measures H on the CPU, device-free: an
engine over a random one-layer, 64-wide model with the default model's vocabulary and
tokenizer (so the sampler and the detokenizer see real sizes), ``--batch`` requests of
128 prompt tokens decoding greedily with ``ignore_eos``, ``--steps`` decode steps timed
after a few untimed ones. Each section is timed around the engine's own calls; "forward"
(the model, here nearly free) and "sampling" (on a GPU, device work and one copy) are
reported apart from the host's work. The engine runs as on a GPU, with ``async_output``:
rendering the last step's tokens is the part of the host's work that overlaps the device's
pass there (``--no-async-output``: rendered in the step, as on CPU). The layout the Triton
kernels take (a GPU step's) is timed on the same schedule.

Usage: ``python -m bench.host_step [--batch 128] [--steps 64] [--repeats 3]
[--prompt-len 128] [--no-async-output] [--out bench/results/host_step.json]``.
"""

from __future__ import annotations

import argparse
import collections
import json
import shutil
import statistics
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from bench.report import write_report
from bench.workloads import fixed_lengths

PROMPT_LEN = 128  # --prompt-len: longer contexts mean longer block tables to lay out
WARM_STEPS = 4  # --output-len: tokens each request has generated before the timed steps
HANDOFF = "hand outputs to the server"
PREFILL_BUDGET = 32_768  # tokens a prefill step: more only costs memory
KV_BYTES_PER_TOKEN = 1024  # the one-layer model's 256 (fp32 K and V), with room to spare
# Sections of the step that are not the host's work (on a GPU: device time and one copy).
DEVICE_SECTIONS = ("forward", "sampling")
# The host's work that overlaps the device's pass under async_output.
OVERLAPPED = "render tokens (overlaps the device)"


def tiny_checkpoint(source: Path, out: Path) -> Path:
    """One layer, 64 wide, with ``source``'s vocabulary and tokenizer; written once."""
    if (out / "model.safetensors").is_file():
        return out
    config = json.loads((source / "config.json").read_text())
    hidden, inter, heads, kv_heads = 64, 128, 4, 2
    head_dim = hidden // heads
    config.update(
        hidden_size=hidden, intermediate_size=inter, num_hidden_layers=1,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        tie_word_embeddings=True,
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.5

    shapes = {
        "self_attn.q_proj": (heads * head_dim, hidden),
        "self_attn.k_proj": (kv_heads * head_dim, hidden),
        "self_attn.v_proj": (kv_heads * head_dim, hidden),
        "self_attn.o_proj": (hidden, heads * head_dim),
        "mlp.gate_proj": (inter, hidden),
        "mlp.up_proj": (inter, hidden),
        "mlp.down_proj": (hidden, inter),
    }
    weights = {f"model.layers.0.{name}.weight": rand(*shape) for name, shape in shapes.items()}
    weights["model.embed_tokens.weight"] = rand(config["vocab_size"], hidden)
    for norm in ("model.norm", "model.layers.0.input_layernorm"):
        weights[f"{norm}.weight"] = torch.ones(hidden)
    weights["model.layers.0.post_attention_layernorm.weight"] = torch.ones(hidden)
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, out / name)
    return out


class SectionClock:
    """Seconds spent in each wrapped call, by section name."""

    def __init__(self) -> None:
        self.seconds: collections.Counter[str] = collections.Counter()

    def wrap(self, owner: object, attribute: str, section: str) -> None:
        call = getattr(owner, attribute)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.seconds[section] += time.perf_counter() - start

        setattr(owner, attribute, timed)


def run(
    model: Path, batch: int, steps: int, async_output: bool, prompt_len: int, output_len: int
) -> dict:
    """One engine, ``batch`` requests, ``steps`` decode steps timed: ms per step by section."""
    from worker import SamplingParams
    from worker.core.config import EngineConfig
    from worker.engine.llm_engine import LLMEngine
    from worker.serving.async_engine import SampleOutput
    from worker.serving.servicer import response_from_sample

    warm_steps = max(WARM_STEPS, output_len)
    context = prompt_len + warm_steps + steps + 8
    # Prefill in chunks of PREFILL_BUDGET tokens; the first done decode meanwhile.
    budget = min(max(1024, batch * prompt_len), PREFILL_BUDGET)
    prefill_steps = -(-batch * prompt_len // budget)

    engine = LLMEngine(
        model,
        EngineConfig(
            max_num_seqs=batch, max_num_batched_tokens=budget,
            kv_cache_memory_gb=max(0.5, batch * context * KV_BYTES_PER_TOKEN / 2**30),
            async_output=async_output,
        ),
    )  # fmt: skip
    requests = fixed_lengths(
        batch, prompt_len=prompt_len, output_len=warm_steps + steps + 8 + prefill_steps,
        vocab=engine.config.vocab_size,
    )  # fmt: skip
    for i, r in enumerate(requests):
        params = SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True)
        engine.add_request(str(i), r.prompt_token_ids, params)
    while len(engine.step()) < batch:  # until every request decodes
        pass
    clock = SectionClock()
    clock.wrap(engine.scheduler, "schedule", "schedule")
    clock.wrap(engine.scheduler, "mark_computed", "mark computed")
    clock.wrap(engine.runner, "prepare", "lay out inputs")
    clock.wrap(engine.model, "forward", "forward")
    clock.wrap(engine.model, "compute_logits", "forward")
    clock.wrap(engine, "sampler", "sampling")
    if async_output:
        clock.wrap(engine.output_stage, "commit", "commit tokens")
        clock.wrap(engine.output_stage, "render_committed", OVERLAPPED)
    else:
        clock.wrap(engine.output_stage, "emit", "append, detokenize, outputs")
    for _ in range(warm_steps):
        engine.step()
    clock.seconds.clear()
    start = time.perf_counter()
    for _ in range(steps):
        outputs = engine.step()
        assert len(outputs) == batch, "every request decodes in every timed step"
        # What a worker does with them: to its event loop thread, then to gRPC messages.
        handoff = time.perf_counter()
        for out in outputs:
            response_from_sample(SampleOutput(0, out))
        clock.seconds[HANDOFF] += time.perf_counter() - handoff
    total = time.perf_counter() - start
    sections = {name: s / steps * 1e3 for name, s in clock.seconds.items()}
    sections["rest of step()"] = total / steps * 1e3 - sum(sections.values())
    host = sum(ms for name, ms in sections.items() if name not in DEVICE_SECTIONS)
    overlapped = sections.get(OVERLAPPED, 0.0)
    scheduled = engine.scheduler.schedule().scheduled
    layout = {}
    for triton in (False, True):
        engine.runner.triton_attention = triton
        start = time.perf_counter()
        for _ in range(steps):
            engine.runner.prepare(scheduled)
        layout["triton" if triton else "cpu"] = (time.perf_counter() - start) / steps * 1e3
    return {"step_ms": total / steps * 1e3, "host_ms": host, "overlapped_ms": overlapped,
            "sections_ms": sections, "lay_out_inputs_ms": layout}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", type=Path, default=None, help="default: the default model's")
    parser.add_argument("--prompt-len", type=int, default=PROMPT_LEN)
    parser.add_argument("--output-len", type=int, default=WARM_STEPS)
    parser.add_argument("--no-async-output", dest="async_output", action="store_false")
    parser.add_argument("--out", default="bench/results/host_step.json")
    args = parser.parse_args()
    from worker.model.default_model import prepare_default_model

    source = args.model or prepare_default_model()
    model = tiny_checkpoint(source, Path(args.out).parent / "host_step_model")
    runs = [
        run(model, args.batch, args.steps, args.async_output, args.prompt_len, args.output_len)
        for _ in range(args.repeats)
    ]
    best = min(runs, key=lambda r: r["host_ms"])
    print(f"batch {args.batch}: host work per decode step (best of {args.repeats} runs)")
    for name, ms in best["sections_ms"].items():
        tag = " (device work on a GPU)" if name in DEVICE_SECTIONS else ""
        print(f"  {name:36s} {ms:7.3f} ms  {ms * 1e3 / args.batch:6.2f} us/sequence{tag}")
    host = [r["host_ms"] for r in runs]
    ceiling = args.batch / best["host_ms"] * 1e3
    print(f"  host work: {best['host_ms']:.3f} ms (median {statistics.median(host):.3f});"
          f" caps decode at {ceiling:,.0f} tok/s with a free device")  # fmt: skip
    if args.async_output:
        hidden = best["overlapped_ms"]
        print(f"  of which {hidden:.3f} ms overlaps the device's pass (async_output):"
              f" {best['host_ms'] - hidden:.3f} ms adds to each step")  # fmt: skip
    layout = best["lay_out_inputs_ms"]
    print(f"  inputs laid out for the Triton kernels: {layout['triton']:.3f} ms"
          f" (CPU kernels: {layout['cpu']:.3f} ms)")  # fmt: skip
    report = {"batch": args.batch, "steps": args.steps, "prompt_len": args.prompt_len,
              "output_len": args.output_len, "async_output": args.async_output}  # fmt: skip
    write_report(report | {"runs": runs}, args.out)


if __name__ == "__main__":
    main()
