"""Prompt lookup's drafts: what followed the best earlier occurrence of the sequence's end."""

from __future__ import annotations

from cloud.engine.speculative.ngram import NgramIndex


def test_the_tokens_after_an_earlier_occurrence_are_drafted() -> None:
    index = NgramIndex(2, 4)
    tokens = [1, 2, 3, 4, 5, 6, 7, 9, 9, 3, 4]
    assert index.propose(tokens, 3) == [5, 6, 7]
    assert index.propose(tokens, 10) == [5, 6, 7, 9, 9, 3, 4]  # up to the sequence's end


def test_nothing_is_drafted_without_a_match_or_room() -> None:
    index = NgramIndex(2, 4)
    assert index.propose([1, 2, 3, 4], 3) == []
    assert index.propose([1, 2, 1, 2], 0) == []
    assert index.propose([5], 3) == []


def test_the_longest_agreement_wins_and_a_tie_goes_to_the_latest() -> None:
    # "7 8" follows both "1 7 8 -> 20" and "5 6 7 8 -> 30"; the sequence ends "5 6 7 8"
    tokens = [5, 6, 7, 8, 30, 31, 0, 1, 7, 8, 20, 21, 0, 5, 6, 7, 8]
    assert NgramIndex(2, 4).propose(tokens, 2) == [30, 31]
    # with no longer agreement anywhere, the latest occurrence
    assert NgramIndex(2, 2).propose(tokens, 2) == [20, 21]


def test_the_index_grows_with_the_sequence() -> None:
    index = NgramIndex(2, 3)
    tokens = [1, 2, 3]
    assert index.propose(tokens, 2) == []
    tokens += [9, 1, 2]
    assert index.propose(tokens, 2) == [3, 9]
    tokens += [3, 9, 4, 1, 2]
    assert index.propose(tokens, 2) == [3, 9]  # the latest occurrence on equal agreement
