"""bench/fairness.py's own arithmetic: prompt lengths as the gateway counts them, tokens
inside a window, and the targets' verdicts."""

from __future__ import annotations

import pytest

from bench.fairness import Prompts, Stream, tpot_ms, verdicts


@pytest.fixture(scope="module")
def prompts(default_model_path):
    made = Prompts(default_model_path, seed=7)
    yield made
    made.tokenizer.close()


@pytest.mark.parametrize("length", [300, 1100])
def test_long_prompts_have_the_asked_length_and_differ(prompts, length):
    made = [prompts.long(length) for _ in range(5)]
    for prompt in made:
        assert prompt.tokens == len(prompts.tokenizer.encode_chat(prompt.messages))
        assert length <= prompt.tokens <= length + 4
    assert len({p.messages[0]["content"] for p in made}) == 5


def test_questions_are_short_and_distinct(prompts):
    made = [prompts.question() for _ in range(10)]
    assert all(p.tokens < 64 for p in made)
    assert len({p.messages[0]["content"] for p in made}) == 10


def test_tokens_between_spreads_a_stream_over_its_events():
    # Four events carrying 8 tokens: 2 a piece.
    stream = Stream(sent=0.0, stamps=[1.0, 2.0, 3.0, 4.0], prompt_tokens=10, tokens=8)
    assert stream.tokens_between(2.0, 4.0) == 4.0  # events at 2 and 3; 4 is past the end
    assert stream.tokens_between(0.0, 10.0) == 8.0
    assert stream.tokens_between(4.5, 9.0) == 0.0


def test_verdicts_name_each_target():
    def policy(p50: float, p90: float) -> dict:
        return {"b_ttft_load_ms": {"n": 5, "p50": p50, "p90": p90, "max": p90}}

    report = {
        "policies": {"fair": policy(400.0, 1900.0), "fcfs": policy(9000.0, 9500.0)},
        "fair_over_fcfs_tok_s": 0.94,
        "weighted": {"share": {"heavy": 0.71, "light": 0.29},
                     "target_share": {"heavy": 0.75, "light": 0.25}},
    }  # fmt: skip
    assert verdicts(report) == {
        "fair: B TTFT p50 <= 1 s": True,
        "fair: B TTFT p90 <= 2 s": True,
        "fcfs: B TTFT p50 <= 1 s": False,
        "fcfs: B TTFT p90 <= 2 s": False,
        "fair output tok/s within 5% of fcfs": False,
        "weighted shares within 5 points of 75/25": True,
    }
    starved = {"policies": {"fair": {"b_ttft_load_ms": {"n": 0}}}}
    assert verdicts(starved) == {"fair: B TTFT p50 <= 1 s": False, "fair: B TTFT p90 <= 2 s": False}


def test_the_decode_budget_verdicts_compare_tpot_with_idle_and_tok_s_with_unbounded():
    def policy(tpot_idle: float, tpot_load: float) -> dict:
        return {
            "b_ttft_load_ms": {"n": 5, "p50": 400.0, "p90": 900.0, "max": 900.0},
            "b_tpot_idle_ms": {"n": 10, "p50": tpot_idle},
            "b_tpot_load_ms": {"n": 5, "p50": tpot_load},
        }

    report = {
        "policies": {"fair": policy(30.0, 89.0), "fair-unbounded": policy(30.0, 900.0)},
        "bounded_over_unbounded_tok_s": 0.89,
    }
    verdict = verdicts(report)
    assert verdict["fair: B TPOT under load <= 3x idle"] is True  # 2.97x
    assert verdict["fair computed tok/s within 10% of fair-unbounded"] is False  # 0.89
    report["policies"]["fair"] = policy(30.0, 91.0)
    assert verdicts(report)["fair: B TPOT under load <= 3x idle"] is False


def test_tpot_counts_the_time_after_the_first_token():
    # 5 tokens: the first at 1.0 s, the last at 1.4 s: 4 gaps of 100 ms.
    stream = Stream(sent=0.0, stamps=[1.0, 1.2, 1.4], prompt_tokens=10, tokens=5)
    assert tpot_ms([stream]) == pytest.approx({"n": 1, "p50": 100.0, "p90": 100.0, "mean": 100.0})
    assert tpot_ms([Stream(0.0, [1.0], 10, 1)]) == {"n": 0}
