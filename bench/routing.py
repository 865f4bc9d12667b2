"""Routing inside a pool: the same adapter trace routed by LoRA affinity, by least load and by
round robin, over the same worker processes, in one run.

``--workers`` (3) `switchboard worker` processes serve one tiny checkpoint with ``--max-loras``
(4) adapter slots each, registered in Redis as a pool. ``--adapters`` (32) rank-16 LoRA adapters
on every attention projection are stored once; a seeded trace of ``--requests`` requests arrives
as a Poisson process at ``--rate`` per second, each on an adapter drawn from a Zipf law
(exponent ``--zipf``) over them, with 32-96 prompt tokens and ``--output-tokens`` greedy tokens
(ignore_eos). Each policy replays the whole trace on freshly started workers (cold slots and
host caches, counters at zero):

    affinity     the gateway's ranking (`WorkerDirectory.candidates`: LoRA affinity within the
                 load bound, the adapter's rendezvous order, the request's prefix key), over
                 the registry as the gateway reads it
    least_load   the same directory's least loaded worker (running + waiting + what it sent
                 since the worker's last heartbeat)
    round_robin  the next worker in turn

Reported per policy: adapter loads per 1,000 requests (loads from the store into a worker plus
device slots refilled while holding another adapter, read from the workers' metrics), each
worker's share, TTFT p50 and p99 (send to first token), throughput (generated tokens / the
trace's wall time); and the routing log replayed through per-worker slots evicting by the
workers' rule (`bench.slot_model.replay`): the modelled loads beside the measured ones, by
adapter popularity (ranks 1-4, 5-12, 13+) and by quarter of the trace. Where the slowest
requests waited: each request's row (adapter, worker, TTFT, requests in flight on its worker
when it was sent, whether the replay put its adapter in a slot), the slowest five, and the TTFT
p50/p99 of the requests that filled a slot against those that did not.

Reported for the trace itself (`bench.slot_model`): its loads under perfect placement (all
``workers x max_loras`` slots as one cache: the best a router can do without replicating
adapters) with the workers' eviction rule, with LRU slots and with least-frequently-used ones,
and Belady's lower bound (no policy can load less); and so the largest ratio to least load's
measured loads that each, and any policy at all, could reach on this trace.

    python -m bench.routing [--requests 240 --rate 3 --workers 3 --max-loras 4 --adapters 32]

Bounded for a shared 2-core machine (a few hundred short requests per policy); the figures are
noisy there, so compare the ratios of one run, not runs of different days.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import re
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
import httpx
import numpy as np
import redis.asyncio as aioredis
from safetensors.numpy import save_file

from adapters import BaseModelSpec, FilesystemAdapterStore, load_adapter_dir
from bench.report import write_report
from bench.slot_model import Cost, Replay, belady_cost, heat_cost, lfu_cost, lru_cost, replay
from gateway.routing import WorkerDirectory, prefix_affinity_key
from rpc import worker_pb2, worker_pb2_grpc
from runtime.embedded_redis import EmbeddedRedis, free_port
from runtime.processes import reap
from runtime.stack import reachable_redis, switchboard_command

POLICIES = ("affinity", "least_load", "round_robin")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass
class PolicyResult:
    policy: str
    requests: int
    adapter_loads: int  # store -> worker loads plus slot refills
    store_loads: int
    slot_refills: int
    loads_per_1k: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    throughput_tok_s: float
    elapsed_s: float
    by_worker: dict[str, list[int]]  # measured (store loads, slot refills) per worker
    requests_by_worker: dict[str, int]
    model: dict  # the routing log replayed through per-worker slots (`breakdown`)
    # Per request, in arrival order: [adapter, worker, TTFT ms, in flight on the worker when
    # sent (itself included), the fewest in flight on any worker then (before it), whether
    # the replay filled a slot for it].
    rows: list[list]
    slowest: list[list]  # the five slowest rows, slowest first, each with its index in front
    ttft_by_load: dict[str, list[float]]  # "filled a slot" / "resident": [count, p50, p99]


# Adapters by popularity rank (make_trace's adapter i is the (i+1)-th most popular).
RANK_GROUPS = (("ranks 1-4", 0, 4), ("ranks 5-12", 4, 12), ("ranks 13+", 12, None))


def breakdown(out: Replay, requests: int) -> dict:
    """A replay's loads per 1,000 requests: in all, per worker, per popularity group, per
    quarter of the trace (each quarter's loads over its own requests)."""

    def pair(c: Cost) -> list[int]:
        return [c.store_loads, c.slot_refills]

    groups = {}
    for name, lo, hi in RANK_GROUPS:
        c = Cost()
        for adapter, cost in out.by_adapter.items():
            if adapter >= lo and (hi is None or adapter < hi):
                c.store_loads += cost.store_loads
                c.slot_refills += cost.slot_refills
        groups[name] = pair(c)
    quarter = requests / len(out.by_stretch)
    return {
        "loads_per_1k": out.total.per_1k(requests),
        "loads": pair(out.total),
        "by_worker": {w: pair(c) for w, c in sorted(out.by_worker.items())},
        "by_popularity": groups,
        "per_1k_by_quarter": [round(c.per_1k(round(quarter)), 1) for c in out.by_stretch],
    }


def trace_bounds(trace, args, least_load_loads: int) -> dict:
    """What the trace costs at best: perfect placement over the workers' slots (their rule,
    LRU, LFU), and Belady's lower bound; and the ratios to least load's measured loads they
    would give."""
    adapters = [a.adapter for a in trace]
    slots = args.workers * args.max_loras
    heat, lru, lfu, belady = (
        f(adapters, slots) for f in (heat_cost, lru_cost, lfu_cost, belady_cost)
    )
    return {
        "slots": slots,
        "distinct_adapters": len(set(adapters)),
        "perfect_placement_rule_per_1k": heat.per_1k(len(adapters)),
        "perfect_placement_rule": [heat.store_loads, heat.slot_refills],
        "perfect_placement_lru_per_1k": lru.per_1k(len(adapters)),
        "perfect_placement_lru": [lru.store_loads, lru.slot_refills],
        "perfect_placement_lfu_per_1k": lfu.per_1k(len(adapters)),
        "perfect_placement_lfu": [lfu.store_loads, lfu.slot_refills],
        "belady_per_1k": belady.per_1k(len(adapters)),
        "belady": [belady.store_loads, belady.slot_refills],
        "least_load_over_perfect_rule": least_load_loads / max(1, heat.loads),
        "least_load_over_perfect_lru": least_load_loads / max(1, lru.loads),
        "least_load_over_perfect_lfu": least_load_loads / max(1, lfu.loads),
        "least_load_over_belady": least_load_loads / max(1, belady.loads),
    }


def write_adapters(model: Path, root: Path, count: int, *, rank: int = 16) -> list[Path]:
    """``count`` PEFT LoRA adapters (numpy + safetensors) on every attention projection."""
    config = json.loads((model / "config.json").read_text())
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv = config["num_key_value_heads"] * head_dim
    shapes = {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv),
              "v_proj": (hidden, kv), "o_proj": (heads * head_dim, hidden)}  # fmt: skip
    paths = []
    for i in range(count):
        rng = np.random.default_rng(i)
        tensors = {}
        for layer in range(config["num_hidden_layers"]):
            for module, (fan_in, fan_out) in shapes.items():
                key = f"base_model.model.model.layers.{layer}.self_attn.{module}"
                a = rng.standard_normal((rank, fan_in), np.float32) * 0.1
                tensors[f"{key}.lora_A.weight"] = a
                tensors[f"{key}.lora_B.weight"] = (
                    rng.standard_normal((fan_out, rank), np.float32) * 0.1
                )
        path = root / f"adapter-{i}"
        path.mkdir(parents=True)
        save_file(tensors, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
            "target_modules": list(PROJECTIONS), "bias": "none",
        }))  # fmt: skip
        paths.append(path)
    return paths


