"""Speculative decoding with a feature draft (decode/drafts/feature/proposer.py) on a tiny random Llama target:
what the draft reads at each position, lossless sampling (χ²), exact greedy, EOS and bad input."""

import pytest
import torch
import torch.nn.functional as F

from common.sampling import SamplingParams
from decode import generate, speculative_generate
from decode.api import build_feature_runner
from decode.drafts.feature.model import FeatureDraftCache, FeatureDraftMismatch
from decode.drafts.feature.proposer import FeatureProposer, make_feature_proposer
from decode.runners import make_runner
from decode.speculative import speculative_decode
from tests.chi2 import continuations, target_only, two_sample_pvalue
from tests.conftest import random_feature_draft, small_llama


PROMPT = torch.tensor([[0, 3, 7, 2, 9]])
ONE_TOKEN = torch.tensor([[3]])
# Repeated bigrams: prompt lookup has something to propose from the first step.
REPETITIVE = torch.tensor([[0, 3, 7, 2, 9, 3, 7, 2, 9, 3]])
# A subset head of 9 of the 16 ids: the other ids reach the output only through rejections.
SUBSET_IDS = [0, 1, 2, 3, 5, 7, 9, 11, 13]
# Tiny models: one thread (two on a busy 2-core machine oversubscribe OpenMP, ~10x slower).
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target():
    return small_llama(seed=0, layers=2)


@pytest.fixture(scope="module")
def trained(target):
    """A feature draft taught the target's next-next token on the target's own low-temperature text
    (~50% greedy acceptance, where a random one gets ~10%): blocks accept several tokens, so the
    rollbacks after long acceptances and bonus tokens are exercised. ~7 s on one thread."""
    threads = torch.get_num_threads()  # module scope: set up before the one_thread fixture
    torch.set_num_threads(1)
    try:
        return teach(target, random_feature_draft(target, init_std=0.1))
    finally:
        torch.set_num_threads(threads)


def teach(target, draft, steps=200, batch=16, length=32, unroll=3):
    """A few hundred steps of KL to the target on draft.unrolled (the training forward)."""
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    embed = target.get_input_embeddings().weight.detach()
    layers = draft.config.target_layers
    with torch.no_grad():
        prompts = torch.randint(0, 16, (256, 3), generator=gen)
        texts = target.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True, temperature=0.3,
                                top_k=0, max_new_tokens=length - 3, min_new_tokens=length - 3, pad_token_id=1)
    optimizer = torch.optim.Adam(draft.parameters(), lr=1e-2)
    draft.train()
    for _ in range(steps):
        ids = texts[torch.randint(0, len(texts), (batch,), generator=gen)]  # [B, T]
        with torch.no_grad():
            out = target(input_ids=ids, output_hidden_states=True)
            hidden = torch.stack([out.hidden_states[i + 1] for i in layers], dim=2)  # [B, T, layers, H]
            teacher = out.logits.float().log_softmax(-1)  # [B, T, V]
        # Position i reads token i + 1 and predicts token i + 2, the target's distribution at i + 1.
        outs = draft.unrolled(hidden[:, :-1], embed[ids[:, 1:]], unroll)
        loss = sum(F.kl_div(draft.logits(o).log_softmax(-1)[:, j:], teacher[:, 1 + j:], log_target=True,
                            reduction="batchmean") for j, o in enumerate(outs))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return draft.eval()


def feature_decoding(target, draft, backend="lean", lookup_ngram=0):
    """(target runner keeping the draft's layers, proposer)."""
    runner = build_feature_runner(target, draft, backend)
    return runner, make_feature_proposer(runner, draft, target.get_input_embeddings().weight, lookup_ngram)


class Recording:
    """A proposer wrapper that keeps (committed, proposal) of every block."""

    def __init__(self, proposer):
        self.proposer, self.max_length, self.blocks = proposer, proposer.max_length, []

    def reset(self, prompt_ids):
        self.proposer.reset(prompt_ids)

    def propose(self, committed, k, sampling, generator):
        proposal = self.proposer.propose(committed, k, sampling, generator)
        self.blocks.append((list(committed), proposal))
        return proposal

    def rollback(self, n_committed):
        self.proposer.rollback(n_committed)


