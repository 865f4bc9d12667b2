"""The `switchboard` command line: one handler function per subcommand, listed in COMMANDS.

Handlers import what they need themselves: this module imports neither torch nor transformers,
because the gateway shares it and must stay light. To add a subcommand, write a handler (and,
if it takes options, an `add_arguments` function) and append a `Command` to COMMANDS; the
`admin …` subcommands are listed in `switchboard.admin_commands`.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from runtime.logs import json_lines_wanted
from switchboard.admin_commands import ADMIN_COMMANDS
from switchboard.commands import Command
from switchboard.worker_command import DTYPE_CHOICES, WORKER_COMMAND

DEMO_QUESTIONS = (
    "What is the capital of France?",
    "Write a haiku about a busy switchboard operator.",
    "Explain in two sentences why the sky is blue.",
)


def model_prepare(args: argparse.Namespace) -> int:
    """Convert the default model if needed; print its directory (for `$(switchboard ...)`)."""
    from worker.model.default_model import prepare_default_model

    print(prepare_default_model(force=args.force))
    return 0


def _model_prepare_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--force", action="store_true", help="convert again even if cached")


def model_tiny(args: argparse.Namespace) -> int:
    """Write a tiny random checkpoint of a family, with a tokenizer; print its directory."""
    from pathlib import Path

    from worker.model.tiny_families import make_servable_checkpoint

    print(make_servable_checkpoint(Path(args.dir), args.family, seed=args.seed))
    return 0


def _model_tiny_arguments(parser: argparse.ArgumentParser) -> None:
    from worker.model.tiny_families import FAMILIES, MOE_FAMILIES

    families = sorted(FAMILIES) + sorted(MOE_FAMILIES)  # dense, then mixture-of-experts
    parser.add_argument("family", choices=families, help="the architecture to build")
    parser.add_argument("dir", help="where to write it (then: make run MODEL=DIR)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")


def model_path(args: argparse.Namespace) -> int:
    """Print where the default model lives; exit 1 if it has not been prepared yet."""
    from runtime.home import default_model_dir
    from worker.model.default_model import is_prepared

    path = default_model_dir()
    print(path)
    if is_prepared(path):
        return 0
    print("not prepared yet: run `switchboard model prepare`", file=sys.stderr)
    return 1


def demo(args: argparse.Namespace) -> int:
    """Answer a few chat prompts greedily with the engine and report throughput."""
    from worker import LLM, SamplingParams
    from worker.model.default_model import resolve_model_path

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
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPE_CHOICES,
        help="auto: bf16 where this CPU or GPU computes it natively, else fp32 (CPU) or fp16",
    )
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

    from runtime.logs import configure_logging
    from training.draft_distill import default_draft_path, distill
    from worker.model.default_model import resolve_model_path

    configure_logging(level=logging.INFO, json_lines=json_lines_wanted())
    target = resolve_model_path(args.model)
    out = Path(args.out) if args.out else default_draft_path()
    result = distill(
        target,
        out,
        num_layers=args.num_layers,
        num_prompts=args.num_prompts,
        max_tokens=args.max_tokens,
        output_vocab=args.output_vocab,
        epochs=args.epochs,
        train_minutes=args.train_minutes,
    )
    print(
        f"draft saved to {result.path}: {result.output_vocab} output tokens, "
        f"{result.generated_tokens} generated tokens, "
        f"{result.train_steps} steps, KL {result.first_loss:.3f} -> {result.final_loss:.3f}, "
        f"{result.elapsed_s / 60:.1f} min"
    )
    return 0


def _draft_distill_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="target checkpoint (default: the default model)")
    parser.add_argument("--out", help="where to save the draft (default: beside the model)")
    parser.add_argument("--num-layers", type=int, default=4, help="decoder layers kept")
    parser.add_argument(
        "--num-prompts", type=int, default=2304,
        help="answers to generate: each built-in instruction once greedily, the rest sampled",
    )  # fmt: skip
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens per answer")
    parser.add_argument(
        "--output-vocab", type=int, default=8192,
        help="tokens the draft's output layer keeps, the target's most frequent (0: all)",
    )  # fmt: skip
    parser.add_argument(
        "--epochs", type=int, default=6,
        help="passes over the corpus, unless --train-minutes runs out first (a corpus cached "
        "by an earlier run is read back: training alone)",
    )  # fmt: skip
    parser.add_argument("--train-minutes", type=float, default=25.0, help="training budget")


def _bench_arguments(parser: argparse.ArgumentParser) -> None:
    # Every option goes on to the benchmark module, which documents them (--help there).
    parser.set_defaults(passes_options_through=True)


def gateway(args: argparse.Namespace) -> int:
    """Serve the OpenAI-compatible gateway under uvicorn (settings: SWITCHBOARD_* variables)."""
    import logging

    from pydantic import ValidationError

    from gateway.main import run_gateway
    from runtime.logs import configure_logging

    configure_logging(level=logging.INFO, json_lines=json_lines_wanted())
    try:
        return run_gateway(args)
    except ValidationError as exc:  # refused settings, e.g. a default admin token
        messages = "; ".join(error["msg"] for error in exc.errors())
        print(f"switchboard: error: gateway settings: {messages}", file=sys.stderr)
        return 1


def _gateway_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", help="address to listen on (default: $SWITCHBOARD_HOST)")
    parser.add_argument("--port", type=int, help="HTTP port (default: $SWITCHBOARD_PORT)")
    parser.add_argument(
        "--metrics-port",
        type=int,
        help="Prometheus /metrics port on --host, no auth (0: any free one; default: "
        "$SWITCHBOARD_METRICS_PORT, else none: /metrics on the HTTP port, admin token only)",
    )
    parser.add_argument(
        "--admin-port",
        type=int,
        help="serve /admin (and /metrics, docs) only on this port of $SWITCHBOARD_ADMIN_HOST "
        "(default 127.0.0.1), never on --port (default: $SWITCHBOARD_ADMIN_PORT, else --port)",
    )
    parser.add_argument("--model", help="base checkpoint directory (default: $SWITCHBOARD_MODEL)")
    parser.add_argument("--log-level", default="info")
    parser.add_argument(
        "--graceful-s", type=float, default=10.0, help="seconds open streams get at shutdown"
    )


def certs(args: argparse.Namespace) -> int:
    """Write a CA, a worker and a gateway certificate for mutual TLS (runtime/certs.py)."""
    from pathlib import Path

    from runtime.certs import CertSet, write_certs

    out = Path(args.out)
    existing = CertSet.in_dir(out)
    if (existing.worker.exist() or existing.gateway.exist()) and not args.force:
        print(f"switchboard: error: {out} already holds certificates (--force)", file=sys.stderr)
        return 1
    made = write_certs(out, days=args.days, worker_name=args.worker_name)
    print(f"{made.worker.cert.parent}  (worker: ca.crt, tls.crt, tls.key)")
    print(f"{made.gateway.cert.parent}  (gateway: ca.crt, tls.crt, tls.key)")
    return 0


def _certs_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", help="directory to write worker/ and gateway/ into")
    parser.add_argument("--days", type=int, default=825, help="validity")
    parser.add_argument(
        "--worker-name",
        default="switchboard-worker",
        help="DNS name on the worker certificate; gateways check it "
        "(SWITCHBOARD_WORKER_TLS_SERVER_NAME)",
    )
    parser.add_argument("--force", action="store_true", help="replace certificates there")


def up(args: argparse.Namespace) -> int:
    """Redis (reused or embedded), one worker and the gateway; a demo tenant; Ctrl-C stops."""
    import signal

    from runtime.stack import Stack
    from worker.model.default_model import resolve_model_path

    first, *others = args.model or [None]
    model = resolve_model_path(first)
    stack = Stack(
        model=model,
        extra_models=[resolve_model_path(m) for m in others],
        num_workers=args.workers,
        gateway_port=args.port,
        worker_args=_up_worker_args(args),
    )
    print("starting Redis, worker(s) and gateway ...", flush=True)
    with stack:
        key = stack.demo_key(args.tenant)
        signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt))
        # Also when started in the background, where SIGINT arrives ignored: Ctrl-C on the
        # process group must still reach this loop, not only the children. Before the
        # banner, which says Ctrl-C stops everything: a Ctrl-C right after it found SIGINT
        # still ignored here, and the children's exit then read as a crash (status 1).
        signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            # Inside the try: a Ctrl-C the moment the banner's last line is out lands here too.
            print(_up_banner(stack, key, model.name), flush=True)
            while True:
                time.sleep(1)
                stack._check_children()
        except KeyboardInterrupt:
            print("\nstopping ...", flush=True)
    return 0


def _up_worker_args(args: argparse.Namespace) -> list[str]:
    """The worker flags ``up`` passes on (its base's quantization on load)."""
    if args.quantization is None:
        return []
    extra = ["--quantization", args.quantization]
    if args.quantization_group_size is not None:
        extra += ["--quantization-group-size", str(args.quantization_group_size)]
    if args.quantization_lm_head is not None:
        extra += ["--quantization-lm-head", args.quantization_lm_head]
    return extra


def _up_banner(stack, key: str, model_name: str) -> str:
    base = stack.base_url
    return f"""
Switchboard is up: gateway {base}, Redis {stack.redis_url}
  API key (tenant demo):             {key}
  admin token:                       {stack.admin_token}
  gateway -> workers: mutual TLS, certificates in {stack.certs.worker.cert.parent.parent}
  web console: {base}/console (the API key), {base}/console/admin (the admin token)

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
    parser.add_argument(
        "--model",
        action="append",
        help="checkpoint directory (default: the default model); repeat it for more bases, "
        "each its own pool of workers behind the one gateway (the first is the default)",
    )
    parser.add_argument("--port", type=int, default=8000, help="gateway port")
    parser.add_argument("--workers", type=int, default=1, help="workers per base")
    parser.add_argument(
        "--quantization",
        choices=("int4", "int8"),
        default=None,
        help="quantize the bases' weights as they load (weight-only; docs/quantization.md)",
    )
    parser.add_argument(
        "--quantization-group-size",
        type=int,
        default=None,
        help="input features per scale (default: int4 32, int8 per channel; -1: per channel)",
    )
    parser.add_argument(
        "--quantization-lm-head",
        choices=("int4", "int8"),
        default=None,
        help="quantize the output layer too (default: as loaded)",
    )
    parser.add_argument("--tenant", default="demo", help="name of the demo tenant to create")


COMMANDS: tuple[Command, ...] = (
    Command(
        ("model", "prepare"),
        "convert the default model once",
        model_prepare,
        _model_prepare_arguments,
    ),
    Command(("model", "path"), "print the default model's directory", model_path),
    Command(
        ("model", "tiny"),
        "write a tiny random checkpoint of a family (to try it end to end)",
        model_tiny,
        _model_tiny_arguments,
    ),
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
    WORKER_COMMAND,
    Command(("gateway",), "serve the OpenAI-compatible gateway", gateway, _gateway_arguments),
    Command(("up",), "run Redis, a worker and the gateway together", up, _up_arguments),
    Command(
        ("certs",),
        "write mutual-TLS certificates for gateways and workers",
        certs,
        _certs_arguments,
    ),
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
