"""Constrained decoding and logit bias in the engine (tiny random models, fp32).

Oracles: every constrained output parses and validates against its JSON schema (the
`jsonschema` package) or matches its regular expression (Python's `re`); a grammar that
allows the unconstrained output's every token gives exactly that output; the first masks of
a simple grammar equal masks built by hand from the vocabulary; speculative decoding,
preemption, prefix caching, n > 1 and LoRA give the tokens plain decoding gives.
"""

from __future__ import annotations

import contextlib
import json
import re

import jsonschema
import pytest
import torch

from factories import (
    add_byte_level_tokenizer,
    assert_no_block_leaks,
    make_checkpoint,
    make_peft_adapter,
)
from worker import LLM, SamplingParams
from worker.errors import InvalidRequestError
from worker.sampling.structured_output import StructuredOutput

VOCAB = 512  # the model's rows; the tokenizer has 400 tokens, so 400-511 are never text
EOS = 0  # the tokenizer's <|endoftext|>

SCHEMAS = {
    "nested-objects": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 6},
                    "address": {
                        "type": "object",
                        "properties": {"city": {"type": "string", "maxLength": 5}},
                        "required": ["city"],
                        "additionalProperties": False,
                    },
                },
                "required": ["name", "address"],
                "additionalProperties": False,
            }
        },
        "required": ["user"],
        "additionalProperties": False,
    },
    "enums": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
        "required": ["color", "ok"],
        "additionalProperties": False,
    },
    "array-with-bounds": {
        "type": "array",
        "items": {"type": "integer", "minimum": -5, "maximum": 5},
        "minItems": 2,
        "maxItems": 4,
    },
    "pattern": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}},
        "required": ["code"],
        "additionalProperties": False,
    },
    "integer-range-and-optional-fields": {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 18, "maximum": 99},
            "nickname": {"type": "string", "maxLength": 4},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["age"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_checkpoint(
        tmp_path_factory.mktemp("structured"), vocab_size=VOCAB, eos_token_id=EOS, seed=5
    )
    return add_byte_level_tokenizer(path, vocab_size=400)


@pytest.fixture(scope="module")
def llm(model):
    return LLM(model, dtype="float32")


def sampled(spec: StructuredOutput, seed: int, **kwargs) -> SamplingParams:
    return SamplingParams(
        temperature=1.0, seed=seed, max_tokens=300, structured_output=spec, **kwargs
    )


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_sampled_output_validates_against_its_schema(llm, name):
    schema = SCHEMAS[name]
    spec = StructuredOutput.json_schema(schema)
    outs = llm.generate(["the quick brown fox"] * 6, [sampled(spec, seed) for seed in range(6)])
    for out in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)
        assert out.token_ids[-1] != EOS  # the grammar ended it; no EOS token was needed
    assert_no_block_leaks(llm.engine)


@pytest.mark.parametrize(
    ("spec", "check"),
    [
        (StructuredOutput.regex(r"[ab]{3,6}-(yes|no)"), r"[ab]{3,6}-(yes|no)"),
        (StructuredOutput.choice(["alpha", "beta", "gamma delta"]), r"alpha|beta|gamma delta"),
        (StructuredOutput.lark('start: "x" NUM+\nNUM: /[0-9]/'), r"x[0-9]+"),
        (StructuredOutput.json_object(), None),
    ],
    ids=["regex", "choice", "lark", "json-object"],
)
def test_regex_choice_lark_and_any_json_object(llm, spec, check):
    outs = llm.generate(["hello"] * 4, [sampled(spec, seed) for seed in range(4)])
    for out in outs:
        assert out.finish_reason in ("stop", "length"), out.text
        if check is not None and out.finish_reason == "stop":
            assert re.fullmatch(check, out.text), out.text
        if check is None and out.finish_reason == "stop":
            assert isinstance(json.loads(out.text), dict)


