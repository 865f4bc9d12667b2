"""`switchboard worker`: one engine served over gRPC, and the engine options it takes.

Everything heavy (torch, the engine, grpc) is imported when the command runs, so building
the CLI's parser stays light.
"""

from __future__ import annotations

import argparse
import functools

from switchboard.commands import Command

# worker.engine.placement's names; spelled out here because this module must not import torch.
DTYPE_CHOICES = ("auto", "bfloat16", "float32", "float16")
SCHEDULING_POLICIES = ("fair", "fcfs")  # worker.core.fairness.SchedulingPolicy's values
# Seconds a signalled worker may take beyond --drain-timeout before it exits regardless:
# the abort (5 s), the server stop (1 s) and a step; within k8s' grace period (45 s).
STOP_MARGIN_S = 12.0


def worker(args: argparse.Namespace) -> int:
    """Serve one engine over gRPC until SIGTERM/SIGINT, then drain (worker/serving/server.py)."""
    import logging
    import os
    from pathlib import Path

    import uvloop

    from runtime.logs import configure_logging, json_lines_wanted
    from worker.errors import TensorParallelError
    from worker.serving.auth import TOKEN_ENV, WorkerAuth
    from worker.serving.main_thread import MainThreadEngineLoop
    from worker.serving.server import run_worker

    configure_logging(level=logging.INFO, json_lines=json_lines_wanted())
    auth = WorkerAuth(
        tls_cert=_path(args.tls_cert),
        tls_key=_path(args.tls_key),
        tls_client_ca=_path(args.tls_client_ca),
        token=os.environ.get(TOKEN_ENV) or None,
    )
    auth.check(args.host)  # a worker that would listen unauthenticated stops here, at once
    engine_kwargs = worker_engine_kwargs(args)
    # The engine's step loop runs on this (the main) thread, the gRPC asyncio loop beside it.
    # A drain that overruns its deadline is aborted (worker/serving/server.py); the margin
    # covers that abort and the stop after it. Past it the process dumps stacks and exits.
    engine_loop = MainThreadEngineLoop(stop_deadline_s=args.drain_timeout + STOP_MARGIN_S)
    # uvloop, as the gateway's uvicorn uses: grpc.aio's callbacks run on it at less CPU.
    rpc = functools.partial(
        uvloop.run,
        run_worker(
            model=args.model,
            served_model_name=args.served_model_name,
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
            adapter_store_url=args.adapter_store_url or None,
            adapter_store_endpoint=args.adapter_store_endpoint or None,
            adapter_cache_bytes=int(args.adapter_cache_gb * (1 << 30)),
            metrics_port=None if args.metrics_port < 0 else args.metrics_port,
            engine_loop=engine_loop,
            auth=auth,
            health_port=None if args.health_port < 0 else args.health_port,
            warmup=not args.no_warmup,
        ),
    )
    try:
        engine_loop.run(rpc)
    except TensorParallelError as exc:  # a rank died: it left the registry; restart us
        logging.getLogger("switchboard.worker").error("worker stopped: %s", exc)
        return 1
    return 0


def _path(value: str | None):
    from pathlib import Path

    return Path(value) if value else None


