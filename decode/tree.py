"""Draft trees: several candidate continuations verified in one target forward.

A tree's nodes are proposed tokens; node i's parent is an earlier node or -1, the root (the last
committed token). The target reads the root and every node in one forward: node i sits at the
position of its depth and attends the committed text, its ancestors and itself (`tree_window`),
so each node's logits are those a chain ending in that node would give.

Shapes (`parse_tree`), written in eval.trees:
  "4x2x1x1"                         static: every node at depth d has b_d children (the draft's top b_d)
  "sampled:4x2x1x1"                 the same shape, children drawn from the draft without replacement at
                                    T > 0 (Sequoia, arXiv 2402.12374); the draft's top ones at T = 0
  "dynamic:depth=6,branch=4,nodes=24"
                                    EAGLE-2 (arXiv 2406.16858): at each depth expand the `branch`
                                    nodes of highest cumulative draft probability, `branch` children
                                    each; keep the `nodes` most probable nodes of all of them
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from common.errors import UserError


MAX_TREE_NODES = 64
"""Nodes one target forward verifies at most: the cost model measures r(n) up to this many; on the
CPUs measured, a forward over 64 rows costs several one-token steps, past any useful tree."""


class TreeShapeError(UserError):
    """A tree shape that cannot be drafted or verified."""


@dataclass(frozen=True)
class StaticTree:
    branching: tuple[int, ...]
    """Children of every node at depth d (the root is depth 0)."""
    sampled: bool = False
    """At T > 0, draw each node's children from the draft without replacement (each tested against the
    draft's distribution without its earlier siblings) instead of taking its most probable ones."""

    @property
    def depth(self) -> int:
        return len(self.branching)

    @property
    def nodes(self) -> int:
        return sum(math.prod(self.branching[: d + 1]) for d in range(self.depth))

    @property
    def label(self) -> str:
        return ("sampled:" if self.sampled else "") + "x".join(map(str, self.branching))

    @property
    def max_nodes(self) -> int:
        return self.nodes


@dataclass(frozen=True)
class DynamicTree:
    depth: int
    """Draft forwards per tree; the deepest node is at this depth."""
    branch: int
    """Nodes expanded per depth, and children per expanded node."""
    nodes: int | None
    """Nodes kept (the most probable by cumulative draft probability); None ('auto'): per tree, the count
    `best_budget` predicts fastest from the measured costs, and no deeper than `deeper_pays` allows."""

    @property
    def label(self) -> str:
        return f"dynamic:depth={self.depth},branch={self.branch},nodes={self.nodes or 'auto'}"

    @property
    def max_nodes(self) -> int:
        return self.nodes or min(MAX_TREE_NODES, sum(self.branch ** (d + 1) for d in range(self.depth)))


TreeShape = StaticTree | DynamicTree


def parse_tree(spec: str) -> TreeShape:
    """'4x2x1x1' or 'dynamic:depth=6,branch=4,nodes=24' -> a shape; a TreeShapeError says what is wrong."""
    text = str(spec).strip()
    if text.startswith("dynamic:"):
        return _parse_dynamic(text)
    sampled = text.startswith("sampled:")
    if sampled and text[len("sampled:"):].startswith("dynamic:"):
        raise TreeShapeError(f"tree {spec!r}: a dynamic tree keeps the nodes its draft rates most probable, "
                             "which would bias drawn children; sampled children need a static shape")
    text = text[len("sampled:"):] if sampled else text
    parts = text.split("x")
    if not text or not all(p.strip().isdigit() for p in parts):
        raise TreeShapeError(f"tree {spec!r}: write children per depth as '4x2x1' (or 'sampled:4x2x1'), or "
                             "'dynamic:depth=6,branch=4,nodes=24'")
    branching = tuple(int(p) for p in parts)
    if min(branching) < 1:
        raise TreeShapeError(f"tree {spec!r}: every depth needs at least one child per node")
    shape = StaticTree(branching, sampled)
    _check_nodes(spec, shape.nodes)
    return shape


def _parse_dynamic(text: str) -> DynamicTree:
    values: dict[str, int | None] = {}
    for item in text[len("dynamic:"):].split(","):
        key, _, value = (part.strip() for part in item.partition("="))
        if (key, value) == ("nodes", "auto"):
            values[key] = None
        elif key in ("depth", "branch", "nodes") and value.isdigit():
            values[key] = int(value)
        else:
            raise TreeShapeError(f"tree {text!r}: write 'dynamic:depth=D,branch=B,nodes=N' with integers "
                                 "(nodes=auto: the count the cost model predicts fastest)")
    if set(values) != {"depth", "branch", "nodes"}:
        raise TreeShapeError(f"tree {text!r}: give depth, branch and nodes")
    for key, value in values.items():
        if value is not None and value < 1:
            raise TreeShapeError(f"tree {text!r}: {key} must be >= 1 (a node budget of 0 verifies nothing)")
    if values["nodes"] is not None:
        _check_nodes(text, values["nodes"])
    return DynamicTree(**values)


