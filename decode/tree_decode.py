"""Speculative decoding over draft trees (batch 1): one target forward verifies every node of a tree.

Step: the tree proposer drafts a tree (decode/tree_proposers.py); the target reads the last committed
token and every node in one forward (decode/tree.py `tree_window`); the acceptance rule walks down
from the root; the target's cache keeps the accepted path only (`runner.keep`).

The acceptance rule over a tree, at a node whose target distribution is p and whose children x_1..x_m
were drawn from q_1..q_m (q_i: the draft's distribution without the earlier siblings; a one-hot when
the draft chose x_i deterministically, its top children):
  for i = 1..m: accept x_i with probability min(1, p(x_i) / q_i(x_i)) and descend into it;
                on rejection p <- norm(max(0, p - q_i))
  none accepted: emit a token drawn from p (the correction; at a leaf, the bonus token).
Each trial emits exactly p: P(y) = min(p, q_i)(y) + (1 - sum min(p, q_i)) * norm(max(0, p - q_i))(y)
= p(y), by induction over the trials and the depths (SpecInfer, arXiv 2305.09781; Sequoia,
2402.12374), so the output is distributed as target-only sampling at any temperature. At
temperature 0 both are one-hot and the rule is "descend into the child equal to the target's argmax"
(`verify_tree_greedy`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from common.sampling import SamplingParams, sample
from decode.checks import check_context, check_int, prompt_ids
from decode.runners import Runner
from decode.speculative import SpeculativeOutput, cut_at_eos, draft_prob, eos_set, residual
from decode.stats import SpeculativeStats
from decode.tree import TokenTree, TreeShape, check_tree_fits, check_tree_runner, tree_window


class TreeProposer(Protocol):
    max_length: int | None
    draft_ids: torch.Tensor | None
    """[N] token id of each row of the nodes' draft_probs; None when row r is token r."""

    def reset(self, prompt_ids: list[int]) -> None: ...

    def propose_tree(self, committed: list[int], shape: TreeShape, max_depth: int, sampling: SamplingParams,
                     generator: torch.Generator | None) -> tuple[TokenTree, int]:
        """A tree of at most max_depth levels after `committed`, and the draft forwards it took."""

    def rollback(self, n_committed: int) -> None: ...


def verify_tree_greedy(tree: TokenTree, target_logits: torch.Tensor) -> tuple[list[int], list[int]]:
    """Temperature 0: follow the children equal to the target's argmax. target_logits [1 + n, V]: the
    root's row, then node i's at 1 + i. Returns (emitted tokens, accepted path of node indices)."""
    best = target_logits.argmax(-1).tolist()
    node, path = -1, []
    while True:
        want = best[node + 1]
        child = next((c for c in tree.children.get(node, ()) if tree.tokens[c] == want), None)
        if child is None:
            return tree.path_tokens(path) + [want], path
        path.append(child)
        node = child


def verify_tree(tree: TokenTree, target_probs: Callable[[int], torch.Tensor], generator: torch.Generator | None = None,
                draft_ids: torch.Tensor | None = None) -> tuple[list[int], list[int]]:
    """Temperature > 0: the multi-candidate rule of the module docstring. target_probs(row) -> [V]: the
    target's warped distribution at the root (row 0) or at node i (row 1 + i), asked only of the nodes the
    walk reaches. Returns (emitted tokens, accepted path)."""
    node, path = -1, []
    while True:
        p = target_probs(node + 1)
        rng_device = generator.device if generator is not None else p.device
        for child in tree.children.get(node, ()):
            token, proposal = tree.tokens[child], tree.draft_probs[child]
            accept_prob = min(1.0, float(p[token]) / draft_prob(proposal, token, draft_ids))
            if float(torch.rand((), generator=generator, device=rng_device)) < accept_prob:
                path.append(child)
                node = child
                break
            p = residual(p, proposal, token, draft_ids)
        else:
            return tree.path_tokens(path) + [int(sample(p, generator))], path


def tree_decode(target_runner: Runner, proposer: TreeProposer, input_ids: torch.Tensor, *, shape: TreeShape,
                max_new_tokens: int, sampling: SamplingParams, eos_token_id: int | list[int] | None = None,
                generator: torch.Generator | None = None) -> SpeculativeOutput:
    """Lossless speculative decoding over draft trees: the output is distributed exactly as target_decode's."""
    committed = prompt_ids(input_ids, target_runner.vocab_size)
    check_int("max_new_tokens", max_new_tokens, 1)
    check_tree_runner(target_runner, "target")
    check_context(len(committed), max_new_tokens, [target_runner.max_length, proposer.max_length])
    check_tree_fits(shape, len(committed), max_new_tokens, [target_runner.max_length, proposer.max_length])
    prompt_len, eos = len(committed), eos_set(eos_token_id)
    target_runner.reset()
    if prompt_len > 1:  # all but the last prompt token; the first verify forward feeds that one
        target_runner.forward(torch.tensor(committed[:-1]), 1)
    proposer.reset(committed)
    stats = SpeculativeStats(k=shape.depth)
    while len(committed) - prompt_len < max_new_tokens:
        remaining = max_new_tokens - (len(committed) - prompt_len)
        tree, draft_forwards = proposer.propose_tree(committed, shape, remaining - 1, sampling, generator)
        emitted, path = _verify(target_runner, committed, tree, sampling, generator, proposer.draft_ids)
        emitted, hit_eos = cut_at_eos(emitted, eos)
        # Keep the committed prefix and the accepted nodes the cache holds (all but the last emitted token).
        base = len(committed)
        target_runner.keep(base, [base + i for i in path[: len(emitted) - 1]])
        committed.extend(emitted)
        _record(stats, tree, path, emitted, draft_forwards)
        proposer.rollback(len(committed))
        assert target_runner.length == len(committed) - 1
        if hit_eos:
            break
    return SpeculativeOutput(tokens=torch.tensor(committed[prompt_len:], dtype=torch.long), stats=stats)


def _verify(target_runner: Runner, committed: list[int], tree: TokenTree, sampling: SamplingParams,
            generator: torch.Generator | None, draft_ids: torch.Tensor | None) -> tuple[list[int], list[int]]:
    """One target forward over [unseen committed..., the tree's nodes], then the acceptance rule."""
    start = target_runner.length
    prefix = committed[start:]
    positions, visible = tree_window(start, len(prefix), tree.parents, tree.depths)
    logits = target_runner.forward_masked(torch.tensor(prefix + tree.tokens, dtype=torch.long), positions,
                                          visible, len(tree) + 1)  # [1 + n, V]
    if sampling.greedy:
        return verify_tree_greedy(tree, logits)
    # Warp only the rows the walk visits (at most depth + 1): the 33 rows of a 32-node tree took 17 ms to
    # warp (T = 0.7, top-p 0.95, 2-core AVX2 EPYC), 0.4 of a target step, against ~1 ms for 2-3 rows.
    return verify_tree(tree, lambda row: sampling.warp(logits[row]), generator, draft_ids)


def _record(stats: SpeculativeStats, tree: TokenTree, path: list[int], emitted: list[int], draft_forwards: int) -> None:
    """One block: nodes verified, depths tested (the accepted path, and one more where its end had children)."""
    accepted = min(len(path), len(emitted))
    tried = len(path) + (1 if tree.children.get(path[-1] if path else -1) else 0)
    stats.record_block(proposed=len(tree), tried=min(tried, len(emitted)), accepted=accepted,
                       emitted=len(emitted), draft_forwards=draft_forwards, looked_up=sum(tree.looked_up),
                       looked_up_accepted=sum(tree.looked_up[i] for i in path[:accepted]))
