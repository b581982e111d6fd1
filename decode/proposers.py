"""Proposers: where the tokens the target verifies in one forward come from.

The speculative loop (decode/speculative.py) asks a proposer for up to k tokens after the committed
text, verifies them against the target, and tells the proposer how much text is committed now:

  reset(prompt_ids)                                  a new prompt
  propose(committed, k, sampling, generator) -> Proposal
  rollback(n_committed)                              after verification

The acceptance rule stays exact for any proposer as long as each Proposal carries the distribution
each token was drawn from (None: proposed with probability 1) and depends only on the text so far.
  DraftProposer     a draft LM sampled at each position (its cache rolled back by length)
  LookupProposer    prompt lookup alone: tokens copied from earlier text (decode/lookup.py)
  LookupThenDraft   at each position lookup first, else the draft (a draft LM or a feature draft)
  FeatureProposer   a feature-level draft reading the target's hidden states (decode/feature_proposer.py)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from decode.checks import check_int
from decode.lookup import MIN_NGRAM, NgramIndex
from decode.runners import Runner
from decode.sampling import SamplingParams, sample


@dataclass
class Proposal:
    tokens: list[int]
    """Proposed token ids, in order."""
    draft_probs: list[torch.Tensor | None]
    """Per token, the distribution it was drawn from: [N] over the draft's rows, or None when it was
    proposed with probability 1 (a lookup; every draft token at temperature 0, where the draft's
    distribution is the one-hot of its argmax)."""
    draft_ids: torch.Tensor | None
    """[N] token id of each draft row; None when row r is token r."""
    from_lookup: list[bool]
    """Per token, whether prompt lookup proposed it (no draft forward)."""
    draft_forwards: int
    """Draft forward passes this proposal ran (the cost model's s): one per drafted token for a draft LM;
    a feature draft also runs one per looked-up token it reads through before drafting again."""


class Proposer(Protocol):
    max_length: int | None
    """The longest text the proposer can read (its model's context); None: no limit."""

    def reset(self, prompt_ids: list[int]) -> None:
        """Start on a new prompt."""

    def propose(self, committed: list[int], k: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> Proposal:
        """Up to k tokens to follow `committed` (the prompt and every token emitted so far)."""

    def rollback(self, n_committed: int) -> None:
        """Verification kept `n_committed` tokens: forget whatever was read beyond them."""


class Drafter(Protocol):
    """A draft that proposes one token at a time: what LookupThenDraft puts behind prompt lookup."""

    draft_ids: torch.Tensor | None
    """[N] token id of each row of the distributions `step` returns; None when row r is token r."""
    max_length: int | None
    forwards: int
    """Draft forward passes run so far (a block's count is the difference)."""

    def reset(self, prompt_ids: list[int]) -> None: ...

    def step(self, context: list[int], sampling: SamplingParams,
             generator: torch.Generator | None) -> tuple[int, torch.Tensor | None] | None:
        """The next token after `context` and the distribution it was drawn from (None: greedy), or None
        when the draft cannot propose there."""

    def rollback(self, n_committed: int) -> None: ...


class DraftProposer:
    """A draft LM: one forward and one draw per token.

    An old vocabulary-subset draft is warped and sampled over its N rows (the same distribution as
    over the full vocabulary with zeros outside the subset). A spread_other draft (decode/vocab.py) is
    warped and sampled over the full vocabulary, its "other" logit at every outside id: the
    distribution its full-vocabulary export gives under the same SamplingParams (top-k and top-p
    included, which see the V - N tied outside logits one by one), so native and exported acceptance
    match; drawing an outside token there is drawing "other" and then one outside id uniformly."""

    def __init__(self, runner: Runner):
        self.runner = runner
        subset = runner.subset
        row_sampled = subset is not None and not subset.spread_other
        self.draft_ids = subset.ids if row_sampled else None  # [N] id of each row; None: row r is token r
        self.max_length = runner.max_length
        self.forwards = 0

    def reset(self, prompt_ids: list[int]) -> None:
        self.runner.reset()
        if len(prompt_ids) > 1:  # all but the last prompt token; the first proposal feeds that one
            self.runner.forward(self.readable(prompt_ids[:-1]), 1)

    def readable(self, token_ids: list[int]) -> torch.Tensor:
        """token_ids as the draft's input [n]. A draft with fewer rows than the target reads the target's
        other ids as its last row: what the draft reads changes its proposals, never the accept rule's
        exactness."""
        ids = torch.tensor(token_ids, dtype=torch.long)
        if max(token_ids) >= self.runner.vocab_size:
            ids = ids.clamp(max=self.runner.vocab_size - 1)
        return ids

    def step(self, context: list[int], sampling: SamplingParams,
             generator: torch.Generator | None) -> tuple[int, torch.Tensor | None]:
        """The next token after `context` and the distribution [N] (over the draft's rows, or the full
        vocabulary when draft_ids is None) it was drawn from (None at temperature 0: the argmax).
        Feeds every token of `context` the cache has not seen: drafted ones, and committed ones (more
        than one after a block proposed by lookup alone)."""
        ids = self.readable(context[self.runner.length:])
        logits = self.runner.forward(ids, 1, full_vocab=self.draft_ids is None)[0]  # [N] or [V]
        self.forwards += 1
        if sampling.greedy:
            row, probs = int(logits.argmax()), None
        else:
            probs = sampling.warp(logits)
            row = int(sample(probs, generator))
        return (row if self.draft_ids is None else int(self.draft_ids[row])), probs

    def propose(self, committed: list[int], k: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> Proposal:
        tokens: list[int] = []
        draft_probs: list[torch.Tensor | None] = []
        for _ in range(k):
            token, probs = self.step(committed + tokens, sampling, generator)
            tokens.append(token)
            draft_probs.append(probs)
        return Proposal(tokens, draft_probs, self.draft_ids, [False] * k, k)

    def rollback(self, n_committed: int) -> None:
        # Back to "everything committed but the last token" (less if the draft has not read that far).
        self.runner.rollback(min(self.runner.length, n_committed - 1))


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
