"""The CUDA-graph runner's static forwards (causal and draft trees) compute what the eager lean forward computes.

On a CPU the static forward runs without capture (capture=False): same buffers, positions read
from the device buffer, masked attention over the whole capacity. tests/test_cuda.py replays it
from real graphs.
"""

import pytest
import torch

from common.config import ConfigError, load_config
from common.models import tiny_model
from common.sampling import SamplingParams
from decode import generate
from decode.api import build_runners
from decode.drafts.feature.proposer import FeatureProposer, make_feature_proposer
from decode.drafts.feature.tree_proposer import FeatureTreeProposer
from decode.drafts.standalone.tree_proposer import DraftTreeProposer
from decode.proposers import make_proposer
from decode.runners import make_runner
from decode.runners.graphs import MAX_GRAPH_ROWS, MIN_CAPACITY, GraphRunner
from decode.runners.lean import LeanRunner
from decode.speculative import speculative_decode, target_decode
from decode.tree import parse_tree, tree_window
from decode.tree_decode import tree_decode
from decode.vocab import VocabSubset
from tests.conftest import random_feature_draft, small_llama, subset_llama
from tests.test_lean import SCHEDULE, _close, _llama, _subset_draft
from tests.test_tree import PROMPT, example_tree, path_to


# Prefill longer than MAX_GRAPH_ROWS (the eager path on the same cache), then graph-sized calls.
PREFILL = MAX_GRAPH_ROWS + 4
TREES = ["3x2x1", "dynamic:depth=4,branch=3,nodes=8"]


def _compare(model, vocab: int, schedule, seed=0) -> None:
    eager, static = LeanRunner(model, vocab), GraphRunner(LeanRunner(model, vocab), capture=False)
    gen = torch.Generator().manual_seed(seed)
    for n, num_logits in schedule:
        if n == "rollback":
            eager.rollback(num_logits)
            static.rollback(num_logits)
            continue
        ids = torch.randint(0, vocab, (n,), generator=gen)
        _close(static.forward(ids, num_logits), eager.forward(ids, num_logits))
        assert static.length == eager.length


@pytest.mark.parametrize("name", ["tiny_target", "untied_gqa4"])
def test_static_forward_matches_eager_through_calls_and_rollbacks(name):
    model = tiny_model("target") if name == "tiny_target" else _llama()
    schedule = [(PREFILL, 2)] + SCHEDULE + [(PREFILL, 1), (MAX_GRAPH_ROWS, 4), ("rollback", 15), (1, 1)]
    _compare(model, model.config.vocab_size, schedule)


def test_cache_keeps_min_capacity_and_grows_past_it():
    model = _llama(max_position_embeddings=MIN_CAPACITY + 64)
    runner = GraphRunner(LeanRunner(model, 1000), capture=False)
    assert runner.capacity == MIN_CAPACITY
    ids = torch.randint(0, 1000, (MIN_CAPACITY + 12,), generator=torch.Generator().manual_seed(1))
    runner.forward(ids[:MIN_CAPACITY - 8], 1)
    got = torch.cat([runner.forward(ids[i: i + 5], 5) for i in range(MIN_CAPACITY - 8, len(ids), 5)])
    assert runner.capacity == MIN_CAPACITY + 64  # grown, capped at the model's context
    with torch.no_grad():
        fresh = model(input_ids=ids[None]).logits[0, MIN_CAPACITY - 8:]
    _close(got, fresh)


def test_subset_draft_logits_over_rows_and_full_vocab():
    vocab, n = 1000, 50
    draft = _subset_draft(vocab, n)
    eager, static = LeanRunner(draft, vocab), GraphRunner(LeanRunner(draft, vocab), capture=False)
    subset = VocabSubset.of(draft).ids
    for ids in (subset[:7], torch.randint(0, vocab, (3,), generator=torch.Generator().manual_seed(2))):
        rows = static.forward(ids, 2, full_vocab=False)
        assert rows.shape == (2, n)
        static.rollback(static.length - ids.shape[0])
        _close(static.forward(ids, 2), eager.forward(ids, 2))


def test_greedy_speculative_with_static_runners_equals_target_only():
    target, draft = tiny_model("target"), tiny_model("draft")
    prompt = torch.randint(0, 49152, (1, 11), generator=torch.Generator().manual_seed(4))
    t_runner = GraphRunner(LeanRunner(target, 49152), capture=False)
    d_runner = GraphRunner(LeanRunner(draft, 49152), capture=False)
    greedy = SamplingParams()
    expected = generate(target, prompt, max_new_tokens=20, backend="lean")
    assert target_decode(t_runner, prompt, max_new_tokens=20, sampling=greedy).tolist() == expected.tolist()
    for lookup_ngram in (0, 2):
        out = speculative_decode(t_runner, make_proposer(d_runner, lookup_ngram), prompt, k=4, max_new_tokens=20,
                                 sampling=greedy)
        assert out.tokens.tolist() == expected.tolist()


