"""Tensor parallelism on CPU: two ranks (this process and a child) over gloo, against one.

The oracle is the engine on one rank, in fp32: greedy tokens must be the same for Llama
(tied embeddings, a vocabulary the group does not divide) and Qwen2 (untied, q/k/v biases),
both with GQA, over a batch that mixes base rows with adapters of different ranks and target
modules (more adapters than slots), chunked prefill, preemption (swap on one, recompute on
the other), prefix-cache hits, n > 1 and, on Qwen2, a draft model speculating on rank 0.
"""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass

import grpc
import psutil
import pytest
import torch
from redis.asyncio import Redis

from factories import (
    add_byte_level_tokenizer,
    assert_no_block_leaks,
    drain,
    make_checkpoint,
    make_peft_adapter,
    make_perturbed_checkpoint,
    random_prompts,
)
from rpc import worker_pb2, worker_pb2_grpc
from runtime import registry
from worker import LLM, SamplingParams
from worker.errors import TensorParallelConfigError

ENGINE = dict(
    dtype="float32",
    block_size=4,
    num_kv_blocks=28,  # 112 tokens: the mixed batch below preempts
    max_num_seqs=6,
    max_num_batched_tokens=32,  # prompts up to 60 tokens prefill in chunks
    max_loras=2,  # three adapters in the batch: slots are refilled
    max_lora_rank=16,
)
CASES = {
    "llama": (
        dict(arch="llama", tie_word_embeddings=True, num_heads=4, num_kv_heads=2, vocab_size=251),
        dict(preemption_mode="swap", num_host_blocks=64),
    ),
    "qwen2": (
        dict(arch="qwen2", tie_word_embeddings=False, num_heads=8, num_kv_heads=2),
        dict(preemption_mode="recompute"),
    ),
}
ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class Case:
    vocab_size: int
    one: LLM  # the oracle: one rank
    two: LLM  # tensor_parallel_size=2


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    checkpoint_options, engine_options = CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    base = make_checkpoint(root / "base", seed=11, **checkpoint_options)
    adapters = {
        "r3": make_peft_adapter(base, root / "r3", rank=3, targets=ALL_MODULES, seed=1),
        "r8": make_peft_adapter(base, root / "r8", rank=8, targets=["q_proj", "v_proj"], seed=2),
        "r16": make_peft_adapter(
            base, root / "r16", rank=16, targets=["o_proj", "gate_proj", "down_proj"], seed=3
        ),
    }
    speculation = {}
    if request.param == "qwen2":
        draft = make_perturbed_checkpoint(base, root / "draft", noise=0.1)
        speculation = dict(
            speculative_model=str(draft),
            num_speculative_tokens=3,
            speculative_position_cost=0.0,
            speculative_draft_cost=0.0,
            speculative_draft_quantization="none",
        )
    one = LLM(base, **ENGINE, **engine_options)
    two = LLM(base, **ENGINE, **engine_options, **speculation, tensor_parallel_size=2)
    for llm in (one, two):
        for name, path in adapters.items():
            llm.load_adapter(name, path)
    yield Case(checkpoint_options.get("vocab_size", 256), one, two)
    two.shutdown()


def greedy(max_tokens: int = 16) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def test_a_mixed_batch_with_chunked_prefill_and_preemption_matches_one_rank(case):
    prompts = random_prompts(6, min_len=4, max_len=60, vocab=case.vocab_size, seed=1)
    adapters = [None, "r8", "r3", None, "r16", "r3"]
    outputs = {}
    for name, llm in (("one", case.one), ("two", case.two)):
        before = llm.engine.scheduler.num_preemptions
        outputs[name] = [o.token_ids for o in llm.generate(prompts, greedy(), adapters=adapters)]
        assert llm.engine.scheduler.num_preemptions > before
        assert_no_block_leaks(llm.engine)
    assert outputs["two"] == outputs["one"]
    stats = case.two.engine.spec_decode_stats
    assert stats is None or stats.num_proposed > 0  # qwen2: the draft ran on rank 0


def test_prefix_hits_match_one_rank(case):
    shared = random_prompts(1, min_len=24, max_len=24, vocab=case.vocab_size, seed=2)[0]
    tails = random_prompts(3, min_len=3, max_len=9, vocab=case.vocab_size, seed=3)
    runs = {}
    for name, llm in (("one", case.one), ("two", case.two)):
        llm.engine.reset_prefix_cache()
        first = llm.generate([shared + tails[0]], greedy(), adapters=["r3"])
        later = llm.generate([shared + t for t in tails[1:]], greedy(), adapters=["r3", "r3"])
        runs[name] = [(o.token_ids, o.num_cached_tokens) for o in first + later]
    assert runs["two"] == runs["one"]
    assert all(cached >= 20 for _, cached in runs["two"][1:])


