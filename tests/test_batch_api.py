"""decode.speculative_generate_batch: many prompts with continuous batching in one call, each row's greedy output
equal to generate()'s with either draft kind, sampled rows reproducible per prompt whatever the batch, and bad
input refused before any runner is built."""

import pytest
import torch

from decode import generate, speculative_generate_batch
from tests.conftest import random_feature_draft, small_llama


PROMPTS = [[0, 3, 7, 2, 9], [5], [4, 4, 8], [2, 9, 3, 7, 2, 9, 3], [6, 1, 0, 12]]
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target():
    return small_llama(seed=0, layers=2)


@pytest.mark.parametrize("draft_kind, lookup_ngram, adaptive", [("none", 0, False), ("standalone", 0, False),
                                                                 ("standalone", 2, True), ("feature", 0, False)])
def test_every_rows_greedy_output_equals_generate(target, draft_kind, lookup_ngram, adaptive):
    draft = {"none": None, "standalone": small_llama(seed=1), "feature": random_feature_draft(target)}[draft_kind]
    outcomes = speculative_generate_batch(target, draft, PROMPTS[:3] + [torch.tensor([p]) for p in PROMPTS[3:]],
                                          k=3, batch_size=2, max_new_tokens=10, lookup_ngram=lookup_ngram,
                                          adaptive=adaptive)
    for prompt, outcome in zip(PROMPTS, outcomes):
        assert outcome.tokens == generate(target, torch.tensor([prompt]), max_new_tokens=10).tolist()
    proposed = sum(o.stats.proposed for o in outcomes)
    assert proposed == 0 if draft is None else proposed > 0


def test_a_sampled_row_does_not_depend_on_the_batch(target):
    """Row i draws from generators[i] only: alone or among others, at any batch size, the same tokens."""
    draft = small_llama(seed=1)

    def run(prompts, seeds, batch_size):
        return [o.tokens for o in speculative_generate_batch(
            target, draft, prompts, k=2, batch_size=batch_size, max_new_tokens=8, temperature=1.0,
            generators=[torch.Generator().manual_seed(seed) for seed in seeds])]

    together = run(PROMPTS, range(5), 3)
    assert run(PROMPTS[3:4], [3], 1) == together[3:4]
    assert run(PROMPTS, range(5), 5) == together


@pytest.mark.parametrize("kwargs, error, says", [
    (dict(prompts=[]), ValueError, "prompts must be a non-empty list"),
    (dict(prompts=[[1, 2], []]), ValueError, r"prompts\[1\]: input_ids is empty"),
    (dict(prompts=[[1, 16]]), ValueError, r"prompts\[0\]: input_ids must lie in \[0, 16\)"),
    (dict(prompts=[[1, 2], [3] * 250]), ValueError, r"prompts\[1\] has 250 tokens: with max_new_tokens=8 and k=2 "
                                                    "a row needs 260 positions, the target has 256"),
    (dict(batch_size=0), ValueError, "batch size must be an int >= 1"),
    (dict(p_min=1.5), ValueError, r"p_min must lie in \[0, 1\)"),
    (dict(lookup_ngram=1), ValueError, r"lookup_ngram must be 0 \(off\) or >= 2"),
    (dict(draft="feature", lookup_ngram=2), ValueError, "lookup_ngram needs a standalone draft"),
    (dict(generators=[None]), ValueError, "generators: one per prompt, got 1 for 2 prompts"),
])
def test_bad_input_is_refused_before_any_runner_is_built(target, monkeypatch, kwargs, error, says):
    monkeypatch.setattr("decode.api.RaggedRunner", lambda *a, **k: pytest.fail("a runner was built"))
    args = dict(prompts=[[1, 2], [3]], batch_size=2, k=2, max_new_tokens=8) | kwargs
    draft = random_feature_draft(target) if args.pop("draft", None) == "feature" else small_llama(seed=1)
    with pytest.raises(error, match=says):
        speculative_generate_batch(target, draft, args.pop("prompts"), **args)


def test_a_batch_beyond_free_memory_says_how_much_it_needs(target, monkeypatch):
    monkeypatch.setattr("decode.batched_speculative.os.sysconf", lambda name: 1)  # one byte free
    with pytest.raises(ValueError, match=r"batch 2 needs ~0\.0 GiB of cache \(34 slots x .* KiB per row\)"):
        speculative_generate_batch(target, small_llama(seed=1), [[1, 2], [3]], k=2, batch_size=2, max_new_tokens=12)