@dataclass(frozen=True)
class Arrival:
    at_s: float
    adapter: int
    prompt: list[int]


def make_trace(args, vocab: int) -> list[Arrival]:
    rng = np.random.default_rng(args.seed)
    weights = 1.0 / np.arange(1, args.adapters + 1) ** args.zipf
    weights /= weights.sum()
    gaps = rng.exponential(1.0 / args.rate, args.requests)
    adapters = rng.choice(args.adapters, size=args.requests, p=weights)
    return [
        Arrival(float(at), int(a), rng.integers(3, vocab, int(rng.integers(32, 97))).tolist())
        for at, a in zip(np.cumsum(gaps), adapters, strict=True)
    ]


class Pool:
    """The worker processes, their channels and metrics ports."""

    def __init__(self, args, model: Path, store: Path, redis_url: str, prefix: str) -> None:
        self.processes, self.ports, self.metrics = [], [], []
        for i in range(args.workers):
            port, metrics = free_port(), free_port()
            command = [
                *switchboard_command(), "worker", "--model", str(model), "--port", str(port),
                "--dtype", "float32", "--redis-url", redis_url, "--redis-prefix", prefix,
                "--worker-id", f"w{i}", "--metrics-port", str(metrics),
                "--max-loras", str(args.max_loras), "--adapter-store", str(store), "--no-warmup",
            ]  # fmt: skip
            self.processes.append(subprocess.Popen(command, stdout=subprocess.DEVNULL))
            self.ports.append(port)
            self.metrics.append(metrics)
        self.channels = [grpc.aio.insecure_channel(f"127.0.0.1:{p}") for p in self.ports]
        self.stubs = {f"w{i}": worker_pb2_grpc.WorkerStub(c) for i, c in enumerate(self.channels)}

    async def wait_ready(self, redis: aioredis.Redis, prefix: str, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(p.poll() is None for p in self.processes) and len(
                await redis.smembers(f"{prefix}workers")
            ) == len(self.processes):
                return
            await asyncio.sleep(0.5)
        raise TimeoutError("the workers did not register")

    def counters(self) -> dict[str, tuple[int, int]]:
        """Each worker's (store -> worker adapter loads, slot refills)."""
        out = {}
        for i, port in enumerate(self.metrics):
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
            loads = _sample(text, r'switchboard_worker_adapter_loads_total\{outcome="ok"\}')
            refills = _sample(text, r'switchboard_worker_adapter_evictions_total\{tier="slot"\}')
            out[f"w{i}"] = (int(loads), int(refills))
        return out

    async def close(self) -> None:
        for channel in self.channels:
            await channel.close()
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            reap(process, 15)


def _sample(text: str, name: str) -> float:
    match = re.search(rf"^{name} ([0-9.e+]+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


async def run_policy(policy, trace, ids, pool: Pool, directory: WorkerDirectory, args):
    before = pool.counters()
    log: list[tuple[int, str]] = []  # (adapter, worker) in arrival order
    rows: dict[int, list] = {}  # by arrival: see PolicyResult.rows
    routed_as: dict[int, int] = {}  # by arrival: its place in the log
    in_flight: dict[str, int] = dict.fromkeys(pool.stubs, 0)
    turn = itertools.count()
    ttfts: list[float] = []
    tokens = 0
    params = worker_pb2.SamplingParams(max_tokens=args.output_tokens, temperature=0,
                                       ignore_eos=True, n=1)  # fmt: skip

    async def choose(adapter_id: str, prompt: list[int]) -> str:
        """The gateway's routing stage without its fair queue: the directory's ranking
        (registry load plus what it sent since each worker's last heartbeat), the request's
        prefix key."""
        if policy == "round_robin":
            return sorted(pool.stubs)[next(turn) % len(pool.stubs)]
        if policy == "affinity":
            key = prefix_affinity_key(tenant="bench", adapter_id=adapter_id, prompt_ids=prompt)
            ranked = await directory.candidates(adapter_id=adapter_id, affinity_key=key)
        else:
            ranked = await directory.candidates(adapter_id=None)
        directory.sent(ranked[0].worker_id)
        return ranked[0].worker_id

    async def one(i: int, arrival: Arrival) -> None:
        nonlocal tokens
        adapter_id = ids[arrival.adapter]
        worker_id = await choose(adapter_id, arrival.prompt)
        routed_as[i] = len(log)
        log.append((arrival.adapter, worker_id))
        least = min(in_flight.values())
        in_flight[worker_id] += 1
        rows[i] = [arrival.adapter, worker_id, 0.0, in_flight[worker_id], least]
        sent = time.perf_counter()
        request = worker_pb2.GenerateRequest(
            request_id=f"{policy}-{i}", prompt_token_ids=arrival.prompt, params=params,
            adapter_id=adapter_id, tenant="bench",
        )  # fmt: skip
        first = None
        async for message in pool.stubs[worker_id].Generate(request):
            first = first or time.perf_counter()
            tokens += len(message.token_ids)
        ttfts.append((first or time.perf_counter()) - sent)
        in_flight[worker_id] -= 1
        rows[i][2] = round(1e3 * ttfts[-1], 1)

    started = time.perf_counter()
    tasks = []
    for i, arrival in enumerate(trace):
        delay = started + arrival.at_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i, arrival)))
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - started
    await asyncio.sleep(2 * 2.0)  # two heartbeats: the metrics and registry settle
    after = pool.counters()
    by_worker = {w: [after[w][k] - before[w][k] for k in (0, 1)] for w in sorted(after)}
    loads = sum(c[0] for c in by_worker.values())
    refills = sum(c[1] for c in by_worker.values())
    ttft_ms = np.array(ttfts) * 1e3
    modelled = replay(log, args.max_loras)
    table = [rows[i] + [modelled.loaded[routed_as[i]]] for i in range(len(trace))]
    order = sorted(range(len(table)), key=lambda i: -table[i][2])
    by_load = {}
    for name, flag in (("filled a slot", True), ("resident", False)):
        picked = np.array([r[2] for r in table if r[5] == flag] or [0.0])
        by_load[name] = [
            sum(r[5] == flag for r in table),
            float(np.percentile(picked, 50)),
            float(np.percentile(picked, 99)),
        ]
    return PolicyResult(
        policy=policy, requests=len(trace), adapter_loads=loads + refills, store_loads=loads,
        slot_refills=refills, loads_per_1k=1000 * (loads + refills) / len(trace),
        ttft_p50_ms=float(np.percentile(ttft_ms, 50)),
        ttft_p99_ms=float(np.percentile(ttft_ms, 99)),
        throughput_tok_s=tokens / elapsed, elapsed_s=elapsed, by_worker=by_worker,
        requests_by_worker={w: sum(1 for _, v in log if v == w) for w in sorted(pool.stubs)},
        model=breakdown(modelled, len(trace)), rows=table,
        slowest=[[i, *table[i]] for i in order[:5]], ttft_by_load=by_load,
    )  # fmt: skip


