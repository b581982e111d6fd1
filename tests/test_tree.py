"""Draft trees (decode/tree.py, tree_proposers.py, tree_decode.py): masked forwards equal chain forwards,
the cache keeps the accepted path, lossless sampling (χ²), exact greedy, and bad shapes refused."""

from types import SimpleNamespace

import pytest
import torch
from scipy import stats as scipy_stats

from common.sampling import SamplingParams, sample
from decode.api import build_feature_runner, build_runners
from decode.drafts.feature.proposer import FeatureProposer
from decode.drafts.feature.tree_proposer import FeatureTreeProposer
from decode.drafts.standalone.tree_proposer import DraftTreeProposer
from decode.proposers import LookupProposer
from decode.runners import make_runner
from decode.speculative import target_decode
from decode.tree import (MAX_TREE_NODES, DynamicTree, StaticTree, TokenTree, TreeShapeError, ancestors, best_budget,
                         deeper_pays, parse_tree, tree_window)
from decode.tree_decode import tree_decode, verify_tree, verify_tree_greedy
from decode.tree_proposers import LookupTreeProposer
from tests.chi2 import continuations, target_only, two_sample_pvalue
from tests.conftest import negated_copy, random_feature_draft, small_llama, subset_llama


PROMPT = torch.tensor([[0, 3, 7, 2, 9]])
SHAPES = ["3x2x1", "dynamic:depth=4,branch=3,nodes=8"]
SAMPLED = ["3x2x1", "sampled:3x2x1", "dynamic:depth=4,branch=3,nodes=8"]
pytestmark = pytest.mark.usefixtures("one_thread")


def test_parse_tree_shapes():
    assert parse_tree("4x2x1x1") == StaticTree((4, 2, 1, 1))
    assert parse_tree("4x2x1x1").nodes == 4 + 8 + 8 + 8
    assert parse_tree("dynamic:depth=6,branch=4,nodes=24") == DynamicTree(6, 4, 24)
    assert parse_tree("2").depth == 1
    assert parse_tree("sampled:4x2") == StaticTree((4, 2), sampled=True)
    assert parse_tree("sampled:4x2").label == "sampled:4x2"


@pytest.mark.parametrize("spec, says", [
    ("", "children per depth"), ("3x0x1", "at least one child"), ("3,2", "children per depth"),
    ("dynamic:depth=4,branch=2,nodes=0", "node budget of 0"), ("dynamic:depth=4,branch=2", "give depth, branch"),
    ("dynamic:depth=4,width=2,nodes=8", "dynamic:depth=D"), ("8x8", f"at most {MAX_TREE_NODES}"),
    ("sampled:dynamic:depth=4,branch=2,nodes=8", "sampled children need a static shape"),
    (f"dynamic:depth=4,branch=2,nodes={MAX_TREE_NODES + 1}", f"at most {MAX_TREE_NODES}"),
])
def test_bad_tree_shapes_are_refused(spec, says):
    with pytest.raises(TreeShapeError, match=says):
        parse_tree(spec)


def example_tree() -> TokenTree:
    """root -> 5 (-> 6 -> 8, -> 7), 4 (-> 9)"""
    tree = TokenTree()
    for token, parent in [(5, -1), (4, -1), (6, 0), (7, 0), (9, 1), (8, 2)]:
        tree.add(token, parent)
    return tree


def test_tree_window_sees_ancestors_only():
    tree = example_tree()
    assert tree.depths == [1, 1, 2, 2, 2, 3]
    assert ancestors(tree.parents)[5].tolist() == [True, False, True, False, False, True]
    positions, visible = tree_window(10, 2, tree.parents, tree.depths)
    assert positions.tolist() == [10, 11, 12, 12, 13, 13, 13, 14]
    assert visible.shape == (8, 18)
    assert visible[0, :11].all() and not visible[0, 11:].any()  # committed rows are causal
    assert visible[7, :12].all() and visible[7, 12:].tolist() == [True, False, True, False, False, True]


