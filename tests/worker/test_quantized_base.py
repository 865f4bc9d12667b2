"""A base quantized on load (``quantization="int4"|"int8"``) against transformers + peft running
the same checkpoint with its projections replaced by the dequantized weights (fp32 compute on
both sides): greedy tokens identical for mixed batches of base rows, LoRA, DoRA, a weighted mix,
a saved lm_head copy (``modules_to_save``) and expert LoRA, on a Llama-like family (int4 in
groups, untied head), Qwen2 (int8 per channel, q/k/v biases) and Qwen3-MoE (int4 experts);
then prefix hits, speculation, structured outputs and two tensor-parallel ranks over a quantized
base, the flags, and what is refused."""

from __future__ import annotations

import pytest
import torch
from moe_factories import EXPERT_PARAMETERS, make_expert_adapter, make_moe_checkpoint
from peft import PeftModel
from transformers import GenerationConfig

from factories import load_hf_model, make_checkpoint, make_peft_adapter, random_prompts
from switchboard_kernels.quantized_weight import quantize
from switchboard_kernels.wq_native import WqLinear, native_wq
from worker import LLM, SamplingParams
from worker.errors import InvalidRequestError, ModelLoadError

MAX_NEW = 10
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PRESSURE = {"block_size": 4, "num_kv_blocks": 40, "max_num_batched_tokens": 48}
MIX = [("plain", 0.7), ("attn", 0.3)]  # PEFT's add_weighted_adapter(..., "cat")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")

# name: (family, quantization, group size (None: the default), adapters, assignment)
CASES = {
    "llama-int4": (
        "llama",
        "int4",
        None,
        {
            "plain": {"rank": 4, "targets": ALL},
            "dora": {"rank": 4, "targets": ALL, "use_dora": True},
            "attn": {"rank": 2, "targets": ["q_proj", "v_proj"]},
            "head": {"rank": 2, "targets": ["o_proj"], "modules_to_save": ["lm_head"]},
        },
        [None, "plain", "dora", "attn", "mix", "head", None],
    ),
    "qwen2-int8": (
        "qwen2",
        "int8",
        None,
        {
            "plain": {"rank": 4, "targets": ALL},
            "dora": {"rank": 2, "targets": ALL, "use_dora": True},
        },
        [None, "plain", "dora", "plain", None, "dora"],
    ),
    "qwen3_moe-int4": (
        "qwen3_moe", "int4", 32, {}, [None, "experts", "attn", None, "experts", "attn"]
    ),
}  # fmt: skip


def dequantized_reference(base, bits: int, group: int | None, symmetric: bool):
    """transformers' model of ``base`` with every projection (each expert's too) replaced by its
    round-to-nearest levels dequantized: the weights the quantized engine multiplies by."""
    hf = load_hf_model(base)

    def rtn(w: torch.Tensor) -> torch.Tensor:  # [out, in]
        g = w.shape[1] if group is None else group
        q = quantize(
            w, bits=bits, group_size=g, symmetric=symmetric, integer_zero=False, fp16_params=True
        )
        return q.dequantize()

    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith(tuple(f"{p}.weight" for p in PROJECTIONS)):
                param.copy_(rtn(param))
            elif name.endswith(EXPERTS):  # [E, out, in] in transformers 5
                for e in range(param.shape[0]):
                    param[e] = rtn(param[e])
    hf.generation_config.eos_token_id = None
    return hf


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    name = request.param
    family, method, group, specs, assignment = CASES[name]
    root = tmp_path_factory.mktemp(name)
    if family == "qwen3_moe":
        base = make_moe_checkpoint(root / "base", family, seed=3)
        adapters = {
            "attn": make_peft_adapter(base, root / "attn", rank=4, targets=["q_proj", "o_proj"]),
            "experts": make_expert_adapter(
                base, root / "experts", rank=4, targets=["v_proj"], parameters=EXPERT_PARAMETERS,
                seed=1,
            ),
        }  # fmt: skip
    else:
        base = make_checkpoint(root / "base", arch=family, seed=5, tie_word_embeddings=False)
        adapters = {
            n: make_peft_adapter(base, root / n, seed=40 + i, **spec)
            for i, (n, spec) in enumerate(specs.items())
        }
    prompts = random_prompts(len(assignment), min_len=6, max_len=24, seed=7)
    bits, symmetric = (4, False) if method == "int4" else (8, True)
    effective_group = 32 if (method == "int4" and group is None) else group
    config = GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0)

    def greedy(model, prompt):
        out = model.generate(input_ids=torch.tensor([prompt]), generation_config=config)
        return out[0, len(prompt) :].tolist()

    reference = dequantized_reference(base, bits, effective_group, symmetric)
    models = {None: reference}
    for n, path in adapters.items():  # one adapter per model (peft's target_parameters rule)
        models[n] = PeftModel.from_pretrained(
            dequantized_reference(base, bits, effective_group, symmetric), path
        ).eval()
    if "mix" in assignment:
        mixed = PeftModel.from_pretrained(
            dequantized_reference(base, bits, effective_group, symmetric),
            adapters["plain"],
            adapter_name="plain",
        )
        mixed.load_adapter(adapters["attn"], adapter_name="attn")
        names, weights = zip(*MIX, strict=True)
        mixed.add_weighted_adapter(list(names), list(weights), "mix", combination_type="cat")
        mixed.set_adapter("mix")
        models["mix"] = mixed.eval()
    expected = [greedy(models[a], p) for p, a in zip(prompts, assignment, strict=True)]
    unquantized = load_hf_model(base)
    unquantized.generation_config.eos_token_id = None
    plain = [greedy(unquantized, p) for p in prompts]
    return name, base, adapters, prompts, assignment, expected, plain