def test_n_samples_match_one_rank(case):
    prompt = random_prompts(1, min_len=10, max_len=10, vocab=case.vocab_size, seed=4)[0]
    tokens = {}
    for name, llm in (("one", case.one), ("two", case.two)):
        engine = llm.engine
        engine.add_samples(["a", "b", "c"], prompt, [greedy(12)] * 3, adapter="r16")
        tokens[name] = {rid: out.token_ids for rid, out in drain(engine).items()}
        assert_no_block_leaks(engine)
    assert tokens["two"] == tokens["one"]


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="NCCL needs a GPU per rank: two GPUs",
)
def test_two_gpus_over_nccl_match_one(tmp_path):
    base = make_checkpoint(tmp_path / "base", num_heads=4, num_kv_heads=2, vocab_size=251)
    adapter = make_peft_adapter(base, tmp_path / "r3", rank=3, targets=ALL_MODULES, seed=1)
    prompts = random_prompts(4, min_len=4, max_len=60, vocab=251, seed=1)
    options = dict(ENGINE, device="cuda")
    tokens = {}
    for size in (1, 2):
        llm = LLM(base, **options, tensor_parallel_size=size)
        llm.load_adapter("r3", adapter)
        tokens[size] = [
            o.token_ids for o in llm.generate(prompts, greedy(), adapters=["r3", None] * 2)
        ]
        llm.shutdown()
    assert tokens[2] == tokens[1]


def test_a_head_count_the_group_does_not_divide_is_refused(tmp_path):
    base = make_checkpoint(tmp_path, num_heads=6, num_kv_heads=3, hidden_size=48)
    with pytest.raises(TensorParallelConfigError, match="num_key_value_heads=3"):
        LLM(base, dtype="float32", num_kv_blocks=8, tensor_parallel_size=2)


# --- the worker: gRPC end to end, and a rank that dies --------------------------------------


async def test_a_two_rank_worker_serves_over_grpc_and_exits_when_a_rank_dies(
    tmp_path, redis_url, redis_prefix
):
    """The CLI worker with --tensor-parallel-size 2 streams what one rank generates; when
    its other rank is killed, a stream in flight ends UNAVAILABLE (the gateway's cue to try
    another worker), the worker leaves the registry and exits non-zero."""
    base = add_byte_level_tokenizer(make_checkpoint(tmp_path / "base", vocab_size=512, seed=3))
    prompt = [5, 17, 99, 230, 41, 8]
    offline = LLM(base, dtype="float32", num_kv_blocks=64)
    expected = offline.generate(prompt, greedy(8))[0].token_ids
    redis = Redis.from_url(redis_url)
    command = [
        sys.executable, "-c", "from switchboard.cli import main; raise SystemExit(main())",
        "worker", "--model", str(base), "--port", "0", "--dtype", "float32",
        "--redis-url", redis_url, "--redis-prefix", redis_prefix, "--worker-id", "tp",
        "--kv-cache-memory-gb", "0.01", "--max-loras", "1", "--tensor-parallel-size", "2",
        "--metrics-port", "-1",
    ]  # fmt: skip
    process = await asyncio.create_subprocess_exec(*command, stdout=asyncio.subprocess.PIPE)
    try:
        line = await asyncio.wait_for(process.stdout.readline(), 120.0)
        address = line.decode().split()[-1]
        [info] = await registry.live_workers(redis, redis_prefix)
        assert info.worker_id == "tp"
        async with grpc.aio.insecure_channel(address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            messages = [m async for m in stub.Generate(generate_request(prompt, 8))]
            assert [t for m in messages for t in m.token_ids] == expected

            long_stream = stub.Generate(generate_request(prompt, 900))
            await long_stream.read()  # the first token: it runs
            [rank_one] = [
                child
                for child in psutil.Process(process.pid).children()
                if "worker.parallel.follower" in child.cmdline()
            ]
            rank_one.kill()
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                while await long_stream.read() is not grpc.aio.EOF:
                    pass
            assert failed.value.code() == grpc.StatusCode.UNAVAILABLE

        assert await asyncio.wait_for(process.wait(), 30.0) == 1
        assert await registry.live_workers(redis, redis_prefix) == []
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        await redis.aclose()


def generate_request(prompt: list[int], max_tokens: int) -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(
        request_id=f"r{max_tokens}",
        prompt_token_ids=prompt,
        params=worker_pb2.SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True, skip_special_tokens=True
        ),
    )