def path_to(tree: TokenTree, node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = tree.parents[node]
    return path[::-1]


@pytest.mark.parametrize("backend", ["lean", "hf"])
def test_masked_forward_equals_each_paths_chain_and_keep_holds_the_path(backend):
    model = small_llama(seed=0, layers=2)
    tree, committed = example_tree(), [0, 3, 7, 2, 9]
    runner, fresh = make_runner(model, 16, backend), make_runner(model, 16, backend)
    runner.forward(torch.tensor(committed[:3]), 1)
    positions, visible = tree_window(3, 2, tree.parents, tree.depths)
    logits = runner.forward_masked(torch.tensor(committed[3:] + tree.tokens), positions, visible, len(tree) + 1)
    for node in range(len(tree)):
        fresh.reset()
        chain = fresh.forward(torch.tensor(committed + tree.path_tokens(path_to(tree, node))), 1)[0]
        torch.testing.assert_close(logits[1 + node], chain, rtol=1e-4, atol=1e-4)
    runner.keep(5, [5 + i for i in path_to(tree, 5)])  # accept 5 -> 6 -> 8
    assert runner.length == 8
    fresh.reset()
    expected = fresh.forward(torch.tensor(committed + [5, 6, 8, 11]), 1)
    torch.testing.assert_close(runner.forward(torch.tensor([11]), 1), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("backend", ["lean", "hf"])
@pytest.mark.parametrize("draft_kind", ["full", "subset"])
def test_greedy_tree_equals_target_only(pair, shape, backend, draft_kind):
    target, draft = pair
    if draft_kind == "subset":
        draft = subset_llama([0, 1, 2, 3, 5, 7, 9, 11, 13], 16, spread_other=True)
    target_runner, draft_runner = build_runners(target, draft, backend)
    base = target_decode(target_runner, PROMPT, max_new_tokens=20, sampling=SamplingParams())
    out = tree_decode(target_runner, DraftTreeProposer(draft_runner), PROMPT, shape=parse_tree(shape),
                      max_new_tokens=20, sampling=SamplingParams())
    assert out.tokens.tolist() == base.tolist()
    assert out.stats.emitted == 20 and out.stats.target_forwards <= 20


def test_a_draft_whose_children_are_all_wrong_emits_one_token_per_forward(pair):
    """The negated draft's top children are the target's least likely tokens (HF runner: the lean forward
    reads the weights, not the negating forward)."""
    target, _ = pair
    target_runner, draft_runner = build_runners(target, negated_copy(target), "hf")
    base = target_decode(target_runner, PROMPT, max_new_tokens=12, sampling=SamplingParams())
    out = tree_decode(target_runner, DraftTreeProposer(draft_runner), PROMPT, shape=parse_tree("3x2x1"),
                      max_new_tokens=12, sampling=SamplingParams())
    assert out.tokens.tolist() == base.tolist()
    assert out.stats.target_forwards == 12 and out.stats.accepted == 0 and out.stats.proposed > 12 * 9


@pytest.mark.parametrize("shape", SHAPES)
def test_greedy_feature_tree_equals_target_only(shape):
    target = small_llama(seed=0, layers=2)
    runner = build_feature_runner(target, feature := random_feature_draft(target))
    proposer = FeatureTreeProposer(FeatureProposer(runner, feature, target.get_input_embeddings().weight))
    base = target_decode(make_runner(target, 16), PROMPT, max_new_tokens=20, sampling=SamplingParams())
    out = tree_decode(runner, proposer, PROMPT, shape=parse_tree(shape), max_new_tokens=20,
                      sampling=SamplingParams())
    assert out.tokens.tolist() == base.tolist()
    one = tree_decode(runner, proposer, torch.tensor([[3]]), shape=parse_tree(shape), max_new_tokens=6,
                      sampling=SamplingParams())
    assert one.tokens.tolist() == target_decode(make_runner(target, 16), torch.tensor([[3]]), max_new_tokens=6,
                                                sampling=SamplingParams()).tolist()


def test_a_draft_equal_to_the_target_accepts_every_greedy_path(pair):
    target, _ = pair
    target_runner, draft_runner = build_runners(target, target, "lean")
    out = tree_decode(target_runner, DraftTreeProposer(draft_runner), PROMPT, shape=parse_tree("2x2x2"),
                      max_new_tokens=16, sampling=SamplingParams())
    assert out.stats.target_forwards == 4 and out.stats.accepted == 12  # 3 accepted + a bonus per forward


@pytest.mark.parametrize("warp", [dict(temperature=1.0), dict(temperature=0.7, top_k=5, top_p=0.9)])
@pytest.mark.parametrize("shape, draft_kind", [(shape, "full") for shape in SAMPLED] + [("sampled:3x2x1", "subset")])
def test_sampled_tree_sequences_match_target_only(pair, warp, shape, draft_kind):
    """Two-sample χ² on the joint histogram of 3-token continuations, tree against target-only."""
    target, draft = pair
    if draft_kind == "subset":  # an old subset draft: rows sampled over its 9 ids, drawn children mapped to ids
        draft = subset_llama([0, 1, 2, 3, 5, 7, 9, 11, 13], 16)
    target_runner, draft_runner = build_runners(target, draft, "lean")
    proposer, sampling, tree = DraftTreeProposer(draft_runner), SamplingParams(**warp), parse_tree(shape)
    spec = continuations(lambda g: tree_decode(target_runner, proposer, PROMPT, shape=tree, max_new_tokens=3,
                                               sampling=sampling, generator=g).tokens, 1000, seed=1)
    assert two_sample_pvalue(spec, target_only(target, PROMPT, 3, sampling)) > 1e-4


def random_dist(gen, size=6):
    p = torch.rand(size, generator=gen) + 0.05
    return p / p.sum()


@pytest.mark.parametrize("sampled", [False, True])
def test_multi_candidate_rule_emits_the_target_at_every_depth(sampled):
    """Context-free target p_d at depth d; a tree of 3 children at the root and 2 under each. Children are
    either the draft's top tokens (tested as one-hots) or drawn from q without replacement (each tested
    against q without its earlier siblings). The first two emitted tokens must follow p_0 and p_1."""
    gen = torch.Generator().manual_seed(3)
    target = torch.stack([random_dist(gen) for _ in range(3)])
    draft = torch.stack([random_dist(gen) for _ in range(3)])
    counts = torch.zeros(2, 6)
    for _ in range(6000):
        tree = TokenTree()
        for depth, parents in ((0, [-1]), (1, None)):
            for parent in parents if parents is not None else list(tree.children[-1]):
                q = draft[depth].clone()
                for _ in range(3 if depth == 0 else 2):
                    if sampled:
                        q = q / q.sum()
                        token = int(sample(q, gen))
                        tree.add(token, parent, q)
                        q = q.clone()
                        q[token] = 0.0
                    else:
                        token = int(q.argmax())
                        tree.add(token, parent)
                        q[token] = -1.0
        rows = torch.stack([target[0]] + [target[d] for d in tree.depths])
        emitted, _ = verify_tree(tree, rows.__getitem__, gen)
        counts[0, emitted[0]] += 1
        if len(emitted) > 1:
            counts[1, emitted[1]] += 1
    for depth in range(2):
        expected = target[depth] * counts[depth].sum()
        assert scipy_stats.chisquare(counts[depth].numpy(), expected.numpy()).pvalue > 1e-4, depth


def test_greedy_rule_follows_the_targets_argmax():
    tree = example_tree()
    logits = torch.full((1 + len(tree), 12), -1.0)
    for row, best in enumerate([5, 6, 3, 8, 2, 4, 10]):  # root: 5; node 0 (5): 6; node 2 (6): 8; node 5 (8): 10
        logits[row, best] = 1.0
    assert verify_tree_greedy(tree, logits) == ([5, 6, 8, 10], [0, 2, 5])
    logits[0] = 0.0
    logits[0, 11] = 1.0
    assert verify_tree_greedy(tree, logits) == ([11], [])


def test_a_tree_of_a_runner_without_a_masked_forward_is_refused():
    causal_only = SimpleNamespace(vocab_size=16, max_length=64)
    with pytest.raises(TreeShapeError, match="SimpleNamespace cannot verify a tree"):
        tree_decode(causal_only, None, PROMPT, shape=parse_tree("2x2"), max_new_tokens=4, sampling=SamplingParams())


def test_a_tree_deeper_than_the_context_is_refused(pair):
    target, draft = small_llama(seed=0, max_positions=12), small_llama(seed=1, max_positions=12)
    target_runner, draft_runner = build_runners(target, draft, "lean")
    with pytest.raises(TreeShapeError, match="exceeds the model's context of 12"):
        tree_decode(target_runner, DraftTreeProposer(draft_runner), PROMPT, shape=parse_tree("2x1x1x1"),
                    max_new_tokens=5, sampling=SamplingParams())


@pytest.mark.parametrize("shape", SHAPES)
def test_lookup_branch_joins_the_tree_and_stays_lossless(pair, shape):
    target, draft = pair
    repetitive = torch.tensor([[0, 3, 7, 2, 9, 3, 7, 2, 9, 3]])
    target_runner, draft_runner = build_runners(target, draft, "lean")
    proposer = LookupTreeProposer(LookupProposer(3), DraftTreeProposer(draft_runner))
    base = target_decode(target_runner, repetitive, max_new_tokens=20, sampling=SamplingParams())
    out = tree_decode(target_runner, proposer, repetitive, shape=parse_tree(shape), max_new_tokens=20,
                      sampling=SamplingParams())
    assert out.tokens.tolist() == base.tolist()
    assert out.stats.looked_up > 0  # 3 7 2 9 repeats: lookup guesses the tokens that followed it
    sampling = SamplingParams(temperature=1.0)
    spec = continuations(lambda g: tree_decode(target_runner, proposer, repetitive, shape=parse_tree(shape),
                                               max_new_tokens=3, sampling=sampling, generator=g).tokens, 1000, seed=1)
    assert two_sample_pvalue(spec, target_only(target, repetitive, 3, sampling)) > 1e-4


def test_a_tree_with_lookup_adds_at_most_its_depth_in_nodes():
    tree = example_tree()

    class Guesses:  # looks up 5 -> 7 -> 1 -> 1: two nodes exist, two are new
        def guess(self, committed, drafted):
            return [5, 7, 1, 1][len(drafted)]

    class Fixed:
        draft_ids, max_length, costs = None, None, None

        def propose_tree(self, *args):
            return example_tree(), 2

    proposer = LookupTreeProposer(Guesses(), Fixed())
    grown, forwards = proposer.propose_tree([0], StaticTree((1, 1, 1)), 10, SamplingParams(), None)
    assert forwards == 2 and grown.tokens == tree.tokens + [1]  # depth 3: 5 -> 7 -> new 1
    assert grown.parents[-1] == 3 and grown.looked_up == [False] * len(tree) + [True]


def test_best_budget_weighs_values_against_the_verification_cost():
    values = [0.9, 0.5, 0.3, 0.05]
    assert best_budget(values, 2, 0.0, lambda n: 1.0)[0] == 4  # verification free: every node pays
    assert best_budget(values, 2, 0.0, lambda n: 1.0 + 0.4 * n)[0] == 1  # each node costs more than it gives
    n, rate = best_budget(values, 2, 0.1, lambda n: 1.0 + 0.1 * n)
    assert n == 3 and rate == pytest.approx((1 + 1.7) / (0.2 + 1.3))
    assert deeper_pays(values, 0.3, 2, 0.01, lambda n: 1.0)
    assert not deeper_pays(values, 0.3, 2, 0.5, lambda n: 1.0)  # one more draft forward costs more than 0.3


@pytest.mark.parametrize("c, deep", [(0.001, True), (5.0, False)])
def test_auto_tree_grows_deeper_only_where_the_cost_model_says_it_pays(pair, c, deep):
    target, _ = pair
    target_runner, draft_runner = build_runners(target, target, "lean")  # the target as its own draft
    proposer = DraftTreeProposer(draft_runner)
    proposer.costs = (c, lambda n: 1.0 + 0.01 * n)
    shape = parse_tree("dynamic:depth=4,branch=2,nodes=auto")
    out = tree_decode(target_runner, proposer, PROMPT, shape=shape, max_new_tokens=10, sampling=SamplingParams())
    assert out.tokens.tolist() == target_decode(target_runner, PROMPT, max_new_tokens=10,
                                                sampling=SamplingParams()).tolist()
    per_tree = out.stats.draft_forwards / out.stats.target_forwards
    assert per_tree > 2 if deep else per_tree == 1  # one draft forward: the root's children only


def test_auto_tree_needs_the_cost_model(pair):
    target, draft = pair
    target_runner, draft_runner = build_runners(target, draft, "lean")
    with pytest.raises(TreeShapeError, match="nodes=auto chooses each tree's size from the measured cost model"):
        tree_decode(target_runner, DraftTreeProposer(draft_runner), PROMPT, max_new_tokens=4, sampling=SamplingParams(),
                    shape=parse_tree("dynamic:depth=4,branch=2,nodes=auto"))
