"""The proposer seam: where the tokens the target verifies in one forward come from.

The speculative loop (decode/speculative.py) asks a proposer for up to k tokens after the committed
text, verifies them against the target, and tells the proposer how much text is committed now:

  reset(prompt_ids)                                  a new prompt
  propose(committed, k, sampling, generator) -> Proposal
  rollback(n_committed)                              after verification

The acceptance rule stays exact for any proposer as long as each Proposal carries the distribution
each token was drawn from (None: proposed with probability 1) and depends only on the text so far.
  DraftProposer     a draft LM sampled at each position (decode/drafts/standalone/proposer.py)
  FeatureProposer   a feature-level draft reading the target's hidden states (decode/drafts/feature/proposer.py)
  LookupProposer    prompt lookup alone: tokens copied from earlier text (decode/proposers.py)
  LookupThenDraft   at each position lookup first, else the draft (decode/proposers.py)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from common.sampling import SamplingParams


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
