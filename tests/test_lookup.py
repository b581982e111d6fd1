"""Prompt lookup's n-gram index (decode/lookup.py) and its proposer (decode/proposers.py)."""

import pytest

from common.sampling import SamplingParams
from decode.lookup import NgramIndex
from decode.proposers import LookupProposer


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


def test_lookup_proposer_chains_guesses_and_stops_at_the_first_miss():
    proposer = LookupProposer(max_ngram=2)
    proposer.reset([1, 2, 3, 1, 2])
    proposal = proposer.propose([1, 2, 3, 1, 2], 5, SamplingParams(), None)
    # (1, 2) -> 3, (2, 3) -> 1, (3, 1) -> 2, (1, 2) -> 3, ...: a cycle, cut at k.
    assert proposal.tokens == [3, 1, 2, 3, 1]
    assert proposal.draft_probs == [None] * 5 and proposal.from_lookup == [True] * 5
    proposer.reset([4, 5, 6])
    assert proposer.propose([4, 5, 6], 3, SamplingParams(), None).tokens == []


def test_lookup_proposer_indexes_committed_text_only():
    """Tokens committed after the prompt are looked up; proposed tokens never enter the index."""
    proposer = LookupProposer(max_ngram=2)
    proposer.reset([1, 2, 3])
    # (1, 2) -> 3 from the prompt, (2, 3) -> 1 from the committed tokens after it.
    assert proposer.propose([1, 2, 3, 1, 2], 2, SamplingParams(), None).tokens == [3, 1]
    proposer.rollback(6)  # the target rejected 3 and emitted 4
    # The latest (1, 2) was followed by the committed 4, not by the proposed 3.
    assert proposer.propose([1, 2, 3, 1, 2, 4, 1, 2], 1, SamplingParams(), None).tokens == [4]
