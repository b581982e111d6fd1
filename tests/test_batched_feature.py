"""The feature draft at batch > 1 (decode/drafts/feature/ragged.py) in batched speculative decoding: every row
proposes and accepts what the batch-1 feature proposer does, greedy rows equal target-only decoding, sampled
rows follow the target (χ²), and a target runner without the draft's layers, or prompt lookup in front of the
draft, is refused."""

from collections import Counter

import pytest
import torch

from common.sampling import SamplingParams
from decode.batched_speculative import serve
from decode.drafts.feature.ragged import RaggedFeatureDrafter
from decode.runners import make_runner
from decode.runners.ragged import RaggedRunner
from decode.speculative import speculative_decode, target_decode
from tests.chi2 import target_only, two_sample_pvalue
from tests.conftest import random_feature_draft
# target and trained: the feature proposer tests' fixtures (a tiny target, a draft taught it to ~50% acceptance)
from tests.test_feature_proposer import SUBSET_IDS, feature_decoding, target, trained  # noqa: F401


# Of different lengths, one of a single token (no draft position before the target's first forward).
PROMPTS = [[0, 3, 7, 2, 9], [5], [4, 4, 8], [2, 9, 3, 7, 2, 9, 3], [6, 1, 0, 12], [7, 7]]
pytestmark = pytest.mark.usefixtures("one_thread")


def runners(target, draft):
    target_runner = RaggedRunner(target, 16, hidden_layers=draft.config.target_layers)
    return target_runner, RaggedFeatureDrafter(target_runner, draft, target.get_input_embeddings().weight)


def test_each_row_accepts_what_the_batch1_feature_proposer_accepts(target, trained):
    """Greedy: the same guesses and acceptances per row as the batch-1 chain, so the batched draft reads the
    target's states of the committed text and its own outputs for guesses exactly as the batch-1 one does."""
    outcomes = serve(*runners(target, trained), PROMPTS, batch_size=3, k=3, max_new_tokens=16,
                     sampling=SamplingParams())
    runner, proposer = feature_decoding(target, trained)
    for prompt, outcome in zip(PROMPTS, outcomes):
        single = speculative_decode(runner, proposer, torch.tensor([prompt]), k=3, max_new_tokens=16,
                                    sampling=SamplingParams())
        assert outcome.tokens == single.tokens.tolist()
        assert outcome.stats.accept_length_hist == single.stats.accept_length_hist
    assert sum(o.stats.accepted for o in outcomes) > sum(o.stats.proposed for o in outcomes) / 4


@pytest.mark.parametrize("batch_size", [1, 4])
@pytest.mark.parametrize("k, p_min, adaptive", [(0, 0.0, False), (4, 0.0, False), (4, 0.6, False), (3, 0.0, True)])
@pytest.mark.parametrize("draft_ids", [None, SUBSET_IDS])
def test_every_rows_greedy_output_equals_batch1_target_only(target, trained, batch_size, k, p_min, adaptive,
                                                             draft_ids):
    draft = trained if draft_ids is None else random_feature_draft(target, draft_ids)
    outcomes = serve(*runners(target, draft), PROMPTS, batch_size=batch_size, k=k, max_new_tokens=12,
                     sampling=SamplingParams(), eos_token_id=15, p_min=p_min, adaptive=adaptive)
    lean = make_runner(target, 16, "lean")
    for prompt, outcome in zip(PROMPTS, outcomes):
        expected = target_decode(lean, torch.tensor([prompt]), max_new_tokens=12, sampling=SamplingParams(),
                                 eos_token_id=15)
        assert outcome.tokens == expected.tolist()


@pytest.mark.parametrize("warp", [dict(temperature=1.0), dict(temperature=0.7, top_k=5, top_p=0.9)])
def test_each_sampled_row_follows_the_target(target, warp):
    """Two-sample χ² on 3-token continuations of row 1 of a batch of 3 (its neighbours decoding too), a subset
    head: tokens outside it reach the output only through rejections."""
    draft = random_feature_draft(target, SUBSET_IDS)
    target_runner, drafter = runners(target, draft)
    sampling = SamplingParams(**warp)
    gen = torch.Generator().manual_seed(1)
    spec, accepted = Counter(), 0
    for _ in range(800):
        generators = [torch.Generator().manual_seed(int(torch.randint(2**31, (), generator=gen))) for _ in range(3)]
        outcomes = serve(target_runner, drafter, PROMPTS[:3], batch_size=3, k=2, max_new_tokens=3,
                         sampling=sampling, generators=generators)
        spec[tuple(outcomes[1].tokens)] += 1
        accepted += outcomes[1].stats.accepted
    assert accepted > 80  # the draft's guesses are tested, not only rejected
    assert two_sample_pvalue(spec, target_only(target, torch.tensor([PROMPTS[1]]), 3, sampling, 800)) > 1e-4


def test_a_target_runner_without_the_draft_layers_is_refused(target):
    draft = random_feature_draft(target, target_layers=(0, 1))
    with pytest.raises(ValueError, match=r"keeps the hidden states of layers \[1\], the feature draft reads layers"):
        RaggedFeatureDrafter(RaggedRunner(target, 16, hidden_layers=(1,)), draft, target.get_input_embeddings().weight)


def test_prompt_lookup_in_front_of_a_feature_draft_is_refused_before_decoding(target, monkeypatch):
    """It reads guesses one at a time past the verified text, so it could not read a run of looked-up ones."""
    target_runner, drafter = runners(target, random_feature_draft(target, SUBSET_IDS))
    monkeypatch.setattr(target_runner, "add", lambda texts: pytest.fail("a row was read"))
    with pytest.raises(ValueError, match="RaggedFeatureDrafter reads its guesses one at a time"):
        serve(target_runner, drafter, PROMPTS, batch_size=2, k=2, max_new_tokens=4, sampling=SamplingParams(),
              lookup_ngram=2)
