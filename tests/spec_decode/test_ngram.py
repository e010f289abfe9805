"""Prompt lookup: the continuation of the latest earlier occurrence of the longest recurring suffix."""

import pytest

from deepinfer.spec_decode.ngram import NgramProposer


def test_longest_suffix_wins_and_the_latest_match_is_used():
    history = [1, 2, 3, 9, 1, 2, 3, 4, 5, 7, 2, 3]
    # n = 2: [2, 3] occurs at 1 and 5 -> the latest (5) is followed by 4, 5, 7
    assert NgramProposer(3, max_n=2).propose(history) == [4, 5, 7]
    history = [5, 6, 7, 8, 0, 6, 7, 1, 5, 6, 7]
    # n = 3: [5, 6, 7] occurs at 0 only -> 8, 0; the shorter [6, 7] would have given 1, 5
    assert NgramProposer(2, max_n=3).propose(history) == [8, 0]


def test_drafts_stop_at_the_end_of_the_history_and_at_k():
    assert NgramProposer(5).propose([4, 4, 4, 4]) == [4]  # the match just before the suffix
    assert NgramProposer(2).propose([1, 2, 3, 1, 2, 3, 1]) == [2, 3]
    assert NgramProposer(5).propose([1, 2, 3, 1, 2, 3, 1], k=1) == [2]


def test_no_recurring_suffix_gives_no_drafts():
    assert NgramProposer(4).propose([1, 2, 3, 4]) == []
    assert NgramProposer(4).propose([7]) == []
    assert NgramProposer(4, max_n=3, min_n=2).propose([1, 2, 9, 2]) == []  # only a 1-gram recurs


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="min_n"):
        NgramProposer(4, max_n=1, min_n=2)
    with pytest.raises(ValueError, match="k must be"):
        NgramProposer(0)
