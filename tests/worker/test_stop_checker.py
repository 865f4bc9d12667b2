"""Stop strings: exact truncation, matches across deltas, nothing of a stop string leaks."""

from __future__ import annotations

import random

import pytest

from worker.text.stop_checker import StopChecker, StopOutput


def make_checker(*stop: str, include: bool = False) -> StopChecker:
    return StopChecker(list(stop), include_stop_str_in_output=include)


def run(checker: StopChecker, deltas: list[str]) -> tuple[list[str], str | None]:
    """Feeds deltas until a stop; returns every released piece (flush included) and the match."""
    released = []
    for delta in deltas:
        result = checker.feed(delta)
        released.append(result.text)
        if result.stopped:
            return released, result.matched
    released.append(checker.flush())
    return released, None


def reference(text: str, stop: list[str], include: bool = False) -> tuple[str, str | None]:
    """The specification, by brute force: stop where a stop string first ends (longest on a
    tie); the output is everything before it (or through it, with include)."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stop if text[:end].endswith(s)]
        if ending:
            match = max(ending, key=len)
            return text[: end if include else end - len(match)], match
    return text, None


def random_split(rng: random.Random, text: str) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), rng.randrange(0, len(text)))) if text else []
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def test_without_stop_strings_everything_passes_through() -> None:
    checker = make_checker()
    assert checker.feed("hello") == StopOutput("hello", None)
    assert checker.flush() == ""


def test_match_inside_one_delta_truncates_right_before_it() -> None:
    checker = make_checker("STOP")
    result = checker.feed("hello STOP world")
    assert result == StopOutput("hello ", "STOP")
    assert result.stopped
    assert checker.matched == "STOP"


def test_match_spanning_deltas() -> None:
    released, matched = run(make_checker("STOP"), ["hel", "lo S", "T", "O", "P and more"])
    assert released == ["hel", "lo ", "", "", ""]
    assert matched == "STOP"


def test_partial_match_is_released_once_it_cannot_become_a_stop() -> None:
    checker = make_checker("STOP")
    assert checker.feed("a ST").text == "a "
    assert checker.feed("O").text == ""
    assert checker.feed("x").text == "STOx"
    assert checker.flush() == ""


def test_only_a_possible_stop_start_is_held_back() -> None:
    checker = make_checker("\n\nUser:")
    assert checker.feed("a long line").text == "a long line"
    assert checker.feed(" end\n").text == " end"
    assert checker.feed("\nUs").text == ""
    assert checker.flush() == "\n\nUs"


def test_flush_releases_the_held_back_tail_once() -> None:
    checker = make_checker("stop")
    assert checker.feed("we st").text == "we "
    assert checker.flush() == "st"
    assert checker.flush() == ""


def test_after_a_match_nothing_more_is_released() -> None:
    checker = make_checker("END")
    assert checker.feed("xEND").text == "x"
    assert checker.feed("more") == StopOutput("", "END")
    assert checker.flush() == ""


def test_the_first_stop_to_complete_wins_whatever_the_list_order() -> None:
    assert make_checker("world", "lo").feed("hello world") == StopOutput("hel", "lo")
    assert make_checker("lo", "world").feed("hello world") == StopOutput("hel", "lo")


def test_overlapping_candidates_shorter_completes_first() -> None:
    # "ab" completes before "abc" could, in one delta or many
    assert make_checker("abc", "ab").feed("xabcd") == StopOutput("x", "ab")
    released, matched = run(make_checker("abc", "ab"), ["x", "a", "b", "c"])
    assert ("".join(released), matched) == ("x", "ab")


def test_stops_ending_at_the_same_place_cut_at_the_longest() -> None:
    assert make_checker("bc", "abc").feed("xabc") == StopOutput("x", "abc")
    released, matched = run(make_checker("bc", "abc"), ["xa", "bc"])
    assert ("".join(released), matched) == ("x", "abc")


def test_a_longer_candidate_that_fails_falls_back_to_text() -> None:
    released, matched = run(make_checker("abc", "bd"), ["a", "b", "d"])
    assert ("".join(released), matched) == ("a", "bd")
    released, matched = run(make_checker("abc"), ["a", "b", "x"])
    assert (released, matched) == (["", "", "abx", ""], None)


def test_self_overlapping_stop_string() -> None:
    released, matched = run(make_checker("aab"), ["a", "a", "a", "b"])
    assert ("".join(released), matched) == ("a", "aab")


def test_include_stop_string_in_output() -> None:
    checker = make_checker("STOP", include=True)
    assert checker.feed("go S").text == "go S"  # nothing to hold back: a stop is output anyway
    assert checker.feed("TOP and more") == StopOutput("TOP", "STOP")
    assert checker.flush() == ""


def test_stop_strings_must_not_be_empty() -> None:
    with pytest.raises(ValueError, match="empty"):
        make_checker("")


@pytest.mark.parametrize("include", [False, True])
def test_random_streams_match_the_specification(include: bool) -> None:
    """Property: for random text, stop strings and splits, the released text equals the brute
    force reference, and no released prefix ever contains a stop string (without include)."""
    rng = random.Random(2024 + include)
    for _ in range(2000):
        text = "".join(rng.choice("abc\n") for _ in range(rng.randrange(0, 20)))
        stop = ["".join(rng.choice("abc\n") for _ in range(rng.randrange(1, 5)))]
        stop += ["".join(rng.choice("abc") for _ in range(rng.randrange(1, 4)))] * rng.randrange(2)
        released, matched = run(make_checker(*stop, include=include), random_split(rng, text))
        assert ("".join(released), matched) == reference(text, stop, include), (text, stop)
        if not include:
            so_far = ""
            for piece in released:
                so_far += piece
                assert not any(s in so_far for s in stop)