@pytest.mark.parametrize(
    "params",
    [dict(temperature=0.0), dict(temperature=0.9, seed=7, top_k=50), dict(temperature=1.0, seed=8)],
    ids=["greedy", "top-k", "sampled"],
)
def test_a_mask_that_allows_every_token_changes_nothing(llm, params):
    """Any sequence of the model's token ids (llguidance's token ranges): the masks forbid
    nothing, so greedy and seeded samples are exactly the unconstrained ones."""
    prompts = ["the quick brown fox", "naïve café", "hello world again"]
    free = llm.generate(prompts, SamplingParams(max_tokens=20, **params))
    anything = StructuredOutput.lark(f"start: <[0-{VOCAB - 1}]>*")
    constrained = SamplingParams(max_tokens=20, structured_output=anything, **params)
    outs = llm.generate(prompts, constrained)
    assert [o.token_ids for o in outs] == [o.token_ids for o in free]


def test_the_first_masks_equal_masks_built_by_hand(llm):
    """[ab]+: allowed are exactly the tokens whose text is one or more a/b characters; once
    something was written, the end (EOS) too."""
    tokenizer = llm.engine.tokenizer
    texts = {t: tokenizer.decode([t]) for t in range(400)}
    by_hand = {t for t, s in texts.items() if s and set(s) <= {"a", "b"} and t != EOS}
    state = llm.engine.grammars.matcher(StructuredOutput.regex("[ab]+"))
    logits = torch.zeros(2, VOCAB)
    llm.engine._masks.apply_(logits, [(state, 0, [])])
    assert set((logits[0] == 0).nonzero().flatten().tolist()) == by_hand
    assert (logits[1] == 0).all()  # a row no grammar names is untouched
    state.consume(next(iter(by_hand)))
    logits = torch.zeros(1, VOCAB)
    llm.engine._masks.apply_(logits, [(state, 0, [])])
    assert set((logits[0] == 0).nonzero().flatten().tolist()) == by_hand | {EOS}


def test_draft_rows_are_masked_after_the_drafts_before_them(llm):
    """Rows for drafts: row j is masked for the state after drafts[:j]; past a draft the
    grammar refuses, rows stay as they were (verification stops there)."""
    tokenizer = llm.engine.tokenizer
    a, b, c = (tokenizer.encode(ch, add_special_tokens=False)[0] for ch in "abc")
    state = llm.engine.grammars.matcher(StructuredOutput.regex("ab?c"))
    logits = torch.zeros(5, VOCAB)
    llm.engine._masks.apply_(logits, [(state, 0, [a, c, a, b])])
    allowed = [set((row == 0).nonzero().flatten().tolist()) for row in logits]
    assert a in allowed[0] and c not in allowed[0]
    assert {b, c} <= allowed[1] and a not in allowed[1]  # after "a"
    assert allowed[2] == {EOS}  # after "ac": done
    assert len(allowed[3]) == VOCAB and len(allowed[4]) == VOCAB  # past the refused "a"
    assert state.matcher.validate_tokens([a]) == 1  # the matcher itself did not move


@pytest.mark.parametrize(
    "variant",
    [
        {"block_size": 4, "num_kv_blocks": 40},  # preemption (recompute)
        {"block_size": 4, "num_kv_blocks": 40, "preemption_mode": "swap"},
        {"max_num_batched_tokens": 7},  # chunked prefill
    ],
    ids=["recompute", "swap", "chunked"],
)
def test_constrained_greedy_outputs_are_the_same_under_preemption_and_chunking(model, llm, variant):
    spec = StructuredOutput.json_schema(SCHEMAS["nested-objects"])
    prompts = [f"prompt number {i} " * (1 + i % 3) for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=60, structured_output=spec)
    reference = [o.token_ids for o in llm.generate(prompts, params)]
    other = LLM(model, dtype="float32", **variant)
    assert [o.token_ids for o in other.generate(prompts, params)] == reference
    assert_no_block_leaks(other.engine)


