"""Tree proposers: a draft expands a tree of candidates level by level, one draft forward per level.

  build_tree          static shapes (children per depth) and dynamic ones (EAGLE-2: expand the most
                      probable nodes by cumulative draft probability, keep the `nodes` most probable)
  ChainBacked         the base of each draft kind's tree proposer: a standalone draft LM's
                      (decode/drafts/standalone/tree_proposer.py: each level's nodes in one masked
                      forward) and the feature draft's (decode/drafts/feature/tree_proposer.py)
  LookupTreeProposer  either of them with prompt lookup's guess as one more branch from the root

A node's children are its draft distribution's most probable tokens (the temperature's warped
distribution at T > 0; the plain softmax ranks them at T = 0). They are chosen deterministically,
so the acceptance rule tests each as a one-hot (decode/tree_decode.py): trying them in turn with the
target renormalised without the rejected ones is drawing from the target and looking the draw up
among the children. Cumulative probabilities only rank nodes; they never enter the acceptance test.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import torch

from common.sampling import SamplingParams, sample
from decode.proposers import LookupProposer
from decode.tree import DynamicTree, StaticTree, TokenTree, TreeShape, TreeShapeError, best_budget, deeper_pays


class LevelDrafter(Protocol):
    draft_ids: torch.Tensor | None
    forwards: int
    costs: tuple[float, Callable[[float], float]] | None
    """(c, r): a draft forward and the verification of n nodes, in target steps, for nodes=auto."""

    def root(self, committed: list[int]) -> torch.Tensor | None:
        """Logits [N] of the token after `committed` (None: no position to draft from)."""

    def expand(self, tree: TokenTree, nodes: list[int]) -> torch.Tensor:
        """Logits [len(nodes), N] of the children of `nodes`, whose parents were expanded before."""

    def finish(self) -> None:
        """Forget the tree's positions: the draft's cache holds the committed text again."""


def build_tree(drafter: LevelDrafter, committed: list[int], shape: TreeShape, max_depth: int,
               sampling: SamplingParams, generator: torch.Generator | None = None) -> tuple[TokenTree, int]:
    """A tree of at most max_depth levels after `committed` and the draft forwards it took."""
    forwards, tree = drafter.forwards, TokenTree()
    depth = min(shape.depth, max_depth)
    logits = drafter.root(committed) if depth else None
    if logits is None:
        return tree, drafter.forwards - forwards
    frontier, scores = [-1], {-1: 0.0}  # cumulative log draft probability of each node
    logits = logits[None]
    static = isinstance(shape, StaticTree)
    for d in range(depth):
        width = shape.branching[d] if static else shape.branch
        if static and shape.sampled and not sampling.greedy:
            new = _draw_children(tree, frontier, sampling.warp(logits), width, drafter.draft_ids, generator, scores)
        else:
            new = _add_children(tree, frontier, logits, width, sampling, drafter.draft_ids, scores)
        if d == depth - 1 or not new:
            break
        frontier = new if static else sorted(new, key=lambda i: -scores[i])[: shape.branch]
        if not static and shape.nodes is None and not _deeper_pays(drafter, scores, frontier, d + 1):
            break
        frontier.sort()
        logits = drafter.expand(tree, frontier)
    drafter.finish()
    forwards = drafter.forwards - forwards
    if isinstance(shape, DynamicTree):
        budget = shape.nodes or _auto_budget(drafter, scores, forwards)
        if len(tree) > budget:
            # A child is never more probable than its parent and comes after it, so the best `budget` by
            # (probability, creation order) include every kept node's ancestors.
            keep = sorted(sorted(range(len(tree)), key=lambda i: (-scores[i], i))[:budget])
            tree = tree.subtree(keep)
    return tree, forwards


def _costs(drafter: LevelDrafter) -> tuple[float, Callable[[float], float]]:
    if drafter.costs is None:
        raise TreeShapeError("nodes=auto chooses each tree's size from the measured cost model: set the "
                             "proposer's costs (c, r) first (eval-speedup does), or give a node count")
    return drafter.costs


def _values(scores: dict[int, float]) -> list[float]:
    return [math.exp(v) for node, v in scores.items() if node >= 0]


def _auto_budget(drafter: LevelDrafter, scores: dict[int, float], forwards: int) -> int:
    """nodes=auto: the node count the cost model predicts fastest for this tree."""
    return best_budget(_values(scores), forwards, *_costs(drafter))[0]


def _deeper_pays(drafter: LevelDrafter, scores: dict[int, float], frontier: list[int], forwards: int) -> bool:
    """nodes=auto grows the tree one level deeper only where the cost model says it can pay."""
    return deeper_pays(_values(scores), math.exp(max(scores[i] for i in frontier)), forwards, *_costs(drafter))


def _add_children(tree: TokenTree, parents: list[int], logits: torch.Tensor, width: int, sampling: SamplingParams,
                  draft_ids: torch.Tensor | None, scores: dict[int, float]) -> list[int]:
    """Each parent's `width` most probable tokens as its children (none of probability 0)."""
    probs = logits.float().softmax(-1) if sampling.greedy else sampling.warp(logits)  # [F, N]
    top = probs.topk(min(width, probs.shape[-1]), dim=-1)
    rows = top.indices if draft_ids is None else draft_ids[top.indices]
    new = []
    for parent, values, tokens in zip(parents, top.values.tolist(), rows.tolist()):
        for p, token in zip(values, tokens):
            if p > 0:
                child = tree.add(token, parent)
                scores[child] = scores[parent] + math.log(p)
                new.append(child)
    return new


