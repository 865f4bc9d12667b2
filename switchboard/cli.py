"""The `switchboard` command line: one handler function per subcommand, listed in COMMANDS.

Handlers import what they need themselves: this module imports neither torch nor transformers,
because the gateway shares it and must stay light. To add a subcommand, write a handler (and,
if it takes options, an `add_arguments` function) and append a `Command` to COMMANDS.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

Handler = Callable[[argparse.Namespace], int]

DEMO_QUESTIONS = (
    "What is the capital of France?",
    "Write a haiku about a busy switchboard operator.",
    "Explain in two sentences why the sky is blue.",
)


def _no_arguments(parser: argparse.ArgumentParser) -> None:
    """For subcommands without options."""


@dataclass(frozen=True)
class Command:
    """One subcommand: its words (`("model", "prepare")`), help line, options and handler."""

    words: tuple[str, ...]
    help: str
    run: Handler
    add_arguments: Callable[[argparse.ArgumentParser], None] = _no_arguments


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


def _bench_arguments(parser: argparse.ArgumentParser) -> None:
    # Every option goes on to bench/throughput.py, which documents them (--help there).
    parser.set_defaults(passes_options_through=True)


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
