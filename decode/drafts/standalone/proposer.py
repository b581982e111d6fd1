"""The standalone draft's proposer: a draft LM (any Runner) sampled one token at a time, its cache
rolled back by length after verification (the seam it implements: decode/proposal.py)."""

from __future__ import annotations

import torch

from common.sampling import SamplingParams, sample
from decode.proposal import Proposal
from decode.runners import Runner


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
