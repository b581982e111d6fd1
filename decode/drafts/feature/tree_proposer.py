"""The feature draft drafting trees: each level reads its parents' outputs and the target's embedding of
their tokens in one masked forward (decode/tree_proposers.py builds the tree; decode/tree_decode.py
verifies it)."""

from __future__ import annotations

import torch

from decode.drafts.feature.proposer import FeatureProposer
from decode.tree import TokenTree
from decode.tree_proposers import ChainBacked, level_window


class FeatureTreeProposer(ChainBacked):
    """The feature draft drafting trees (implements decode.tree_decode.TreeProposer): node i's level reads
    its parent's output and the target's embedding of its token, at position prefix + depth."""

    def __init__(self, proposer: FeatureProposer):
        self.chain = proposer  # the target's hidden states, the catch-up, reset and rollback
        self.draft_ids, self.max_length, self.costs = proposer.draft_ids, proposer.max_length, None

    @property
    def forwards(self) -> int:
        return self.chain.forwards

    def root(self, committed: list[int]) -> torch.Tensor | None:
        out = self.chain.out_before(committed)
        if out is None:
            return None
        self.prefix_end, self.slots, self.outs = self.chain.cache.length, {}, {-1: out}
        return self.chain.draft.logits(out)

    def expand(self, tree: TokenTree, nodes: list[int]) -> torch.Tensor:
        cache = self.chain.cache
        positions, visible = level_window(tree, nodes, self.slots, self.prefix_end, cache.length)
        hidden = torch.stack([self.outs[tree.parents[i]] for i in nodes])  # [m, hidden]
        out = cache.forward(hidden, self.chain.embed([tree.tokens[i] for i in nodes]),
                            positions.to(hidden.device), visible.to(hidden.device))
        self.outs.update(zip(nodes, out))
        self.chain.forwards += 1
        return self.chain.draft.logits(out)

    def finish(self) -> None:
        self.chain.cache.rollback(self.prefix_end)
