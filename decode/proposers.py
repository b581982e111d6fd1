"""Proposers that are not a draft model of their own, and the choice between them.

  LookupProposer    prompt lookup alone: tokens copied from earlier text (decode/lookup.py)
  LookupThenDraft   at each position lookup first, else the draft (a draft LM or a feature draft)
  make_proposer     a standalone draft (decode/drafts/standalone/proposer.py) alone or behind lookup

The seam they implement (Proposal, Proposer, Drafter) is decode/proposal.py.
"""

from __future__ import annotations

import torch

from common.sampling import SamplingParams
from decode.checks import check_int
from decode.drafts.standalone.proposer import DraftProposer
from decode.lookup import MIN_NGRAM, NgramIndex
from decode.proposal import Drafter, Proposal
from decode.runners import Runner


class LookupProposer:
    """Prompt lookup: where the last n tokens (n = max_ngram down to 2) occurred earlier in the prompt
    or output, the token that followed them, with probability 1. Stops at the first position with no
    match, so a block may propose nothing (the target then emits one token, as target-only decoding)."""

    max_length = None

    def __init__(self, max_ngram: int):
        self.index = NgramIndex(max_ngram)

    def reset(self, prompt_ids: list[int]) -> None:
        self.index = NgramIndex(self.index.max_ngram)
        self.index.extend(prompt_ids)

    def guess(self, committed: list[int], drafted: list[int]) -> int | None:
        """The looked-up token after committed + drafted, or None. The index holds committed text
        only: it catches up here on the tokens committed since the last call."""
        self.index.extend(committed[len(self.index):])
        n = self.index.max_ngram
        return self.index.propose((committed[-n:] + drafted)[-n:])

    def propose(self, committed: list[int], k: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> Proposal:
        tokens: list[int] = []
        while len(tokens) < k and (token := self.guess(committed, tokens)) is not None:
            tokens.append(token)
        return Proposal(tokens, [None] * len(tokens), None, [True] * len(tokens), 0)

    def rollback(self, n_committed: int) -> None:
        """Nothing to forget: the index never holds proposed tokens."""


class LookupThenDraft:
    """At each position prompt lookup first, else the draft, which catches up on the looked-up and
    committed tokens it skipped on its next forward. The block ends where neither proposes."""

    def __init__(self, lookup: LookupProposer, draft: Drafter):
        self.lookup, self.draft = lookup, draft
        self.max_length = draft.max_length

    def reset(self, prompt_ids: list[int]) -> None:
        self.lookup.reset(prompt_ids)
        self.draft.reset(prompt_ids)

    def propose(self, committed: list[int], k: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> Proposal:
        tokens: list[int] = []
        draft_probs: list[torch.Tensor | None] = []
        from_lookup: list[bool] = []
        forwards = self.draft.forwards
        for _ in range(k):
            token, probs = self.lookup.guess(committed, tokens), None
            looked_up = token is not None
            if not looked_up:
                drafted = self.draft.step(committed + tokens, sampling, generator)
                if drafted is None:
                    break
                token, probs = drafted
            tokens.append(token)
            draft_probs.append(probs)
            from_lookup.append(looked_up)
        return Proposal(tokens, draft_probs, self.draft.draft_ids, from_lookup, self.draft.forwards - forwards)

    def rollback(self, n_committed: int) -> None:
        self.lookup.rollback(n_committed)
        self.draft.rollback(n_committed)


def check_lookup_ngram(lookup_ngram: int) -> None:
    check_int("lookup_ngram", lookup_ngram, 0)
    if 0 < lookup_ngram < MIN_NGRAM:
        raise ValueError(f"lookup_ngram must be 0 (off) or >= {MIN_NGRAM}, got {lookup_ngram}")


def make_proposer(draft_runner: Runner, lookup_ngram: int = 0) -> DraftProposer | LookupThenDraft:
    """The draft alone (lookup_ngram 0), or prompt lookup over n-grams of up to lookup_ngram tokens
    (at least 2) first and the draft where lookup finds nothing."""
    check_lookup_ngram(lookup_ngram)
    draft = DraftProposer(draft_runner)
    return LookupThenDraft(LookupProposer(lookup_ngram), draft) if lookup_ngram else draft
