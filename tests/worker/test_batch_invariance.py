"""Batch invariance (``batch_invariant=True``): a request's logits, bit for bit, are the same
run alone as inside busy mixed batches (other tenants and adapters, prefills chunked beside
decodes, preemption) and over a cached prefix (its own prompt again; a second turn over the
first turn's prompt and answer), on the CPU path in bf16 and fp32. The reference is the same
request alone in an engine without prefix caching; the invariant engine's greedy tokens are
also checked against transformers."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from transformers import GenerationConfig

from factories import load_hf_model, make_checkpoint, make_peft_adapter, random_prompts
from worker import SamplingParams
from worker.core.config import engine_config
from worker.engine.llm_engine import LLMEngine
from worker.errors import InvalidRequestError

MAX_NEW = 10
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {"a": 4, "b": 8, "c": 2}  # name -> rank
# The requests watched: prompts of 3 to 40 tokens (several blocks of 16), on the base model
# and on each adapter.
VICTIM_ADAPTERS = [None, "a", "b", None, "c", "a"]

Logits = dict[str, list[torch.Tensor]]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("base"), seed=5)


@pytest.fixture(scope="module")
def adapter_dirs(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: make_peft_adapter(base, root / name, rank=rank, targets=ALL, seed=i)
        for i, (name, rank) in enumerate(ADAPTERS.items())
    }


def greedy(max_tokens: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def make_engine(base, adapter_dirs, dtype: str, *, invariant: bool, **options) -> LLMEngine:
    engine = LLMEngine(
        base,
        engine_config(dtype=dtype, max_loras=4, batch_invariant=invariant, **options),
    )
    for name, path in adapter_dirs.items():
        engine.load_adapter(name, path)
    return engine


def recorded(engine: LLMEngine) -> Logits:
    """Each request's logits rows, in step order, as the runner hands them to the sampler."""
    rows: Logits = defaultdict(list)
    execute = engine.runner.execute

    def recording(scheduled, **options):
        sampling, logits = execute(scheduled, **options)
        for s, row in zip(sampling, logits, strict=True):
            rows[s.seq.request_id].append(row.clone())
        return sampling, logits

    engine.runner.execute = recording
    return rows


def run(engine: LLMEngine, waves: list[list[tuple]], *, steps_between: int = 2) -> dict:
    """Add each wave of (id, prompt, adapter, tenant, max_tokens), ``steps_between`` steps
    apart, then step until every request finished; returns each request's tokens."""
    tokens: dict[str, list[int]] = {}
    pending = sum(len(w) for w in waves)
    for i, wave in enumerate(waves):
        for request_id, prompt, adapter, tenant, max_tokens in wave:
            engine.add_request(
                request_id, prompt, greedy(max_tokens), adapter=adapter, tenant=tenant
            )
        for _ in range(steps_between if i + 1 < len(waves) else 0):
            for out in engine.step():
                if out.finished:
                    tokens[out.request_id] = out.token_ids
    while len(tokens) < pending:
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.token_ids
    return tokens


def victims() -> list[tuple[list[int], str | None]]:
    prompts = random_prompts(len(VICTIM_ADAPTERS), min_len=3, max_len=40, seed=7)
    return list(zip(prompts, VICTIM_ADAPTERS, strict=True))


def noise(count: int, seed: int) -> list[tuple]:
    """Other tenants' requests on every adapter and the base model, longer prompts and
    answers than the victims'."""
    prompts = random_prompts(count, min_len=5, max_len=60, seed=seed)
    # The adapters first asked for in the other order: each then sits in another slot than
    # when its victim runs alone.
    names = [None, *reversed(ADAPTERS)]
    return [
        (f"noise-{seed}-{i}", p, names[i % len(names)], f"tenant-{i % 3}", 6 + 3 * (i % 4))
        for i, p in enumerate(prompts)
    ]


def alone(base, adapter_dirs, dtype, invariant, requests) -> tuple[Logits, dict]:
    """Each request alone, in an engine without prefix caching."""
    engine = make_engine(
        base, adapter_dirs, dtype, invariant=invariant, enable_prefix_caching=False
    )
    rows = recorded(engine)
    tokens = {}
    for request_id, prompt, adapter in requests:
        tokens |= run(engine, [[(request_id, prompt, adapter, "victim", MAX_NEW)]])
    return rows, tokens


def busy(base, adapter_dirs, dtype, invariant) -> tuple[Logits, dict, int]:
    """The victims arriving one by one among other tenants' traffic: small chunks, so prompts
    are cut and share steps with decodes, and a small KV pool, so sequences are preempted."""
    engine = make_engine(
        base,
        adapter_dirs,
        dtype,
        invariant=invariant,
        max_num_batched_tokens=24,
        num_kv_blocks=14,
        block_size=16,
    )
    rows = recorded(engine)
    traffic = noise(10, seed=11)
    waves = [traffic[:4]]
    for i, (prompt, adapter) in enumerate(victims()):
        waves.append([(f"victim-{i}", prompt, adapter, "victim", MAX_NEW), traffic[4 + i]])
    tokens = run(engine, waves)
    return rows, tokens, engine.scheduler.num_preemptions