def params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
        ),
    ],
)
def test_mixed_adapter_batch_matches_peft_over_the_dequantized_base(case, device):
    """On CPU the native kernel; on CUDA the Triton dequantize-GEMM."""
    name, base, adapters, prompts, assignment, expected, plain = case
    _, method, group, _, _ = CASES[name]
    llm = LLM(
        base,
        device=device,
        dtype="float32",
        max_loras=max(len(adapters), 1),
        quantization=method,
        quantization_group_size=group,
        **PRESSURE,
    )
    model = llm.engine.model
    if device == "cpu" and native_wq() is not None:  # the native kernel holds every projection
        layer = model.layers[0]
        assert isinstance(layer.qkv.small, WqLinear) and isinstance(layer.o.small, WqLinear)
    for adapter, path in adapters.items():
        llm.load_adapter(adapter, path)
    requests = [MIX if a == "mix" else a for a in assignment]
    outputs = llm.generate(prompts, params(), adapters=requests)
    assert [o.token_ids for o in outputs] == expected, name
    # The quantization matters here (else the test could not tell it from the bf16/fp32 base).
    base_rows = [i for i, a in enumerate(assignment) if a is None]
    assert any(expected[i] != plain[i] for i in range(len(prompts))), name
    # Prefix hits keep the tokens.
    i = base_rows[0]
    again = llm.generate(prompts[i], params())[0]
    assert again.num_cached_tokens >= 4 and again.token_ids == expected[i]


def test_bad_settings_are_refused_by_name(tmp_path):
    base = make_checkpoint(tmp_path / "base", seed=1)
    with pytest.raises(InvalidRequestError, match="quantization must be one of"):
        LLM(base, dtype="float32", quantization="int3")
    with pytest.raises(InvalidRequestError, match="need quantization"):
        LLM(base, dtype="float32", quantization_group_size=32)
    with pytest.raises(InvalidRequestError, match="quantization_group_size"):
        LLM(base, dtype="float32", quantization="int4", quantization_group_size=0)
    with pytest.raises(ModelLoadError, match="whole groups of 48"):
        LLM(base, dtype="float32", quantization="int4", quantization_group_size=48)
    with pytest.raises(InvalidRequestError, match="batch_invariant"):
        LLM(base, dtype="float32", quantization="int8", batch_invariant=True)


def test_the_step_reads_fewer_bytes_and_the_head_stays_unless_asked(tmp_path):
    base = make_checkpoint(tmp_path / "base", seed=1, hidden_size=128)
    full = LLM(base, dtype="bfloat16").engine.model
    int4 = LLM(base, dtype="bfloat16", quantization="int4").engine.model
    int8 = LLM(base, dtype="bfloat16", quantization="int8").engine.model
    head = LLM(base, dtype="bfloat16", quantization="int4", quantization_lm_head="int4")
    head = head.engine.model
    projections = [lin for y in full.layers for lin in y.dense_linears]
    assert sum(lin.decode_bytes for lin in projections) == 2 * sum(
        lin.out_features * lin.in_features for lin in projections
    )

    def step_bytes(model) -> int:
        return sum(lin.decode_bytes for y in model.layers for lin in y.dense_linears)

    # 4 bits a weight plus an fp32 scale and zero per 32; 8 bits plus a scale and zero per row
    assert step_bytes(int4) < step_bytes(full) / 2.6
    assert step_bytes(int8) < step_bytes(full) / 1.8  # rows of 128-256 weights here
    assert int4.lm_head.decode_bytes == full.lm_head.decode_bytes
    assert head.lm_head.decode_bytes < full.lm_head.decode_bytes / 2.6
    assert head.lm_head(torch.randn(2, 128).bfloat16()).dtype == torch.float32  # logits fp32