@pytest.mark.parametrize("proposer", ["ngram", "draft-is-target", "draft-disagrees"])
def test_speculation_keeps_constrained_greedy_outputs(model, llm, tmp_path_factory, proposer):
    draft = {
        "ngram": "ngram",
        "draft-is-target": str(model),
        "draft-disagrees": str(
            add_byte_level_tokenizer(
                make_checkpoint(
                    tmp_path_factory.mktemp("other"),
                    vocab_size=VOCAB,
                    eos_token_id=EOS,
                    seed=77,
                    num_layers=1,
                ),
                vocab_size=400,
            )
        ),
    }[proposer]
    spec = StructuredOutput.json_schema(SCHEMAS["enums"])
    pattern = StructuredOutput.regex(r"(ab|ba){2,9}!")
    prompts = ["ab ab ab ab", "the the the", "red green red green", "café café"]
    specs = [spec, pattern, spec, None]
    params = [SamplingParams(temperature=0.0, max_tokens=40, structured_output=s) for s in specs]
    reference = [o.token_ids for o in llm.generate(prompts, params)]
    fast = LLM(
        model,
        dtype="float32",
        speculative_model=draft,
        num_speculative_tokens=4,
        speculative_position_cost=0.0,
        speculative_draft_cost=0.0,
        speculative_draft_quantization="none",
    )
    assert [o.token_ids for o in fast.generate(prompts, params)] == reference
    stats = fast.engine.spec_decode_stats
    assert stats is not None and stats.num_verifications > 0
    assert_no_block_leaks(fast.engine)


def test_samples_of_one_prompt_each_follow_the_grammar(llm):
    """n > 1 runs as samples of one prompt (``add_samples``): each has its own matcher."""
    spec = StructuredOutput.json_schema(SCHEMAS["enums"])
    engine = llm.engine
    ids = [f"s-{i}" for i in range(4)]
    engine.add_samples(
        ids,
        "colors",
        [sampled(spec, seed) for seed in range(4)],
    )
    done = {}
    while engine.has_unfinished_requests:
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert sorted(done) == ids
    for out in done.values():
        jsonschema.validate(json.loads(out.text), SCHEMAS["enums"])
    assert len({out.text for out in done.values()}) > 1  # each its own matcher and draws


def test_constrained_requests_mix_with_adapters_and_free_requests(model, tmp_path):
    adapter = make_peft_adapter(model, tmp_path / "a", rank=4, targets=["q_proj", "v_proj"])
    engine = LLM(model, dtype="float32")
    engine.load_adapter("a", adapter)
    spec = StructuredOutput.json_schema(SCHEMAS["pattern"])
    greedy = dict(temperature=0.0, max_tokens=40)
    mixed = engine.generate(
        ["one", "two", "three"],
        [
            SamplingParams(structured_output=spec, **greedy),
            SamplingParams(**greedy),
            SamplingParams(structured_output=spec, **greedy),
        ],
        adapters=["a", None, None],
    )
    alone = [
        engine.generate(["one"], SamplingParams(structured_output=spec, **greedy), adapters=["a"]),
        engine.generate(["two"], SamplingParams(**greedy)),
        engine.generate(["three"], SamplingParams(structured_output=spec, **greedy)),
    ]
    assert [o.token_ids for o in mixed] == [o[0].token_ids for o in alone]
    for out in (mixed[0], mixed[2]):
        jsonschema.validate(json.loads(out.text), SCHEMAS["pattern"])


def test_logit_bias_bans_and_forces_tokens(llm):
    prompt = "the quick brown fox"
    (free,) = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8))
    banned = free.token_ids[0]
    params = SamplingParams(temperature=0.0, max_tokens=8, logit_bias={banned: -100.0})
    (out,) = llm.generate([prompt], params)
    assert banned not in out.token_ids
    forced = 123
    params = SamplingParams(temperature=0.8, seed=1, max_tokens=5, logit_bias={forced: 100.0})
    (out,) = llm.generate([prompt], params)
    assert out.token_ids == [forced] * 5