def cached(base, adapter_dirs, dtype, invariant, first: dict) -> tuple[Logits, dict]:
    """Each victim twice (the second over its cached prompt), then a second turn over the
    first turn's prompt and answer, beside other traffic."""
    engine = make_engine(base, adapter_dirs, dtype, invariant=invariant)
    rows = recorded(engine)
    tokens = {}
    for i, (prompt, adapter) in enumerate(victims()):
        tokens |= run(engine, [[(f"warm-{i}", prompt, adapter, "victim", MAX_NEW)]])
        tokens |= run(engine, [[(f"victim-{i}", prompt, adapter, "victim", MAX_NEW)]])
    turns = [(*turn, "victim", MAX_NEW) for turn in second_turns(first)]
    tokens |= run(engine, [noise(3, seed=13), turns])
    return rows, tokens


def second_turns(first: dict) -> list[tuple]:
    """(id, prompt, adapter) of each victim's second turn: its prompt, answer and three more."""
    return [
        (f"turn-{i}", prompt + first[f"victim-{i}"] + [5, 6, 7], adapter)
        for i, (prompt, adapter) in enumerate(victims())
    ]


def identical(reference: Logits, other: Logits, ids: list[str]) -> tuple[int, int]:
    """(rows bit-identical to the reference, rows compared) over the requests ``ids``."""
    same = total = 0
    for request_id in ids:
        want, got = reference[request_id], other[request_id]
        total += len(want)
        same += sum(torch.equal(w, g) for w, g in zip(want, got, strict=False))
    return same, total


def invariance(base, adapter_dirs, dtype: str, invariant: bool) -> dict[str, tuple[int, int]]:
    """Identical rows over all rows, busy and cached, against each request alone."""
    solo = [(f"victim-{i}", p, a) for i, (p, a) in enumerate(victims())]
    reference, first = alone(base, adapter_dirs, dtype, invariant, solo)
    turn_rows, _ = alone(base, adapter_dirs, dtype, invariant, second_turns(first))
    reference |= turn_rows
    busy_rows, _, preemptions = busy(base, adapter_dirs, dtype, invariant)
    assert preemptions > 0, "the busy run was meant to preempt"
    cached_rows, _ = cached(base, adapter_dirs, dtype, invariant, first)
    victim_ids = [request_id for request_id, _, _ in solo]
    turn_ids = [f"turn-{i}" for i in range(len(solo))]
    return {
        "busy": identical(reference, busy_rows, victim_ids),
        "cached prompt": identical(reference, cached_rows, victim_ids),
        "second turn": identical(reference, cached_rows, turn_ids),
    }


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_logits_do_not_depend_on_the_batch_or_the_cache(base, adapter_dirs, dtype):
    found = invariance(base, adapter_dirs, dtype, invariant=True)
    for case, (same, total) in found.items():
        assert total == len(VICTIM_ADAPTERS) * MAX_NEW, case
        assert same == total, f"{case}: {same} of {total} logits rows identical"


def test_invariant_engine_matches_transformers(base):
    """The invariant paths (panels in one order, prefill rows through the native attention
    kernel) compute the model: greedy tokens as transformers' in fp32."""
    prompts = random_prompts(4, min_len=3, max_len=40, seed=3)
    hf = load_hf_model(base)
    config = GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0)
    hf.generation_config.eos_token_id = None
    expected = [
        hf.generate(input_ids=torch.tensor([p]), generation_config=config)[0, len(p) :].tolist()
        for p in prompts
    ]
    engine = LLMEngine(base, engine_config(dtype="float32", batch_invariant=True))
    waves = [[(f"r{i}", p, None, None, MAX_NEW) for i, p in enumerate(prompts)]]
    tokens = run(engine, waves)
    assert [tokens[f"r{i}"] for i in range(len(prompts))] == expected


def test_batch_invariant_refused_where_it_cannot_hold(base):
    with pytest.raises(InvalidRequestError, match="batch_invariant"):
        LLMEngine(
            base, engine_config(dtype="float32", batch_invariant=True, attention_backend="triton")
        )


def test_the_worker_flag_turns_it_on():
    from switchboard.cli import build_parser
    from switchboard.worker_command import worker_engine_kwargs

    def config(*flags: str):
        return engine_config(**worker_engine_kwargs(build_parser().parse_args(["worker", *flags])))

    assert config("--batch-invariant").batch_invariant
    assert not config().batch_invariant