def test_the_flags_reach_the_engine_config():
    """``switchboard worker`` and ``switchboard up`` pass the quantization to the engine."""
    from switchboard.cli import _up_worker_args, build_parser
    from switchboard.worker_command import worker_engine_kwargs
    from worker.core.config import engine_config

    argv = ["--quantization", "int4", "--quantization-group-size", "32"]
    argv += ["--quantization-lm-head", "int8"]
    config = engine_config(**worker_engine_kwargs(build_parser().parse_args(["worker", *argv])))
    assert (config.quantization, config.quantization_group_size) == ("int4", 32)
    assert config.quantization_lm_head == "int8"
    assert engine_config().quantization is None
    up = build_parser().parse_args(["up", *argv])
    assert _up_worker_args(up) == argv
    assert _up_worker_args(build_parser().parse_args(["up"])) == []


def test_speculative_decoding_on_a_quantized_base_keeps_its_tokens(case):
    """Verification rows (k + 1 a sequence) through the quantized kernels: prompt lookup's
    drafts, the same greedy tokens as peft over the dequantized base."""
    name, base, adapters, prompts, assignment, expected, _ = case
    _, method, group, _, _ = CASES[name]
    llm = LLM(
        base,
        dtype="float32",
        max_loras=max(len(adapters), 1),
        quantization=method,
        quantization_group_size=group,
        speculative_model="ngram",
        num_speculative_tokens=3,
        speculative_position_cost=0.0,
    )
    for adapter, path in adapters.items():
        llm.load_adapter(adapter, path)
    requests = [MIX if a == "mix" else a for a in assignment]
    # prompts that repeat themselves, so prompt lookup has drafts to offer
    echoing = [p + p[:6] for p in prompts]
    want = [o.token_ids for o in llm.generate(echoing, params(), adapters=requests)]
    plain = LLM(
        base,
        dtype="float32",
        max_loras=max(len(adapters), 1),
        quantization=method,
        quantization_group_size=group,
    )
    for adapter, path in adapters.items():
        plain.load_adapter(adapter, path)
    assert [o.token_ids for o in plain.generate(echoing, params(), adapters=requests)] == want
    assert llm.engine.spec_decode_stats.num_verifications > 0
    assert [o.token_ids for o in llm.generate(prompts, params(), adapters=requests)] == expected


def test_two_ranks_quantize_their_shards_as_one_rank_does(tmp_path):
    """Tensor parallelism: each rank quantizes its shard as it loads it; with groups that the
    row-parallel split keeps whole (32 of o's and down's 64 and 128 inputs per rank), the
    weights are one rank's, and so are the greedy tokens, adapters included."""
    base = make_checkpoint(tmp_path / "base", seed=11, num_heads=4, num_kv_heads=2)
    adapter = make_peft_adapter(base, tmp_path / "r4", rank=4, targets=ALL, seed=1)
    prompts = random_prompts(4, min_len=4, max_len=30, seed=2)
    options = dict(dtype="float32", num_kv_blocks=64, max_loras=1, quantization="int4")
    outputs = []
    for size in (1, 2):
        llm = LLM(base, **options, tensor_parallel_size=size)
        llm.load_adapter("r4", adapter)
        got = llm.generate(prompts, params(), adapters=[None, "r4", "r4", None])
        outputs.append([o.token_ids for o in got])
        if size == 2:
            llm.shutdown()
    assert outputs[0] == outputs[1]
    # and quantizing matters here (a rank that skipped it would show)
    plain = LLM(base, dtype="float32", num_kv_blocks=64, max_loras=1)
    plain.load_adapter("r4", adapter)
    unquantized = plain.generate(prompts, params(), adapters=[None, "r4", "r4", None])
    assert [o.token_ids for o in unquantized] != outputs[0]


def test_structured_outputs_on_a_quantized_base_follow_their_schema(tmp_path):
    """Constrained decoding is unchanged over quantized weights: sampled JSON validates."""
    import json

    import jsonschema

    from factories import add_byte_level_tokenizer
    from worker.sampling.structured_output import StructuredOutput

    base = make_checkpoint(tmp_path / "base", vocab_size=512, eos_token_id=0, seed=5)
    add_byte_level_tokenizer(base, vocab_size=400)
    schema = {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
        "required": ["color", "ok"],
        "additionalProperties": False,
    }
    spec = StructuredOutput.json_schema(schema)
    llm = LLM(base, dtype="float32", quantization="int4")
    sampled = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=100, structured_output=spec)
        for s in range(4)
    ]
    for out in llm.generate(["the quick brown fox"] * 4, sampled):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)
