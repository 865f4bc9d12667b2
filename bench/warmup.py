"""Warm from the first request: a fresh engine's (or worker's) first W1 pass against its second.

Each run is a fresh process. ``engine``: a child builds an engine, with its start-up
warm-up on or off (``EngineConfig.warmup``), runs W1 (32 x 128 prompt / 128 output tokens,
greedy, ignore_eos), then W1 again with other prompts of the same lengths (another seed, so
the prefix cache cannot help): time to build, both passes, second / first. ``worker``: starts
``switchboard worker`` (``--no-warmup`` for off) on a free port and times from the process's
start until a Generate call is answered, then both passes through gRPC, 32 streams at once.
Runs with the warm-up off and on alternate, so machine noise hits both.
Usage: ``python -m bench.warmup [--mode engine|worker|both] [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

from bench.report import write_report
from bench.workloads import fixed_lengths
from runtime.processes import stop_process

REQUESTS, PROMPT_LEN, OUTPUT_LEN = 32, 128, 128
READY_TIMEOUT_S = 300.0


@dataclass
class PassResult:
    seconds: float
    cpu_seconds: float  # this process's user + system time (engine mode only)
    minor_faults: int
    prefill_seconds: float  # steps until every prompt was computed (engine mode only)


@dataclass
class RunResult:
    mode: str
    warmup: bool
    ready_s: float  # engine built (engine mode) or first answer (worker mode)
    first: PassResult
    second: PassResult
    ratio: float = field(init=False)  # second / first: 1.0 means warm from the first request

    def __post_init__(self) -> None:
        self.ratio = self.second.seconds / self.first.seconds


def _usage() -> tuple[float, int]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime, r.ru_minflt


def engine_pass(engine, seed: int, tag: str) -> PassResult:
    from worker import SamplingParams

    requests = fixed_lengths(
        REQUESTS, prompt_len=PROMPT_LEN, output_len=OUTPUT_LEN, vocab=engine.config.vocab_size,
        seed=seed,
    )  # fmt: skip
    cpu0, faults0 = _usage()
    start = time.monotonic()
    for i, r in enumerate(requests):
        params = SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True)
        engine.add_request(f"{tag}-{i}", r.prompt_token_ids, params)
    prefill = None
    while engine.has_unfinished_requests:
        engine.step()
        if prefill is None and all(s.num_uncomputed_tokens <= 1 for s in engine.requests.values()):
            prefill = time.monotonic() - start
    elapsed = time.monotonic() - start
    cpu1, faults1 = _usage()
    return PassResult(elapsed, cpu1 - cpu0, faults1 - faults0, prefill or elapsed)


def run_engine_child(model: str | None, warmup: bool) -> RunResult:
    from worker import LLMEngine, engine_config
    from worker.model.default_model import resolve_model_path

    start = time.monotonic()
    engine = LLMEngine(resolve_model_path(model), engine_config(warmup=warmup))
    ready = time.monotonic() - start
    first = engine_pass(engine, 0, "first")
    second = engine_pass(engine, 1, "second")
    return RunResult("engine", warmup, ready, first, second)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _grpc_pass(stub, seed: int, tag: str, vocab: int) -> PassResult:
    from rpc import worker_pb2

    requests = fixed_lengths(
        REQUESTS, prompt_len=PROMPT_LEN, output_len=OUTPUT_LEN, vocab=vocab, seed=seed
    )
    messages = [
        worker_pb2.GenerateRequest(
            request_id=f"{tag}-{i}",
            prompt_token_ids=r.prompt_token_ids,
            params=worker_pb2.SamplingParams(
                max_tokens=r.output_len, temperature=0, ignore_eos=True, n=1
            ),
        )
        for i, r in enumerate(requests)
    ]
    start = time.monotonic()
    await asyncio.gather(*(stub.GenerateAll(m) for m in messages))
    return PassResult(time.monotonic() - start, 0.0, 0, 0.0)


async def _answered(stub, started: float) -> float:
    """Seconds from ``started`` until the worker answers a one-token Generate."""
    import grpc

    from rpc import worker_pb2

    probe = worker_pb2.GenerateRequest(
        request_id="probe",
        prompt_token_ids=list(range(100, 108)),
        params=worker_pb2.SamplingParams(max_tokens=1, temperature=0, n=1),
    )
    while time.monotonic() - started < READY_TIMEOUT_S:
        try:
            await stub.GenerateAll(probe, timeout=30, wait_for_ready=True)
            return time.monotonic() - started
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise
            await asyncio.sleep(0.05)
    raise TimeoutError(f"the worker did not answer within {READY_TIMEOUT_S:.0f} s")


def run_worker(model: str | None, warmup: bool, vocab: int) -> RunResult:
    """A fresh ``switchboard worker`` process: time to its first answer, then both passes."""
    import grpc

    from rpc import worker_pb2_grpc

    port = _free_port()
    args = [
        sys.executable, "-c", "from switchboard.cli import main; raise SystemExit(main())",
        "worker", "--model", model or "default", "--port", str(port), "--metrics-port", "-1",
    ]  # fmt: skip
    if not warmup:
        args.append("--no-warmup")
    started = time.monotonic()
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    async def drive() -> RunResult:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            ready = await _answered(stub, started)
            first = await _grpc_pass(stub, 0, "first", vocab)
            second = await _grpc_pass(stub, 1, "second", vocab)
            return RunResult("worker", warmup, ready, first, second)

    try:
        return asyncio.run(drive())
    finally:
        stop_process(process, 60)


def run_engine(model: str | None, warmup: bool) -> RunResult:
    """``run_engine_child`` in a fresh interpreter (process-wide caches start cold)."""
    args = [sys.executable, "-m", "bench.warmup", "--child", "on" if warmup else "off"]
    if model:
        args += ["--model", model]
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    data = json.loads(out.strip().splitlines()[-1])
    return RunResult(
        data["mode"], data["warmup"], data["ready_s"],
        PassResult(**data["first"]), PassResult(**data["second"]),
    )  # fmt: skip


def _vocab(model: str | None) -> int:
    from worker.model.default_model import resolve_model_path
    from worker.model.model_config import ModelConfig

    return ModelConfig.from_pretrained(resolve_model_path(model)).vocab_size


def summarize(results: list[RunResult]) -> dict:
    """Medians per mode and warm-up setting."""
    summary = {}
    for mode in sorted({r.mode for r in results}):
        for warmup in (False, True):
            rs = [r for r in results if r.mode == mode and r.warmup == warmup]
            if rs:
                summary[f"{mode} warmup={'on' if warmup else 'off'}"] = {
                    "runs": len(rs),
                    "ready_s": statistics.median(r.ready_s for r in rs),
                    "first_s": statistics.median(r.first.seconds for r in rs),
                    "second_s": statistics.median(r.second.seconds for r in rs),
                    "ratio": statistics.median(r.ratio for r in rs),
                }
    return summary


def main(argv: list[str] | None = None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="HF checkpoint dir (default: SmolLM2-135M)")
    parser.add_argument("--mode", choices=["engine", "worker", "both"], default="both")
    parser.add_argument("--warmup", choices=["off", "on", "both"], default="both")
    parser.add_argument("--repeats", type=int, default=3, help="runs per mode and setting")
    parser.add_argument("--child", choices=["off", "on"], help=argparse.SUPPRESS)
    parser.add_argument("--out", default="bench/results/warmup.json")
    args = parser.parse_args(argv)
    if args.child is not None:
        print(json.dumps(asdict(run_engine_child(args.model, args.child == "on"))), flush=True)
        return None
    modes = ["engine", "worker"] if args.mode == "both" else [args.mode]
    settings = [False, True] if args.warmup == "both" else [args.warmup == "on"]
    vocab = _vocab(args.model)
    results = []
    for _ in range(args.repeats):
        for mode in modes:
            for warmup in settings:
                if mode == "engine":
                    result = run_engine(args.model, warmup)
                else:
                    result = run_worker(args.model, warmup, vocab)
                results.append(result)
                print(
                    f"{mode} warmup={'on' if warmup else 'off'}: ready {result.ready_s:.2f} s, "
                    f"first {result.first.seconds:.2f} s, second {result.second.seconds:.2f} s, "
                    f"ratio {result.ratio:.3f}",
                    flush=True,
                )
    summary = summarize(results)
    print(json.dumps(summary, indent=1))
    return write_report({"runs": [asdict(r) for r in results], "summary": summary}, args.out)


if __name__ == "__main__":
    main()
