"""The engine's attention backends: the Triton kernels (compiled on a GPU, in the interpreter
on CPU) give the torch path's greedy tokens, and the backend is chosen or refused clearly."""

import os

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import triton.language as tl  # noqa: E402

from factories import (  # noqa: E402
    make_checkpoint,
    make_peft_adapter,
    make_perturbed_checkpoint,
    random_prompts,
)
from worker import LLM, SamplingParams  # noqa: E402
from worker.core.config import EngineConfig, engine_config  # noqa: E402
from worker.engine.placement import resolve_attention_backend, resolve_cuda_graphs  # noqa: E402
from worker.errors import InvalidRequestError  # noqa: E402
from worker.model.cuda_graphs import DecodeGraphs, bucket_for  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
QV, DOWN = ["q_proj", "v_proj"], ["down_proj"]
needs_triton = pytest.mark.skipif(
    not CUDA and type(tl.zeros).__name__ != "InterpretedFunction",
    reason="the Triton kernels on CPU need TRITON_INTERPRET=1 before triton is imported",
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """Three query heads per KV head, as in the default model."""
    return make_checkpoint(
        tmp_path_factory.mktemp("backend"), num_heads=6, num_kv_heads=2, hidden_size=96, seed=3
    )


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def tokens(llm: LLM, prompts, max_tokens: int) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, greedy(max_tokens))]


@needs_triton
def test_triton_gives_the_torch_backends_tokens(checkpoint):
    """Short prompts (the decode launch) and long ones (prefill tiles) in chunks of at most
    16 tokens, so later chunks attend cached context; the last prompt shares 20 tokens of
    the second and hits the prefix cache in the second call."""
    prompts = random_prompts(3, min_len=2, max_len=40, seed=7)  # 8, 27 and 6 tokens
    prompts.append(random_prompts(1, min_len=36, max_len=36, seed=9)[0])
    prompts.append([*prompts[1][:20], 5, 6, 7])  # five blocks of prompt 1, then its own
    options = dict(
        dtype="float32", device=DEVICE, block_size=4, num_kv_blocks=96, max_num_batched_tokens=16
    )
    torch_llm = LLM(checkpoint, attention_backend="torch", **options)
    triton_llm = LLM(checkpoint, attention_backend="triton", **options)
    assert triton_llm.engine.runner.triton_attention
    want = tokens(torch_llm, prompts, 4)
    assert tokens(triton_llm, prompts, 4) == want
    hits = triton_llm.engine.block_manager.stats.hits
    assert tokens(triton_llm, prompts[4:], 4) == want[4:]
    assert triton_llm.engine.block_manager.stats.hits >= hits + 20


@needs_triton
def test_triton_verifies_drafts_as_the_torch_backend_does(checkpoint, tmp_path):
    """k + 1 verification rows and a draft model's runner-up rows (off their chain)."""
    draft = make_perturbed_checkpoint(checkpoint, tmp_path / "draft", noise=0.05)
    options = dict(
        dtype="float32",
        device=DEVICE,
        num_kv_blocks=64,
        speculative_model=str(draft),
        num_speculative_tokens=3,
        speculative_min_acceptance=0.0,
        speculative_position_cost=0.0,
        speculative_draft_cost=0.0,
    )
    prompts = random_prompts(2, min_len=3, max_len=10, seed=8)
    want = tokens(LLM(checkpoint, attention_backend="torch", **options), prompts, 8)
    spec = LLM(checkpoint, attention_backend="triton", **options)
    assert tokens(spec, prompts, 8) == want
    stats = spec.engine.spec_decode_stats
    assert stats.num_proposed > 0 and stats.num_alternatives > 0


@needs_triton
def test_padded_decode_passes_give_the_same_tokens(checkpoint, tmp_path):
    """The CUDA-graph path: decode steps copied into static buffers padded to a bucket (8,
    then 4, 2, 1 as requests finish), LoRA as BGMV over a static slot buffer, base rows and
    two adapters with different targets; captured on a GPU, run as it is on CPU."""
    adapters = {
        "qv": make_peft_adapter(checkpoint, tmp_path / "qv", rank=4, targets=QV, seed=1),
        "down": make_peft_adapter(checkpoint, tmp_path / "down", rank=8, targets=DOWN, seed=2),
    }
    prompts = random_prompts(5, min_len=2, max_len=12, seed=4)
    names = [None, "qv", "down", None, "qv"]
    params = [greedy(n) for n in (2, 5, 3, 4, 2)]
    options = dict(dtype="float32", device=DEVICE, block_size=4, num_kv_blocks=64, max_loras=2)

    def generate(llm: LLM) -> list[list[int]]:
        for name, path in adapters.items():
            llm.load_adapter(name, path)
        return [o.token_ids for o in llm.generate(prompts, params, adapters=names)]

    want = generate(LLM(checkpoint, attention_backend="torch", **options))
    llm = LLM(checkpoint, attention_backend="triton", cuda_graphs=False, **options)
    runner = llm.engine.runner
    runner.graphs = graphs = DecodeGraphs(
        runner.model, runner.kv_caches, max_batch=8, max_blocks=16, block_size=4, capture=CUDA
    )
    assert generate(llm) == want
    assert graphs.num_replays == 4 and {key[0] for key in graphs.graphs} == {8, 4, 2, 1}
    assert [bucket_for(n) for n in (1, 3, 5, 17, 100, 513)] == [1, 4, 8, 24, 128, None]


def test_backend_is_chosen_by_device_and_refused_clearly(monkeypatch):
    from switchboard.cli import build_parser
    from switchboard.worker_command import worker_engine_kwargs

    flags = build_parser().parse_args(["worker", "--attention-backend", "torch"])
    assert engine_config(**worker_engine_kwargs(flags)).attention_backend == "torch"
    assert EngineConfig().attention_backend is None
    cpu = torch.device("cpu")
    assert resolve_attention_backend(None, cpu) == "torch"
    assert resolve_attention_backend("torch", cpu) == "torch"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(InvalidRequestError, match="only in Triton's interpreter"):
        resolve_attention_backend("triton", cpu)
    with pytest.raises(InvalidRequestError, match="attention_backend must be one of"):
        EngineConfig(attention_backend="flash")
    assert not resolve_cuda_graphs(None, cpu, "triton", 1)
    with pytest.raises(InvalidRequestError, match="cuda_graphs needs device 'cuda'"):
        resolve_cuda_graphs(True, cpu, "triton", 1)
    if CUDA:
        cuda = torch.device("cuda")
        assert resolve_attention_backend(None, cuda) == "triton"
        assert resolve_cuda_graphs(None, cuda, "triton", 1)
        assert not resolve_cuda_graphs(None, cuda, "triton", 2)
