"""The CUDA-graph runner's static forward computes what the eager lean forward computes.

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
from decode.proposers import make_proposer
from decode.runners import make_runner
from decode.runners.graphs import MAX_GRAPH_ROWS, MIN_CAPACITY, GraphRunner
from decode.runners.lean import LeanRunner
from decode.speculative import speculative_decode, target_decode
from decode.vocab import VocabSubset
from tests.test_lean import SCHEDULE, _close, _llama, _subset_draft


# Prefill longer than MAX_GRAPH_ROWS (the eager path on the same cache), then graph-sized calls.
PREFILL = MAX_GRAPH_ROWS + 4


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


def test_graph_backend_needs_cuda_and_auto_stays_eager_on_cpu(tmp_path):
    model = tiny_model("target")
    assert type(make_runner(model, 49152, "auto")) is LeanRunner
    with pytest.raises(ValueError, match="CUDA"):
        make_runner(model, 49152, "graph")
    with pytest.raises(ValueError, match="hidden"):
        GraphRunner(LeanRunner(model, 49152, hidden_layers=(1,)), capture=False)
    with pytest.raises(ConfigError, match="eval.backend"):
        load_config("configs/tiny.yaml", ["eval.backend=graphs"])