def test_logit_bias_is_what_greedy_sees(llm):
    """Greedy under a bias: the argmax of logits + bias, checked against the logprobs the
    engine reports (raw: before the bias) for the first token."""
    prompt = "hello world"
    (free,) = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, logprobs=5))
    top = free.logprobs[0].top_logprobs  # [(id, logprob)] best first
    (first, lp1), (second, lp2) = top[0], top[1]
    nudge = (lp1 - lp2) + 0.5  # enough to lift the runner-up over the leader
    params = SamplingParams(temperature=0.0, max_tokens=1, logit_bias={second: nudge})
    (out,) = llm.generate([prompt], params)
    assert out.token_ids == [second]
    params = SamplingParams(temperature=0.0, max_tokens=1, logit_bias={second: nudge - 1.0})
    (out,) = llm.generate([prompt], params)
    assert out.token_ids == [first]


@pytest.mark.parametrize(
    ("params", "says"),
    [
        (dict(logit_bias={1: 101.0}), "logit_bias must be a number in"),
        (dict(logit_bias={1: float("nan")}), "logit_bias must be a number in"),
        (dict(logit_bias={-1: 1.0}), "logit_bias keys must be token ids"),
        (dict(logit_bias={i: 1.0 for i in range(1025)}), "at most 1024"),
    ],
)
def test_bad_logit_bias_is_refused(params, says):
    with pytest.raises(InvalidRequestError, match=says):
        SamplingParams(**params)


def test_unknown_logit_bias_tokens_and_bad_grammars_are_refused_before_queueing(llm):
    with pytest.raises(InvalidRequestError, match="unknown logit_bias token ids"):
        llm.engine.add_request("x", "hi", SamplingParams(logit_bias={VOCAB: 1.0}))
    bad = [
        (StructuredOutput("json_schema", '{"type": "strin"}'), "strin"),
        (StructuredOutput("json_schema", '{"type": "object", "dependentSchemas": {}}'), "dep"),
        (StructuredOutput("regex", "a[b"), "regex"),
        (StructuredOutput("lark", "start: undefined_rule"), "undefined_rule"),
    ]
    for spec, says in bad:
        with pytest.raises(InvalidRequestError, match=says):
            llm.engine.add_request("x", "hi", SamplingParams(structured_output=spec))
    assert not llm.engine.has_unfinished_requests
    with pytest.raises(InvalidRequestError, match="format must be one of"):
        StructuredOutput("yaml", "a: b")
    with pytest.raises(InvalidRequestError, match="at most"):
        StructuredOutput("regex", "a" * (1 << 21))


def test_a_hostile_grammar_leaves_the_request_beside_it_untouched(llm):
    """A regular expression that backtracking engines take exponential time over: the
    parser's bounded work per token keeps it cheap (or it is refused); either way the
    request beside it gets the tokens it gets alone, and both end."""
    engine = llm.engine
    nasty = StructuredOutput.regex("(a|aa)*(b|ab)*" * 40 + "c")
    victim = SamplingParams(temperature=0.0, max_tokens=16)
    (reference,) = llm.generate(["victim prompt"], victim)
    with contextlib.suppress(InvalidRequestError):  # refused outright: as good
        engine.add_request("nasty", "hello", SamplingParams(max_tokens=50, structured_output=nasty))
    engine.add_request("victim", "victim prompt", victim)
    outputs = {}
    while engine.has_unfinished_requests:
        for out in engine.step():
            outputs[out.request_id] = out
    assert outputs["victim"].token_ids == reference.token_ids
    assert all(out.finished for out in outputs.values())
    engine.take_failures()


def test_compiled_grammars_are_cached_per_tenant(llm, monkeypatch):
    """A cache hit is fast: shared across tenants, a request's latency would tell one tenant
    that another had sent the same grammar (the gateway's verdicts are keyed likewise)."""
    grammars = llm.engine.grammars
    built = []
    build = grammars._build
    monkeypatch.setattr(grammars, "_build", lambda tok, g: built.append(g) or build(tok, g))
    spec = StructuredOutput("regex", "[a-c]{3}-per-tenant")
    grammars.prepare(spec, "tenant-a")
    grammars.prepare(spec, "tenant-a")
    grammars.matcher(spec, "tenant-a")
    assert len(built) == 1
    grammars.prepare(spec, "tenant-b")
    assert len(built) == 2
