"""The feature draft's step in the shape decode/timing.py's cost model times (a Runner's forward,
rollback, reset, length and device), so its c is measured as the standalone draft's is."""

from __future__ import annotations

import torch

from decode.drafts.feature.model import FeatureDraft, FeatureDraftCache


class FeatureDraftSteps:
    """forward(ids) runs the positions of ids on a FeatureDraftCache and returns the head's logits over
    its rows: the first call after a reset (the context) from zero target features through `fc`, as a
    proposer's catch-up; every later call on the draft's own last output, as its steps inside a block.
    The same work as FeatureProposer's forwards; the values mean nothing."""

    def __init__(self, draft: FeatureDraft, target_embeddings: torch.Tensor):
        self.draft, self.embeddings = draft, target_embeddings
        self.cache = FeatureDraftCache(draft)
        self.device = draft.fc.weight.device
        self.last_out: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return self.cache.length

    def reset(self) -> None:
        self.cache.reset()
        self.last_out = None

    def rollback(self, length: int) -> None:
        self.cache.rollback(length)

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, num_logits: int = 1, full_vocab: bool = True) -> torch.Tensor:
        c = self.draft.config
        embeds = self.embeddings[ids.to(self.embeddings.device)].to(self.draft.fc.weight.dtype)  # [n, hidden]
        if self.last_out is None:
            hidden = self.draft.fuse(embeds.new_zeros(len(ids), len(c.target_layers), c.hidden_size))
        else:
            hidden = self.last_out.expand(len(ids), -1)
        out = self.cache.forward(hidden, embeds)
        self.last_out = out[-1]
        return self.draft.logits(out[-num_logits:])
