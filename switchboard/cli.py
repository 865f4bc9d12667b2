"""The `switchboard` command line: one handler function per subcommand, listed in COMMANDS.

Handlers import what they need themselves: this module imports neither torch nor transformers,
because the gateway shares it and must stay light. To add a subcommand, write a handler (and,
if it takes options, an `add_arguments` function) and append a `Command` to COMMANDS; the
`admin …` subcommands are listed in `switchboard.admin_commands`.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Sequence

from switchboard.admin_commands import ADMIN_COMMANDS
from switchboard.commands import Command

DEMO_QUESTIONS = (
    "What is the capital of France?",
    "Write a haiku about a busy switchboard operator.",
    "Explain in two sentences why the sky is blue.",
)


def model_prepare(args: argparse.Namespace) -> int:
    """Convert the default model if needed; print its directory (for `$(switchboard ...)`)."""
    from worker.default_model import prepare_default_model

    print(prepare_default_model(force=args.force))
    return 0


def _model_prepare_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--force", action="store_true", help="convert again even if cached")


def model_path(args: argparse.Namespace) -> int:
    """Print where the default model lives; exit 1 if it has not been prepared yet."""
    from switchboard.home import default_model_dir
    from worker.default_model import is_prepared

    path = default_model_dir()
    print(path)
    if is_prepared(path):
        return 0
    print("not prepared yet: run `switchboard model prepare`", file=sys.stderr)
    return 1


def demo(args: argparse.Namespace) -> int:
    """Answer a few chat prompts greedily with the engine and report throughput."""
    from worker import LLM, SamplingParams
    from worker.default_model import resolve_model_path

    llm = LLM(str(resolve_model_path(args.model)), dtype=args.dtype)
    questions = args.prompt or list(DEMO_QUESTIONS)
    prompts = [
        llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
        )
        for question in questions
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    for question, output in zip(questions, outputs, strict=True):
        print(f"> {question}\n{output.text.strip()}\n[{output.finish_reason}]\n")
    generated = sum(len(output.token_ids) for output in outputs)
    print(f"{generated} tokens in {elapsed:.2f} s: {generated / elapsed:.1f} tokens/s")
    return 0


def _demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="local checkpoint directory (default: the default model)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per answer")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument(
        "--prompt",
        action="append",
        help="a user message; repeat for several (default: three built-in questions)",
    )


def bench_throughput(args: argparse.Namespace) -> int:
    """Engine vs Hugging Face generate on the W1/W2 workloads (see bench/README.md)."""
    from bench.throughput import main as run_benchmark

    run_benchmark(args.extra_options)
    return 0


def bench_prefix(args: argparse.Namespace) -> int:
    """Prefix cache on vs off: multi-turn chats and a shared document (see bench/README.md)."""
    from bench.prefix import main as run_benchmark

    run_benchmark(args.extra_options)
    return 0


def bench_spec(args: argparse.Namespace) -> int:
    """Speculative decoding on vs off, batch 1 and 16 (see bench/README.md)."""
    from bench.spec import main as run_benchmark

    run_benchmark(args.extra_options)
    return 0


def draft_distill(args: argparse.Namespace) -> int:
    """Distill a small draft model from the target, for speculative decoding."""
    import logging
    from pathlib import Path

    from switchboard.logs import configure_logging
    from worker.default_model import resolve_model_path
    from worker.spec_decode.distill import default_draft_path, distill

    configure_logging(level=logging.INFO, json_lines=_json_logs())
    target = resolve_model_path(args.model)
    out = Path(args.out) if args.out else default_draft_path()
    result = distill(
        target,
        out,
        num_layers=args.num_layers,
        num_prompts=args.num_prompts,
        max_tokens=args.max_tokens,
        train_minutes=args.train_minutes,
    )
    print(
        f"draft saved to {result.path}: {result.generated_tokens} generated tokens, "
        f"{result.train_steps} steps, KL {result.first_loss:.3f} -> {result.final_loss:.3f}, "
        f"{result.elapsed_s / 60:.1f} min"
    )
    return 0


def _draft_distill_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="target checkpoint (default: the default model)")
    parser.add_argument("--out", help="where to save the draft (default: beside the model)")
    parser.add_argument("--num-layers", type=int, default=4, help="decoder layers kept")
    parser.add_argument("--num-prompts", type=int, default=160, help="answers to generate")
    parser.add_argument("--max-tokens", type=int, default=160, help="tokens per answer")
    parser.add_argument("--train-minutes", type=float, default=10.0, help="training budget")


def _bench_arguments(parser: argparse.ArgumentParser) -> None:
    # Every option goes on to the benchmark module, which documents them (--help there).
    parser.set_defaults(passes_options_through=True)


def _json_logs() -> bool:
    """`SWITCHBOARD_LOG_FORMAT`: json or text; by default JSON unless stderr is a terminal."""
    import os

    wanted = os.environ.get("SWITCHBOARD_LOG_FORMAT", "auto").lower()
    return wanted == "json" or (wanted == "auto" and not sys.stderr.isatty())


def worker(args: argparse.Namespace) -> int:
    """Serve one engine over gRPC until SIGTERM/SIGINT, then drain (see worker/server.py)."""
    import asyncio
    import logging
    from pathlib import Path

    from switchboard.logs import configure_logging
    from worker.main_thread import MainThreadEngineLoop
    from worker.server import serve

    configure_logging(level=logging.INFO, json_lines=_json_logs())
    engine_kwargs = worker_engine_kwargs(args)
    # The engine's step loop runs on this (the main) thread, the gRPC asyncio loop beside it.
    engine_loop = MainThreadEngineLoop()
    rpc = functools.partial(
        asyncio.run,
        serve(
            model=args.model,
            host=args.host,
            port=args.port,
            dtype=args.dtype,
            redis_url=args.redis_url,
            redis_prefix=args.redis_prefix,
            worker_id=args.worker_id,
            advertise_host=args.advertise_host,
            drain_timeout=args.drain_timeout,
            engine_kwargs=engine_kwargs,
            adapter_store=Path(args.adapter_store),
            metrics_port=None if args.metrics_port < 0 else args.metrics_port,
            engine_loop=engine_loop,
        ),
    )
    engine_loop.run(rpc)
    return 0


def worker_engine_kwargs(args: argparse.Namespace) -> dict:
    """The engine's keyword arguments from the worker's flags."""
    return {
        "device": args.device,
        "max_loras": args.max_loras,
        "max_lora_rank": args.max_lora_rank,
        "max_num_seqs": args.max_num_seqs,
        "kv_cache_memory_gb": args.kv_cache_memory_gb,
        "enable_prefix_caching": not args.no_prefix_caching,
        "share_base_model_prefixes": args.share_base_model_prefixes,
        "preemption_mode": args.preemption_mode,
        "swap_space_gb": args.swap_space_gb,
        "speculative_model": args.speculative_model,
        "num_speculative_tokens": args.num_speculative_tokens,
        "speculative_max_batch_size": args.speculative_max_batch_size,
        "speculative_min_acceptance": args.speculative_min_acceptance,
        "speculative_draft_cost": args.speculative_draft_cost,
    } | (
        {}
        if args.speculative_position_cost is None
        else {"speculative_position_cost": args.speculative_position_cost}
    )


def _worker_arguments(parser: argparse.ArgumentParser) -> None:
    import os

    from switchboard.home import default_adapter_store

    parser.add_argument("--model", default="default", help="checkpoint directory or 'default'")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=50051, help="gRPC port (0: any free one)")
    parser.add_argument(
        "--advertise-host", help="host the gateway dials (default: --host, or the hostname)"
    )
    parser.add_argument(
        "--redis-url",
        default=os.environ.get("SWITCHBOARD_REDIS_URL"),
        help="registry Redis (default: $SWITCHBOARD_REDIS_URL; unset: do not register)",
    )
    parser.add_argument("--redis-prefix", default=os.environ.get("SWITCHBOARD_KEY_PREFIX", "sb:"))
    parser.add_argument("--worker-id", help="registry id (default: HOSTNAME-PORT)")
    parser.add_argument(
        "--device",
        default="cpu",
        help="cpu, or cuda[:N]: weights, KV cache and adapter slots on that GPU (Triton LoRA)",
    )
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--max-loras", type=int, default=8, help="adapter slots (0: no LoRA)")
    parser.add_argument("--max-lora-rank", type=int, default=64, help="largest adapter rank")
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--kv-cache-memory-gb", type=float, default=1.0)
    parser.add_argument(
        "--no-prefix-caching", action="store_true", help="turn automatic prefix caching off"
    )
    parser.add_argument(
        "--share-base-model-prefixes",
        action="store_true",
        help="let tenants share cached base-model prefixes (default: isolated per tenant)",
    )
    parser.add_argument(
        "--preemption-mode",
        choices=("recompute", "swap"),
        default="recompute",
        help="what happens to a preempted request's KV cache",
    )
    parser.add_argument(
        "--swap-space-gb", type=float, default=1.0, help="host memory for swapped-out KV blocks"
    )
    _speculative_arguments(parser)
    parser.add_argument(
        "--drain-timeout", type=float, default=30.0, help="seconds in-flight requests may finish"
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=9400,
        help="Prometheus /metrics HTTP port on --host (0: any free one, -1: off)",
    )
    parser.add_argument(
        "--adapter-store",
        default=os.environ.get("SWITCHBOARD_ADAPTER_STORE") or str(default_adapter_store()),
        help="where the gateway stores adapters by content id (default: "
        "$SWITCHBOARD_ADAPTER_STORE, else $SWITCHBOARD_HOME/adapters)",
    )


def _speculative_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--speculative-model",
        help="speculative decoding: 'ngram' (prompt lookup) or a draft checkpoint directory "
        "sharing the model's vocabulary (default: off)",
    )
    parser.add_argument(
        "--num-speculative-tokens", type=int, help="draft tokens per step, k (default: 4)"
    )
    parser.add_argument(
        "--speculative-max-batch-size",
        type=int,
        default=8,
        help="no speculation in steps with more decoding requests than this",
    )
    parser.add_argument(
        "--speculative-min-acceptance",
        type=float,
        default=0.0,
        help="a request whose drafts are accepted less often (per position) pauses "
        "speculating, whatever the cost model says (default: off)",
    )
    parser.add_argument(
        "--speculative-position-cost",
        type=float,
        help="cost of verifying one more position, per decoding request, relative to a "
        "plain decode step: a draft is proposed only while its acceptance covers it "
        "(default: 0.02, measured on CPU)",
    )
    parser.add_argument(
        "--speculative-draft-cost",
        type=float,
        help="a draft model's cost per draft token relative to a target step (default: "
        "the ratio of their weights; 0 for ngram)",
    )


def gateway(args: argparse.Namespace) -> int:
    """Serve the OpenAI-compatible gateway under uvicorn (settings: SWITCHBOARD_* variables)."""
    import logging

    from pydantic import ValidationError

    from gateway.serve import serve
    from switchboard.logs import configure_logging

    configure_logging(level=logging.INFO, json_lines=_json_logs())
    try:
        return serve(args)
    except ValidationError as exc:  # refused settings, e.g. a default admin token
        messages = "; ".join(error["msg"] for error in exc.errors())
        print(f"switchboard: error: gateway settings: {messages}", file=sys.stderr)
        return 1


def _gateway_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", help="address to listen on (default: $SWITCHBOARD_HOST)")
    parser.add_argument("--port", type=int, help="HTTP port (default: $SWITCHBOARD_PORT)")
    parser.add_argument("--model", help="base checkpoint directory (default: $SWITCHBOARD_MODEL)")
    parser.add_argument("--log-level", default="info")
    parser.add_argument(
        "--graceful-s", type=float, default=10.0, help="seconds open streams get at shutdown"
    )


def up(args: argparse.Namespace) -> int:
    """Redis (reused or embedded), one worker and the gateway; a demo tenant; Ctrl-C stops."""
    import signal

    from switchboard.stack import Stack
    from worker.default_model import resolve_model_path

    model = resolve_model_path(args.model)
    stack = Stack(model=model, num_workers=args.workers, gateway_port=args.port)
    print("starting Redis, worker(s) and gateway ...", flush=True)
    with stack:
        key = stack.create_tenant_key(args.tenant)
        print(_up_banner(stack, key, model.name), flush=True)
        signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt))
        # Also when started in the background, where SIGINT arrives ignored: Ctrl-C on the
        # process group must still reach this loop, not only the children.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            while True:
                time.sleep(1)
                stack._check_children()
        except KeyboardInterrupt:
            print("\nstopping ...", flush=True)
    return 0


def _up_banner(stack, key: str, model_name: str) -> str:
    base = stack.base_url
    return f"""