@torch.no_grad()
def reference_logits(target, draft, committed: list[int], proposed: list[int]) -> list[torch.Tensor]:
    """The draft's logits for each proposed position, computed from scratch: the target's hidden states
    at the verified positions 0..n-2 (HF forward of the committed text), each with the next token, then
    the draft's own outputs with each proposed token."""
    n = len(committed)
    embed = target.get_input_embeddings().weight
    out = target(input_ids=torch.tensor([committed[:-1]]), output_hidden_states=True)
    hidden = torch.stack([out.hidden_states[i + 1][0] for i in draft.config.target_layers], dim=1)
    cache = FeatureDraftCache(draft)
    last = cache.forward(draft.fuse(hidden), embed[committed[1:n]])[-1]
    logits = []
    for token in proposed:
        logits.append(draft.logits(last))
        last = cache.forward(last[None], embed[[token]])[0]
    return logits


@pytest.mark.parametrize("backend", ["hf", "lean"])
@pytest.mark.parametrize("prompt,lookup_ngram,k", [(PROMPT, 0, 1), (PROMPT, 0, 3), (ONE_TOKEN, 0, 4),
                                                   (REPETITIVE, 2, 3), (REPETITIVE, 3, 4)])
def test_every_proposal_reads_the_target_states_of_the_committed_text(target, trained, backend, prompt,
                                                                      lookup_ngram, k):
    """Each drafted token's distribution equals the one computed from scratch for its block's committed text
    and the tokens proposed before it (looked-up ones included): no stale or missing hidden state, no
    cache position left over from a rejected proposal."""
    runner, proposer = feature_decoding(target, trained, backend, lookup_ngram)
    recording = Recording(proposer)
    sampling = SamplingParams(temperature=1.0)
    out = speculative_decode(runner, recording, prompt, k=k, max_new_tokens=30, sampling=sampling,
                             generator=torch.Generator().manual_seed(0))
    assert out.stats.accepted > 0 and len(recording.blocks) > 3
    drafted = 0
    for committed, proposal in recording.blocks:
        if len(committed) == 1:  # nothing verified yet: no position to draft from
            assert proposal.tokens == [] and proposal.draft_forwards == 0
            continue
        expected = reference_logits(target, trained, committed, proposal.tokens)
        for probs, looked_up, logits in zip(proposal.draft_probs, proposal.from_lookup, expected):
            if not looked_up:
                torch.testing.assert_close(probs, sampling.warp(logits), atol=1e-5, rtol=1e-4)
                drafted += 1
    assert drafted > 10


@pytest.mark.parametrize("prompt,draft_ids,lookup_ngram,k,warp", [
    (PROMPT, None, 0, 2, dict(temperature=1.0)),
    (PROMPT, SUBSET_IDS, 0, 2, dict(temperature=0.7, top_k=5, top_p=0.9)),
    (REPETITIVE, SUBSET_IDS, 3, 3, dict(temperature=1.0)),
    (ONE_TOKEN, None, 0, 1, dict(temperature=1.5)),
])
def test_sequence_distribution_matches_target(target, prompt, draft_ids, lookup_ngram, k, warp):
    """Two-sample χ² on 3-token continuations: feature-draft speculative decoding vs target-only."""
    draft = random_feature_draft(target, draft_ids)
    runner, proposer = feature_decoding(target, draft, lookup_ngram=lookup_ngram)
    sampling = SamplingParams(**warp)
    n, accepted = 1000, []

    def spec(gen):
        out = speculative_decode(runner, proposer, prompt, k=k, max_new_tokens=3, sampling=sampling, generator=gen)
        accepted.append(out.stats.accepted - out.stats.looked_up_accepted)
        return out.tokens

    spec_counts = continuations(spec, n, seed=1)
    assert sum(accepted) > n / 10  # the draft's own tokens are tested, not only lookups and rejections
    assert two_sample_pvalue(spec_counts, target_only(target, prompt, 3, sampling, n)) > 1e-4