def worker_engine_kwargs(args: argparse.Namespace) -> dict:
    """The engine's keyword arguments from the worker's flags."""
    from worker.core.config import FairnessConfig

    return {
        "device": args.device,
        "max_loras": args.max_loras,
        "max_lora_rank": args.max_lora_rank,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "burst_prefill_tokens": args.burst_prefill_tokens or None,
        "kv_cache_memory_gb": args.kv_cache_memory_gb,
        "enable_prefix_caching": not args.no_prefix_caching,
        "share_base_model_prefixes": args.share_base_model_prefixes,
        "preemption_mode": args.preemption_mode,
        "swap_space_gb": args.swap_space_gb,
        "tensor_parallel_size": args.tensor_parallel_size,
        "attention_backend": args.attention_backend,
        "decode_step_budget_ms": args.decode_step_budget_ms,
        "kernel_choice": args.kernel_choice,
        "batch_invariant": args.batch_invariant,
        "quantization": args.quantization,
        "quantization_group_size": args.quantization_group_size,
        "quantization_lm_head": args.quantization_lm_head,
        "speculative_model": args.speculative_model,
        "num_speculative_tokens": args.num_speculative_tokens,
        "speculative_max_batch_size": args.speculative_max_batch_size,
        "speculative_min_acceptance": args.speculative_min_acceptance,
        "speculative_draft_cost": args.speculative_draft_cost,
        "speculative_alternatives": args.speculative_alternatives,
        "speculative_draft_quantization": args.speculative_draft_quantization,
        "fairness": FairnessConfig(
            policy=args.scheduling_policy,
            max_running_per_tenant=args.max_running_per_tenant,
        ),
    } | (
        {}
        if args.speculative_position_cost is None
        else {"speculative_position_cost": args.speculative_position_cost}
    )


def _worker_arguments(parser: argparse.ArgumentParser) -> None:
    import os

    from runtime.home import default_adapter_store

    parser.add_argument("--model", default="default", help="checkpoint directory or 'default'")
    parser.add_argument(
        "--served-model-name",
        help="the base's name in clients' `model` (default: the checkpoint directory's name)",
    )
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
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPE_CHOICES,
        help="auto: bf16 where this CPU or GPU computes it natively, else fp32 (CPU) or fp16",
    )
    parser.add_argument(
        "--quantization",
        choices=("int4", "int8"),
        default=None,
        help="quantize a bf16/fp32 base's weights as it loads, weight-only, round to nearest "
        "(activations unrounded, fp32 sums; CPU; docs/quantization.md)",
    )
    parser.add_argument(
        "--quantization-group-size",
        type=int,
        default=None,
        help="input features per scale and zero (default: int4 32, int8 per channel; -1: per "
        "channel)",
    )
    parser.add_argument(
        "--quantization-lm-head",
        choices=("int4", "int8"),
        default=None,
        help="quantize the output layer too, with that method's defaults (default: as loaded)",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="split the model over this many ranks (GPUs from --device's, or processes "
        "sharing this machine's cores), rank 0 in this process (docs/tensor-parallelism.md)",
    )
    parser.add_argument(
        "--attention-backend",
        choices=("torch", "triton"),
        default=None,
        help="paged attention's kernels (default: triton on CUDA, torch on CPU)",
    )
    parser.add_argument("--max-loras", type=int, default=8, help="adapter slots (0: no LoRA)")
    parser.add_argument("--max-lora-rank", type=int, default=64, help="largest adapter rank")
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="tokens one step computes at most (long prompts are prefilled in chunks of it)",
    )
    parser.add_argument(
        "--burst-prefill-tokens",
        type=int,
        default=512,
        help="while one tenant's prompts arrive together, steps of at most this many tokens, "
        "its streams waiting behind at most a full step of prompts (0: off)",
    )
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
    parser.add_argument(
        "--scheduling-policy",
        choices=SCHEDULING_POLICIES,
        default=SCHEDULING_POLICIES[0],
        help="fair: each tenant its weighted share of the engine (virtual token counters); "
        "fcfs: first come, first served",
    )
    parser.add_argument(
        "--max-running-per-tenant",
        type=int,
        help="most sequences one tenant may run at once (default: no cap beyond --max-num-seqs)",
    )
    _auth_arguments(parser)
    _speculative_arguments(parser)
    parser.add_argument(
        "--kernel-choice",
        choices=("measure", "fixed"),
        default="measure",
        help="the projections' kernels: timed on this CPU once (cached), or a fixed rule",
    )
    parser.add_argument(
        "--batch-invariant",
        action="store_true",
        help="every request's numerics independent of its neighbours in a step, of chunking "
        "and of prefix caching (CPU, one rank; docs/engine.md gives the cost)",
    )
    parser.add_argument(
        "--decode-step-budget-ms",
        type=float,
        default=None,
        help="while a step carries decodes and more than one tenant is active, cut its "
        "prefill so it takes at most this long (default: the budget measured at warm-up; "
        "0: no bound)",
    )
    parser.add_argument(
        "--no-warmup",
        action="store_true",
        help="report ready without first running the step shapes serving uses (the first "
        "requests then run slower)",
    )
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
        "$SWITCHBOARD_ADAPTER_STORE, else $SWITCHBOARD_HOME/adapters); with "
        "--adapter-store-url, the local cache of fetched adapters",
    )
    parser.add_argument(
        "--adapter-store-url",
        default=os.environ.get("SWITCHBOARD_ADAPTER_STORE_URL", ""),
        help="object storage for adapters, s3://bucket/prefix (default: "
        "$SWITCHBOARD_ADAPTER_STORE_URL; empty: the filesystem store). Credentials: the "
        "AWS_* environment",
    )
    parser.add_argument(
        "--adapter-store-endpoint",
        default=os.environ.get("SWITCHBOARD_ADAPTER_STORE_ENDPOINT", ""),
        help="the S3 API endpoint (MinIO, R2...; default: $SWITCHBOARD_ADAPTER_STORE_ENDPOINT)",
    )
    parser.add_argument(
        "--adapter-cache-gb",
        type=float,
        default=4.0,
        help="local cache of adapters fetched from object storage (loaded ones never evicted)",
    )