async def run(args) -> dict:
    from worker.model.tiny_families import make_servable_checkpoint

    work = Path(tempfile.mkdtemp(prefix="bench-routing-"))
    model = make_servable_checkpoint(work / "tiny-qwen3", "qwen3")
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    spec = BaseModelSpec.from_config_dict(json.loads((model / "config.json").read_text()))
    store = FilesystemAdapterStore(work / "store")
    ids = [
        store.put(load_adapter_dir(p, base=spec, max_lora_rank=64, max_bytes=256 << 20))
        for p in write_adapters(model, work / "peft", args.adapters)
    ]
    trace = make_trace(args, vocab)
    embedded = None
    redis_url = reachable_redis()
    if redis_url is None:
        embedded = EmbeddedRedis().start()
        redis_url = embedded.url
    redis = aioredis.Redis.from_url(redis_url, decode_responses=True)
    results = []
    try:
        for policy in POLICIES:
            prefix = f"bench-routing:{time.time_ns()}:"
            pool = Pool(args, model, work / "store", redis_url, prefix)
            try:
                await pool.wait_ready(redis, prefix)
                directory = WorkerDirectory(
                    redis=redis, prefix=prefix, model_names=frozenset({model.name}),
                    heartbeat_ttl_s=10.0, cache_s=0.5, load_factor=args.load_factor,
                    load_slack=args.load_slack,
                )  # fmt: skip
                results.append(await run_policy(policy, trace, ids, pool, directory, args))
            finally:
                await pool.close()
    finally:
        await redis.aclose()
        if embedded is not None:
            embedded.stop()
    by = {r.policy: r for r in results}
    affinity, least = by["affinity"], by["least_load"]
    return {
        "config": vars(args),
        "results": [asdict(r) for r in results],
        "trace_bounds": trace_bounds(trace, args, least.adapter_loads),
        "ratios": {
            "loads_least_load_over_affinity": least.adapter_loads / max(1, affinity.adapter_loads),
            "ttft_p99_affinity_over_least_load": affinity.ttft_p99_ms / least.ttft_p99_ms,
            "throughput_affinity_over_least_load": affinity.throughput_tok_s
            / least.throughput_tok_s,
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--max-loras", type=int, default=4)
    parser.add_argument("--adapters", type=int, default=32)
    parser.add_argument("--requests", type=int, default=240)
    parser.add_argument("--rate", type=float, default=3.0, help="arrivals per second")
    parser.add_argument("--zipf", type=float, default=1.1)
    parser.add_argument("--output-tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    # The gateway's SWITCHBOARD_ROUTE_LOAD_FACTOR / _SLACK: how far past the least loaded
    # worker a resident adapter's worker may be and still be preferred.
    parser.add_argument("--load-factor", type=float, default=1.5)
    parser.add_argument("--load-slack", type=int, default=4)
    parser.add_argument("--out", default="bench/results/routing.json")
    args = parser.parse_args()
    report = asyncio.run(run(args))
    for r in report["results"]:
        print(
            f"{r['policy']:>12}: {r['loads_per_1k']:7.1f} loads/1k req "
            f"({r['store_loads']} from the store, {r['slot_refills']} slot refills), "
            f"TTFT p50 {r['ttft_p50_ms']:.1f} ms p99 {r['ttft_p99_ms']:.1f} ms, "
            f"{r['throughput_tok_s']:.1f} tok/s"
        )
        m = r["model"]
        print(
            f"{'':>12}  per worker (store, refills) {r['by_worker']}, requests "
            f"{r['requests_by_worker']}; replay {m['loads_per_1k']:.1f}/1k, by popularity "
            f"{m['by_popularity']}, by quarter {m['per_1k_by_quarter']}"
        )
        print(
            f"{'':>12}  slowest [i, adapter, worker, TTFT ms, in flight, least in flight, "
            f"filled a slot] "
            f"{r['slowest']}; TTFT [n, p50, p99] by load {r['ttft_by_load']}"
        )
    print(json.dumps(report["trace_bounds"], indent=2))
    print(json.dumps(report["ratios"], indent=2))
    write_report(report, args.out)


if __name__ == "__main__":
    main()