def check_tree_forward(model, capture: bool) -> None:
    """A tree's masked forward from the static buffer (rotary positions, the rows each row sees) gives the
    eager masked forward's logits and hidden states; after keep() both continue from the accepted path."""
    tree, committed = example_tree(), [0, 3, 7, 2, 9]
    eager = LeanRunner(model, 16, hidden_layers=(0, 1))
    static = GraphRunner(LeanRunner(model, 16, hidden_layers=(0, 1)), capture=capture)
    for runner in (eager, static):
        runner.forward(torch.tensor(committed[:3]), 1)
    positions, visible = tree_window(3, 2, tree.parents, tree.depths)
    ids = torch.tensor(committed[3:] + tree.tokens)
    want = eager.forward_masked(ids, positions, visible, len(tree) + 1)
    _close(static.forward_masked(ids, positions, visible, len(tree) + 1), want)
    assert static.static_shapes == [(3, False), (len(ids), True)]  # not the eager fallback
    _close(static.hidden_states, eager.hidden_states)
    for runner in (eager, static):
        runner.keep(5, [5 + i for i in path_to(tree, 5)])  # accept 5 -> 6 -> 8
    assert static.length == eager.length == 8
    _close(static.hidden_states, eager.hidden_states)
    _close(static.forward(torch.tensor([11]), 1), eager.forward(torch.tensor([11]), 1))
    _close(static.hidden_states, eager.hidden_states)


def check_greedy_trees(target, shape: str, capture: bool) -> None:
    """Greedy tree decoding (subset and feature drafts) and feature chains on static runners = target-only."""
    greedy, tree = SamplingParams(), parse_tree(shape)
    prompt = PROMPT.to(target.device)
    base = target_decode(GraphRunner(LeanRunner(target, 16), capture), prompt, max_new_tokens=20, sampling=greedy)
    base = base.tolist()
    draft = subset_llama([0, 1, 2, 3, 5, 7, 9, 11, 13], 16, spread_other=True).to(target.device, target.dtype)
    target_runner, draft_runner = (GraphRunner(r, capture) for r in build_runners(target, draft, "lean"))
    out = tree_decode(target_runner, DraftTreeProposer(draft_runner), prompt, shape=tree, max_new_tokens=20,
                      sampling=greedy)
    assert out.tokens.tolist() == base
    for runner in (target_runner, draft_runner):  # verification and the draft's levels from static buffers
        assert any(tree for _, tree in runner.static_shapes)
    feature = random_feature_draft(target).to(target.device, target.dtype)
    runner = GraphRunner(LeanRunner(target, 16, hidden_layers=feature.config.target_layers), capture)
    embeddings = target.get_input_embeddings().weight
    out = tree_decode(runner, FeatureTreeProposer(FeatureProposer(runner, feature, embeddings)), prompt, shape=tree,
                      max_new_tokens=20, sampling=greedy)
    assert out.tokens.tolist() == base
    out = speculative_decode(runner, make_feature_proposer(runner, feature, embeddings), prompt, k=3,
                             max_new_tokens=20, sampling=greedy)
    assert out.tokens.tolist() == base


def test_a_tree_forward_wider_than_the_window_runs_eagerly():
    """Rows that do not see slot 0 of a 140-slot cache differ over more than TREE_WINDOW slots: eager, still right."""
    model = small_llama(seed=0, layers=2)
    eager, static = LeanRunner(model, 16), GraphRunner(LeanRunner(model, 16), capture=False)
    ids = torch.randint(0, 16, (140,), generator=torch.Generator().manual_seed(3))
    for runner in (eager, static):
        runner.forward(ids[:-3], 1)
    visible = torch.ones(3, 140, dtype=torch.bool).tril(137)
    visible[:, 0] = False
    positions = torch.arange(137, 140)
    want = eager.forward_masked(ids[-3:], positions, visible, 3)
    _close(static.forward_masked(ids[-3:], positions, visible, 3), want)
    assert static.static_shapes == []


def test_static_tree_forward_matches_eager_and_keeps_the_path():
    check_tree_forward(small_llama(seed=0, layers=2), capture=False)


@pytest.mark.parametrize("shape", TREES)
def test_greedy_trees_and_feature_chains_with_static_runners_equal_target_only(shape):
    check_greedy_trees(small_llama(seed=0, layers=2), shape, capture=False)


def check_capture(target, capture: bool) -> None:
    """Graphs captured up front on an empty runner (as eval-speedup's warm-up does) leave decoding unchanged."""
    greedy = SamplingParams()
    base = target_decode(LeanRunner(target, 16), PROMPT.to(target.device), max_new_tokens=12, sampling=greedy).tolist()
    runner = GraphRunner(LeanRunner(target, 16), capture)
    runner.capture_ahead(range(1, 5))
    runner.capture_ahead(range(1, 4), tree=True)
    assert runner.static_shapes == [(1, False), (1, True), (2, False), (2, True), (3, False), (3, True), (4, False)]
    assert runner.length == 0
    out = target_decode(runner, PROMPT.to(target.device), max_new_tokens=12, sampling=greedy)
    assert out.tolist() == base
    runner.reset()
    runner.forward(torch.tensor([1, 2]), 1)
    with pytest.raises(ValueError, match="empty runner"):
        runner.capture_ahead(range(1, 2))
    runner.reset()
    with pytest.raises(ValueError, match="1..65 rows, not 66"):
        runner.capture_ahead(range(66, 67), tree=True)


def test_captures_up_front_leave_decoding_unchanged():
    check_capture(small_llama(seed=0, layers=2), capture=False)


def test_graph_backend_needs_cuda_and_auto_stays_eager_on_cpu(tmp_path):
    model = tiny_model("target")
    assert type(make_runner(model, 49152, "auto")) is LeanRunner
    with pytest.raises(ValueError, match="CUDA"):
        make_runner(model, 49152, "graph")
    with pytest.raises(ConfigError, match="eval.backend"):
        load_config("configs/tiny.yaml", ["eval.backend=graphs"])