def _auth_arguments(parser: argparse.ArgumentParser) -> None:
    import os

    parser.add_argument(
        "--tls-cert",
        default=os.environ.get("SWITCHBOARD_TLS_CERT"),
        help="the worker's TLS certificate, PEM (default: $SWITCHBOARD_TLS_CERT)",
    )
    parser.add_argument(
        "--tls-key",
        default=os.environ.get("SWITCHBOARD_TLS_KEY"),
        help="its private key, PEM (default: $SWITCHBOARD_TLS_KEY)",
    )
    parser.add_argument(
        "--tls-client-ca",
        default=os.environ.get("SWITCHBOARD_TLS_CLIENT_CA"),
        help="require callers' certificates signed by this CA: mutual TLS (default: "
        "$SWITCHBOARD_TLS_CLIENT_CA). With it and/or a token in $SWITCHBOARD_WORKER_TOKEN "
        "(sent over TLS) the worker may listen beyond loopback; without both it refuses to",
    )
    parser.add_argument(
        "--health-port",
        type=int,
        default=-1,
        help="also serve grpc.health.v1 alone, in plaintext, on this port of --host: for "
        "probes that cannot present a client certificate (0: any free one; -1: off)",
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
        "(default: measured at start, timing the forward pass by rows fed)",
    )
    parser.add_argument(
        "--speculative-draft-cost",
        type=float,
        help="a draft model's cost per draft token relative to a target step (default: "
        "the ratio of their weights; 0 for ngram)",
    )
    parser.add_argument(
        "--speculative-alternatives",
        type=int,
        default=7,  # worker.spec_decode.proposal.NUM_ALTERNATIVES (this module avoids torch)
        help="runner-up tokens a draft model offers per draft, verified beside the chain "
        "where worth their rows (0-8; default: %(default)s)",
    )
    parser.add_argument(
        "--speculative-draft-quantization",
        choices=("auto", "int4", "int8", "none"),  # worker.spec_decode.setup.DRAFT_QUANTIZATIONS
        default="auto",
        help="a draft model's weights on CPU: int4 for its small passes (one native call each "
        "where a C compiler builds it), int8 (fp32 models), 'auto' int4 where the native "
        "kernel builds, else the one that fits the dtype; outputs stay the target's "
        "(default: %(default)s)",
    )


WORKER_COMMAND = Command(("worker",), "serve the engine over gRPC", worker, _worker_arguments)
