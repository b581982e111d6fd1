"""The standalone draft drafting trees: each level's nodes go through one masked forward of the draft LM
(decode/tree_proposers.py builds the tree; decode/tree_decode.py verifies it)."""

from __future__ import annotations

import torch

from decode.drafts.standalone.proposer import DraftProposer
from decode.runners import Runner
from decode.tree import TokenTree, check_tree_runner
from decode.tree_proposers import ChainBacked, level_window


class DraftTreeProposer(ChainBacked):
    """A standalone draft LM drafting trees (implements decode.tree_decode.TreeProposer)."""

    def __init__(self, runner: Runner):
        check_tree_runner(runner, "draft")
        self.chain = DraftProposer(runner)  # reset, rollback and the draft's readable ids
        self.runner, self.draft_ids, self.max_length = runner, self.chain.draft_ids, runner.max_length
        self.forwards, self.costs = 0, None

    def root(self, committed: list[int]) -> torch.Tensor:
        ids = self.chain.readable(committed[self.runner.length:])
        self.prefix_end, self.slots = len(committed), {}
        self.forwards += 1
        return self.runner.forward(ids, 1, full_vocab=self.draft_ids is None)[0]

    def expand(self, tree: TokenTree, nodes: list[int]) -> torch.Tensor:
        positions, visible = level_window(tree, nodes, self.slots, self.prefix_end, self.runner.length)
        ids = self.chain.readable([tree.tokens[i] for i in nodes])
        self.forwards += 1
        return self.runner.forward_masked(ids, positions, visible, len(nodes), full_vocab=self.draft_ids is None)

    def finish(self) -> None:
        self.runner.rollback(self.prefix_end)
