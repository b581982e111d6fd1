"""Prompt lookup's n-gram index (decode/lookup.py)."""

import pytest

from decode.lookup import NgramIndex


def test_proposes_the_token_after_the_latest_occurrence():
    index = NgramIndex(max_ngram=3)
    index.extend([5, 6, 7, 1, 5, 6, 8, 2])
    assert index.propose([9, 5, 6]) == 8  # (5, 6) was followed by 7, then later by 8


def test_longest_match_wins():
    index = NgramIndex(max_ngram=3)
    index.extend([1, 2, 3, 4, 9, 2, 3, 5])
    assert index.propose([1, 2, 3]) == 4  # the 3-gram (1, 2, 3) beats the later 2-gram (2, 3) -> 5
    assert index.propose([7, 2, 3]) == 5


def test_no_match_and_no_unigram_match():
    index = NgramIndex(max_ngram=2)
    index.extend([1, 2, 3, 4])
    assert index.propose([4, 1]) is None
    assert index.propose([3]) is None  # single tokens are never matched
    assert index.propose([3, 4]) is None  # its only occurrence has no follower yet


def test_follower_appears_once_the_next_token_arrives():
    index = NgramIndex(max_ngram=2)
    index.extend([1, 2])
    assert index.propose([1, 2]) is None
    index.extend([6])
    assert index.propose([1, 2]) == 6


def test_max_ngram_below_two_is_refused():
    with pytest.raises(ValueError, match="max_ngram"):
        NgramIndex(max_ngram=1)