def test_chi2_detects_a_proposer_that_misreports_its_distribution(target, trained):
    """The sequence test has power: proposals drawn from the draft but reported as drawn uniformly
    (the accept rule then over-accepts the draft's favourites) bias the output."""

    class Misreporting(FeatureProposer):
        def step(self, context, sampling, generator):
            drafted = super().step(context, sampling, generator)
            if drafted is None:
                return None
            token, probs = drafted
            return token, torch.full_like(probs, 1 / probs.numel())

    runner = build_feature_runner(target, trained)
    proposer = Misreporting(runner, trained, target.get_input_embeddings().weight)
    sampling = SamplingParams(temperature=1.0)
    spec = continuations(lambda g: speculative_decode(runner, proposer, PROMPT, k=2, max_new_tokens=3,
                                                      sampling=sampling, generator=g).tokens, 1000, seed=1)
    assert two_sample_pvalue(spec, target_only(target, PROMPT, 3, sampling)) < 1e-4


@pytest.mark.parametrize("backend", ["hf", "auto"])
@pytest.mark.parametrize("lookup_ngram", [0, 2])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("prompt", [PROMPT, ONE_TOKEN, REPETITIVE])
def test_greedy_equals_target_only(target, trained, backend, lookup_ngram, k, prompt):
    expected = generate(target, prompt, max_new_tokens=24, backend=backend)
    out = speculative_generate(target, trained, prompt, k=k, max_new_tokens=24, backend=backend,
                               lookup_ngram=lookup_ngram)
    assert out.tokens.tolist() == expected.tolist()
    assert out.stats.accepted > 0


def test_draft_forwards_count_the_chain_through_looked_up_tokens(target, trained):
    """Alone, the feature draft runs one forward per drafted token (the catch-up over the verified
    positions counts as one); with lookup it also reads through the looked-up tokens before it drafts."""
    alone = speculative_generate(target, trained, PROMPT, k=4, max_new_tokens=30).stats
    assert alone.draft_forwards == alone.proposed
    runner, proposer = feature_decoding(target, trained, lookup_ngram=2)
    recording = Recording(proposer)
    speculative_decode(runner, recording, REPETITIVE, k=4, max_new_tokens=40, sampling=SamplingParams())
    for _, proposal in recording.blocks:
        drafted_at = [i for i, looked_up in enumerate(proposal.from_lookup) if not looked_up]
        # Token i of the block needs draft positions up to i: i + 1 forwards for the last drafted one.
        assert proposal.draft_forwards == (drafted_at[-1] + 1 if drafted_at else 0)
    assert any(0 < sum(p.from_lookup) < len(p.tokens) for _, p in recording.blocks)


@pytest.mark.parametrize("eos_at", range(0, 9))
@pytest.mark.parametrize("lookup_ngram", [0, 2])
def test_eos_inside_a_block_stops_output(target, trained, eos_at, lookup_ngram):
    greedy = generate(target, REPETITIVE, max_new_tokens=12).tolist()
    eos = greedy[eos_at]
    expected = greedy[: greedy.index(eos) + 1]
    out = speculative_generate(target, trained, REPETITIVE, k=4, max_new_tokens=12, eos_token_id=eos,
                               lookup_ngram=lookup_ngram)
    assert out.tokens.tolist() == expected


def test_a_draft_for_another_target_is_refused(target):
    draft = random_feature_draft(target)
    with pytest.raises(FeatureDraftMismatch, match="hidden size 32 vs the target's 64"):
        build_feature_runner(small_llama(hidden=64, layers=2), draft)
    with pytest.raises(FeatureDraftMismatch, match="trained on a 2-layer target, this one has 3"):
        build_feature_runner(small_llama(layers=3), draft)
    with pytest.raises(FeatureDraftMismatch, match="vocabulary of 16 ids vs the target's 20"):
        speculative_generate(small_llama(vocab_size=20, layers=2), draft, PROMPT, k=2, max_new_tokens=3)
    draft.config.target_layers = [0, 2]
    with pytest.raises(FeatureDraftMismatch, match=r"reads layers \[2\] of a target with layers 0..1"):
        build_feature_runner(target, draft)


def test_a_target_runner_without_the_draft_layers_is_refused(target):
    draft = random_feature_draft(target)
    with pytest.raises(ValueError, match=r"layers \[\], the feature draft reads layers \[0, 1\]"):
        FeatureProposer(make_runner(target, 16), draft, target.get_input_embeddings().weight)