def _draw_children(tree: TokenTree, parents: list[int], probs: torch.Tensor, width: int,
                   draft_ids: torch.Tensor | None, generator: torch.Generator | None,
                   scores: dict[int, float]) -> list[int]:
    """Each parent's `width` children drawn from its warped draft distribution probs [F, N] without
    replacement; child i keeps the distribution it was drawn from (the draft's without children 1..i-1)."""
    new = []
    for parent, row_probs in zip(parents, probs):
        left = row_probs
        for _ in range(width):
            if not left.sum() > 0:  # fewer tokens than children in the warped support
                break
            drawn = left / left.sum()
            row = int(sample(drawn, generator))
            child = tree.add(row if draft_ids is None else int(draft_ids[row]), parent, drawn)
            scores[child] = scores[parent] + math.log(float(row_probs[row]))
            new.append(child)
            left = left.clone()
            left[row] = 0.0
    return new


def level_window(tree: TokenTree, nodes: list[int], slots: dict[int, int], prefix_end: int,
                 start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions [m] and visibility [m, start + m] of `nodes` fed into slots start.. of a draft's cache
    that holds the committed text in slots 0..prefix_end-1 and expanded nodes at `slots` (updated)."""
    m = len(nodes)
    visible = torch.zeros(m, start + m, dtype=torch.bool)
    visible[:, :prefix_end] = True
    for j, node in enumerate(nodes):
        slots[node] = start + j
        while node >= 0:  # itself and its ancestors, all expanded before it
            visible[j, slots[node]] = True
            node = tree.parents[node]
    positions = torch.tensor([prefix_end - 1 + tree.depths[i] for i in nodes], dtype=torch.long)
    return positions, visible


class ChainBacked:
    """A tree proposer over a chain proposer (`self.chain`) that keeps the draft's state between trees."""

    def reset(self, prompt_ids: list[int]) -> None:
        self.chain.reset(prompt_ids)

    def rollback(self, n_committed: int) -> None:
        self.chain.rollback(n_committed)

    def propose_tree(self, committed: list[int], shape: TreeShape, max_depth: int, sampling: SamplingParams,
                     generator: torch.Generator | None) -> tuple[TokenTree, int]:
        return build_tree(self, committed, shape, max_depth, sampling, generator)


class LookupTreeProposer:
    """A tree proposer with prompt lookup's guess (decode/lookup.py: the tokens that followed the last
    n-gram earlier in the text) as one more branch from the root, as deep as the tree, merged into the
    draft's nodes where they coincide. Looked-up nodes cost no draft forward, and are tested as one-hots
    like the draft's top children."""

    def __init__(self, lookup: LookupProposer, proposer: ChainBacked):
        self.lookup, self.proposer = lookup, proposer
        self.draft_ids, self.max_length = proposer.draft_ids, proposer.max_length

    @property
    def costs(self):
        return self.proposer.costs

    @costs.setter
    def costs(self, value) -> None:
        self.proposer.costs = value

    def reset(self, prompt_ids: list[int]) -> None:
        self.lookup.reset(prompt_ids)
        self.proposer.reset(prompt_ids)

    def rollback(self, n_committed: int) -> None:
        self.proposer.rollback(n_committed)

    def propose_tree(self, committed: list[int], shape: TreeShape, max_depth: int, sampling: SamplingParams,
                     generator: torch.Generator | None) -> tuple[TokenTree, int]:
        tree, forwards = self.proposer.propose_tree(committed, shape, max_depth, sampling, generator)
        node, guessed = -1, []
        while len(guessed) < min(shape.depth, max_depth) and (token := self.lookup.guess(committed, guessed)) is not None:
            guessed.append(token)
            same = next((c for c in tree.children.get(node, ()) if tree.tokens[c] == token), None)
            node = same if same is not None else tree.add(token, node, looked_up=True)
        return tree, forwards