Switchboard is up: gateway {base}, Redis {stack.redis_url}
  API key (tenant demo, shown once): {key}
  admin token:                       {stack.admin_token}

curl {base}/v1/chat/completions \\
  -H "Authorization: Bearer {key}" -H "Content-Type: application/json" \\
  -d '{{"model": "{model_name}", "max_tokens": 32,
       "messages": [{{"role": "user", "content": "Hello!"}}]}}'

python - <<'PY'
from openai import OpenAI
client = OpenAI(base_url="{base}/v1", api_key="{key}")
reply = client.chat.completions.create(
    model="{model_name}", messages=[{{"role": "user", "content": "Hello!"}}], max_tokens=32)
print(reply.choices[0].message.content)
PY

Ctrl-C stops everything."""


def _up_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="checkpoint directory (default: the default model)")
    parser.add_argument("--port", type=int, default=8000, help="gateway port")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--tenant", default="demo", help="name of the demo tenant to create")


COMMANDS: tuple[Command, ...] = (
    Command(
        ("model", "prepare"),
        "convert the default model once",
        model_prepare,
        _model_prepare_arguments,
    ),
    Command(("model", "path"), "print the default model's directory", model_path),
    Command(("demo",), "answer a few chat prompts with the engine", demo, _demo_arguments),
    Command(
        ("bench", "throughput"),
        "engine vs HF generate throughput",
        bench_throughput,
        _bench_arguments,
    ),
    Command(
        ("bench", "prefix"),
        "prefix cache on vs off (multi-turn chat, shared document)",
        bench_prefix,
        _bench_arguments,
    ),
    Command(
        ("bench", "spec"),
        "speculative decoding on vs off (batch 1 and 16)",
        bench_spec,
        _bench_arguments,
    ),
    Command(
        ("draft", "distill"),
        "distill a small draft model for speculative decoding",
        draft_distill,
        _draft_distill_arguments,
    ),
    Command(("worker",), "serve the engine over gRPC", worker, _worker_arguments),
    Command(("gateway",), "serve the OpenAI-compatible gateway", gateway, _gateway_arguments),
    Command(("up",), "run Redis, a worker and the gateway together", up, _up_arguments),
    *ADMIN_COMMANDS,
)


def build_parser(commands: Sequence[Command] = COMMANDS) -> argparse.ArgumentParser:
    """One parser with a nested subparser per command word (`model` → `prepare`, `path`)."""
    root = argparse.ArgumentParser(prog="switchboard", description="Multi-tenant LoRA serving.")
    groups: dict[tuple[str, ...], argparse._SubParsersAction] = {}
    parsers: dict[tuple[str, ...], argparse.ArgumentParser] = {(): root}
    for command in commands:
        for depth in range(1, len(command.words) + 1):
            prefix = command.words[:depth]
            if prefix in parsers:
                continue
            parent = prefix[:-1]
            if parent not in groups:
                groups[parent] = parsers[parent].add_subparsers(metavar="COMMAND", required=True)
            help_line = command.help if depth == len(command.words) else f"{prefix[-1]} commands"
            parsers[prefix] = groups[parent].add_parser(prefix[-1], help=help_line)
        command.add_arguments(parsers[command.words])
        parsers[command.words].set_defaults(run=command.run)
    return root


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `switchboard` script; returns the process exit status."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "passes_options_through", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra_options = extra
    try:
        return args.run(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        # Errors we raise on purpose get one line; anything else is a bug and keeps its traceback.
        from worker.errors import EngineError

        if not isinstance(exc, EngineError):
            raise
        print(f"switchboard: error: {exc}", file=sys.stderr)
        return 1
