"""bench.draft_quality's replay of greedy speculation, counted by hand."""

from __future__ import annotations

from bench.draft_quality import chain_tokens


def test_a_chain_of_k_drafts_gives_the_matches_in_a_row_plus_the_targets_token():
    assert chain_tokens([True] * 10, 4) == 10 / 2  # 4 accepted + 1, twice
    assert chain_tokens([False] * 10, 4) == 1.0  # every verification gives the target's own
    # k = 2 over T T F T F F T: [T T]+1 -> position 3; [T F]: 1+1 -> 5; [F]: 1 -> 6; end: 1.
    assert chain_tokens([True, True, False, True, False, False, True], 2) == 7 / 4
    # The last position is always the target's own token: no draft is checked past the end.
    assert chain_tokens([True, True, True], 4) == 3.0
