"""The feature draft's proposer (decode/drafts/feature/model.py): it drafts from the target's own hidden states.

Draft position i reads a hidden state and the target's embedding of token i + 1, and predicts token
i + 2. Where the target has verified position i (fed token i in a forward whose output is committed),
the hidden state is `fc` of the target's hidden states at i; beyond, the draft's own output at i - 1.

The bookkeeping, with n committed tokens: speculative_decode keeps target_runner.length == n - 1, so
while proposing the target has verified positions 0..n-2. Token n comes from draft position n - 2
(the target's features there and token n - 1); each further token from one more position on the
draft's own outputs. The target's hidden states come with its forwards: those of the prompt (all but
its last token) before `reset`, those of a verification before `rollback`, which keeps the rows of
positions that stay committed. They wait in `pending` until the next `step` reads them all in one
draft forward ("catching up"). `rollback` drops the draft's cache positions built from its own
outputs: the next catch-up rebuilds them from the target's features.

Invariant: verified + pending rows == target_runner.length while proposing (every position the target
has verified is either read or pending).
"""

from __future__ import annotations

import torch

from common.sampling import SamplingParams, sample
from decode.drafts.feature.model import FeatureDraft, FeatureDraftCache
from decode.proposal import Proposal
from decode.proposers import LookupProposer, LookupThenDraft, check_lookup_ngram
from decode.runners import Runner


class FeatureProposer:
    """Proposes with a FeatureDraft from the hidden states `target_runner` keeps (implements Proposer,
    and Drafter for LookupThenDraft). `target_embeddings` [V', hidden]: the target's input embedding
    matrix, which the draft reads but does not own."""

    def __init__(self, target_runner: Runner, draft: FeatureDraft, target_embeddings: torch.Tensor):
        layers = tuple(draft.config.target_layers)
        if tuple(target_runner.hidden_layers) != layers:
            raise ValueError(f"the target runner keeps the hidden states of layers {list(target_runner.hidden_layers)}"
                             f", the feature draft reads layers {list(layers)}: build it with "
                             "hidden_layers=draft.config.target_layers (decode.api.build_feature_runner)")
        self.target_runner = target_runner
        self.draft = draft
        self.cache = FeatureDraftCache(draft)
        self.embeddings = target_embeddings
        self.draft_ids = draft.draft_ids  # [N] target id of each head row
        self.row_ids = draft.draft_ids.tolist()  # the same, for host-side lookups
        self.max_length = self.cache.capacity
        self.forwards = 0
        self.verified = 0
        """Cache positions built from the target's features (0..verified-1): committed text, never dropped."""
        self.pending: list[torch.Tensor] = []
        """The target's hidden states [m, layers, hidden] of the verified positions after those, unread."""
        self.last_out: torch.Tensor | None = None
        """The draft's output [hidden] at cache position cache.length - 1 (None once dropped)."""

    def reset(self, prompt_ids: list[int]) -> None:
        self.cache.reset()
        self.verified, self.pending, self.last_out = 0, [], None
        fed = self.target_runner.length  # the prompt but its last token; 0 (and stale states) for one token
        assert fed == len(prompt_ids) - 1, (fed, len(prompt_ids))
        if fed:
            self._keep_target_rows(fed)

    def _keep_target_rows(self, count: int) -> None:
        """Keep the first `count` rows of the target's last forward as pending."""
        rows = self.target_runner.hidden_states  # [n, layers, hidden] of the last forward
        assert rows is not None and rows.shape[0] >= count, (None if rows is None else rows.shape, count)
        self.pending.append(rows[:count])

    def embed(self, token_ids: list[int]) -> torch.Tensor:
        """The target's input embeddings [n, hidden] of token_ids, in the draft's dtype."""
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.embeddings.device)
        return self.embeddings[ids].to(self.draft.fc.weight.dtype)

    @torch.no_grad()
    def step(self, context: list[int], sampling: SamplingParams,
             generator: torch.Generator | None) -> tuple[int, torch.Tensor | None] | None:
        """The token after `context` (committed + proposed so far) and the distribution [N] over the head's
        rows it was drawn from (None at temperature 0: the argmax). None with no position to draft from
        (a one-token prompt before the target's first forward)."""
        out = self.out_before(context)
        if out is None:
            return None
        logits = self.draft.logits(out)  # [N] fp32
        if sampling.greedy:
            row, probs = int(logits.argmax()), None
        else:
            probs = sampling.warp(logits)
            row = int(sample(probs, generator))
        return self.row_ids[row], probs

    @torch.no_grad()
    def out_before(self, context: list[int]) -> torch.Tensor | None:
        """The draft's output [hidden] whose logits predict the token after `context`, after reading every
        verified position not read yet; None with no position to draft from."""
        verified_end = self.verified + sum(rows.shape[0] for rows in self.pending)
        assert verified_end == self.target_runner.length, (verified_end, self.target_runner.length)
        last = len(context) - 2  # the draft position whose output predicts the next token
        if last < 0:
            return None
        if self.pending:  # catch up: every verified position not read yet, in one forward
            hidden = self.draft.fuse(torch.cat(self.pending))  # [m, hidden]
            out = self.cache.forward(hidden, self.embed(context[self.verified + 1 : verified_end + 1]))
            self.verified, self.pending, self.last_out = verified_end, [], out[-1]
            self.forwards += 1
        while self.cache.length <= last:  # on the draft's own outputs, one position per forward
            position = self.cache.length
            assert self.last_out is not None
            out = self.cache.forward(self.last_out[None], self.embed(context[position + 1 : position + 2]))
            self.last_out = out[0]
            self.forwards += 1
        return self.last_out

    def propose(self, committed: list[int], k: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> Proposal:
        tokens: list[int] = []
        draft_probs: list[torch.Tensor | None] = []
        forwards = self.forwards
        while len(tokens) < k and (drafted := self.step(committed + tokens, sampling, generator)) is not None:
            tokens.append(drafted[0])
            draft_probs.append(drafted[1])
        return Proposal(tokens, draft_probs, self.draft_ids, [False] * len(tokens), self.forwards - forwards)

    def rollback(self, n_committed: int) -> None:
        """Read the target's rows of the verification that committed up to n_committed tokens (its forward
        began at the first position not yet verified), and drop the draft's own-output positions."""
        verified_end = self.verified + sum(rows.shape[0] for rows in self.pending)
        if n_committed - 1 > verified_end:
            self._keep_target_rows(n_committed - 1 - verified_end)
        if self.cache.length > self.verified:
            self.cache.rollback(self.verified)
            self.last_out = None


def make_feature_proposer(target_runner: Runner, draft: FeatureDraft, target_embeddings: torch.Tensor,
                          lookup_ngram: int = 0) -> FeatureProposer | LookupThenDraft:
    """The feature draft alone (lookup_ngram 0), or prompt lookup first and the feature draft where
    lookup finds nothing (the draft reads through the looked-up tokens before it drafts again)."""
    check_lookup_ngram(lookup_ngram)
    proposer = FeatureProposer(target_runner, draft, target_embeddings)
    return LookupThenDraft(LookupProposer(lookup_ngram), proposer) if lookup_ngram else proposer