def _check_nodes(spec: str, nodes: int) -> None:
    if nodes > MAX_TREE_NODES:
        raise TreeShapeError(f"tree {spec!r} has {nodes} nodes; one target forward verifies at most "
                             f"{MAX_TREE_NODES}")


def best_budget(values: list[float], draft_forwards: int, c: float, r) -> tuple[int, float]:
    """The node count n (>= 1) that maximises predicted tokens per unit of time, and that rate:
    (1 + sum of the n largest `values`) / (draft_forwards * c + r(n)). A node's value, its cumulative
    draft probability, stands for the chance the target accepts it (EAGLE-2's premise); c is a draft
    forward and r(n) the verification of n nodes, both in target steps (decode/timing.py)."""
    best, best_rate, tokens = 1, 0.0, 1.0
    for n, value in enumerate(sorted(values, reverse=True)[:MAX_TREE_NODES], start=1):
        tokens += value
        rate = tokens / (draft_forwards * c + r(n))
        if rate > best_rate:
            best, best_rate = n, rate
    return best, best_rate


def deeper_pays(values: list[float], frontier_best: float, draft_forwards: int, c: float, r) -> bool:
    """Whether one more level can raise `best_budget`'s rate: its best node, worth at most the best value
    of the nodes it grows from, joins the best tree so far for one more draft forward."""
    n, rate = best_budget(values, draft_forwards, c, r)
    tokens = 1 + sum(sorted(values, reverse=True)[:n])
    return (tokens + frontier_best) / ((draft_forwards + 1) * c + r(n + 1)) > rate


def check_tree_runner(runner, role: str) -> None:
    if not hasattr(runner, "forward_masked"):
        raise TreeShapeError(f"the {role}'s {type(runner).__name__} cannot verify a tree: it has no masked "
                             "forward (forward_masked); the project's runners (lean, graph, hf) all have one")


def check_tree_fits(shape: TreeShape, prompt_len: int, max_new_tokens: int, max_lengths: list[int | None]) -> None:
    """A tree's deepest node must fit each model's context after the longest committed text."""
    needed = prompt_len + max_new_tokens + shape.depth
    for max_length in max_lengths:
        if max_length is not None and needed > max_length:
            raise TreeShapeError(f"tree {shape.label} is {shape.depth} deep: prompt ({prompt_len}) + "
                                 f"max_new_tokens ({max_new_tokens}) + depth exceeds the model's context "
                                 f"of {max_length} tokens")


@dataclass
class TokenTree:
    """Proposed nodes in creation order (a parent always before its children)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    """Index of each node's parent; -1: the root."""
    draft_probs: list[torch.Tensor | None] = field(default_factory=list)
    """The distribution each node was drawn from (given its earlier siblings), as `Proposal.draft_probs`;
    None: chosen deterministically (the draft's top children), tested as a one-hot."""
    depths: list[int] = field(default_factory=list)
    children: dict[int, list[int]] = field(default_factory=dict)
    """Children of each node (-1: the root), in the order they are tried."""
    looked_up: list[bool] = field(default_factory=list)
    """Per node, whether prompt lookup proposed it (no draft forward)."""

    def add(self, token: int, parent: int, probs: torch.Tensor | None = None, looked_up: bool = False) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.draft_probs.append(probs)
        self.looked_up.append(looked_up)
        self.depths.append(1 if parent < 0 else self.depths[parent] + 1)
        self.children.setdefault(parent, []).append(len(self.tokens) - 1)
        return len(self.tokens) - 1

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def depth(self) -> int:
        return max(self.depths, default=0)

    def path_tokens(self, path: list[int]) -> list[int]:
        return [self.tokens[i] for i in path]

    def subtree(self, keep: list[int]) -> TokenTree:
        """The nodes `keep` (ancestor-closed, in creation order) as a tree of their own."""
        index = {old: new for new, old in enumerate(keep)}
        tree = TokenTree()
        for old in keep:
            parent = self.parents[old]
            tree.add(self.tokens[old], index[parent] if parent >= 0 else -1, self.draft_probs[old], self.looked_up[old])
        return tree


def ancestors(parents: list[int]) -> torch.Tensor:
    """[n, n] bool: entry (i, j) is True when node j is node i or one of its ancestors."""
    n = len(parents)
    seen = torch.eye(n, dtype=torch.bool)
    for i, parent in enumerate(parents):
        if parent >= 0:
            seen[i] |= seen[parent]
    return seen


def tree_window(start: int, prefix: int, parents: list[int], depths: list[int],
                device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Positions [m] and visibility [m, start + m] (True = attend) of a forward at cache slots
    start..start+m-1 over `prefix` committed tokens (causal) and then the tree's nodes, m = prefix + n.
    Node i is at position start + prefix - 1 + depth i and sees every slot before the nodes, its
    ancestors' slots and its own."""
    n = len(parents)
    m, end = prefix + n, start + prefix + n
    positions = torch.arange(start, end)
    positions[prefix:] = start + prefix - 1 + torch.tensor(depths, dtype=torch.long)
    visible = torch.ones(m, end, dtype=torch.bool).tril(start)
    visible[prefix:, start + prefix:] = ancestors(parents)
    return positions.to(device), visible.to(device)
