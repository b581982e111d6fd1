"""RELIABILITY 2, 3, 6-12: speculative decoding with real (tiny, random) models."""

import json

import pytest
import torch
from scipy import stats as scipy_stats

import decode.api
import decode.speculative
from common.sampling import SamplingParams
from decode import generate, speculative_generate
from decode.api import build_runners
from decode.drafts.standalone.proposer import DraftProposer
from decode.proposers import LookupProposer, LookupThenDraft
from decode.runners import make_runner
from decode.runners.hf import HFRunner
from decode.speculative import speculative_decode, target_decode, verify_block
from decode.stats import SpeculativeStats
from tests.chi2 import continuations, target_only, two_sample_pvalue
from tests.conftest import factored_llama, negated_copy, small_llama, subset_llama


PROMPT = torch.tensor([[0, 3, 7, 2, 9]])
# Repeated bigrams: prompt lookup has something to propose from the first step.
REPETITIVE = torch.tensor([[0, 3, 7, 2, 9, 3, 7, 2, 9, 3]])


# A subset draft speaks 9 of the 16 ids: every token outside them reaches the output only
# through the residual of a rejection.
SUBSET_IDS = [0, 1, 2, 3, 5, 7, 9, 11, 13]


@pytest.mark.parametrize("warp", [dict(temperature=1.0), dict(temperature=0.7, top_k=5, top_p=0.9)])
@pytest.mark.parametrize("draft_kind", ["full", "subset", "spread", "factored"])
def test_sequence_distribution_matches_target(pair, warp, draft_kind):
    """Two-sample χ² on the joint histogram of 3-token continuations ("spread": a subset draft whose
    "other" logit stands at every outside id, so it proposes outside tokens too; "factored": each outside
    id with a logit of its own)."""
    target, draft = pair
    if draft_kind == "factored":
        draft = factored_llama(SUBSET_IDS, 16)
    elif draft_kind != "full":
        draft = subset_llama(SUBSET_IDS, 16, spread_other=draft_kind == "spread")
    t_runner, proposer = make_runner(target, 16), DraftProposer(make_runner(draft, 16))
    sampling = SamplingParams(**warp)
    n = 1000
    spec = continuations(lambda g: speculative_decode(
        t_runner, proposer, PROMPT, k=2, max_new_tokens=3, sampling=sampling, generator=g).tokens, n, seed=1)
    p = two_sample_pvalue(spec, target_only(target, PROMPT, 3, sampling, n))
    assert p > 1e-4, p


@pytest.mark.parametrize("draft_kind", ["full", "subset"])
def test_sequence_distribution_with_lookup_matches_target(pair, draft_kind):
    """Prompt lookup mixes probability-1 proposals with the draft's: still the target's distribution."""
    target, draft = pair
    if draft_kind == "subset":
        draft = subset_llama(SUBSET_IDS, 16)
    t_runner = make_runner(target, 16)
    proposer = LookupThenDraft(LookupProposer(3), DraftProposer(make_runner(draft, 16)))
    sampling = SamplingParams(temperature=1.0)
    n, looked_up = 1000, []

    def spec(g):
        out = speculative_decode(t_runner, proposer, REPETITIVE, k=3, max_new_tokens=3, sampling=sampling,
                                 generator=g)
        looked_up.append(out.stats.looked_up)
        return out.tokens

    spec_counts = continuations(spec, n, seed=1)
    assert sum(looked_up) > n  # most blocks start with a looked-up token
    assert two_sample_pvalue(spec_counts, target_only(target, REPETITIVE, 3, sampling, n)) > 1e-4


def test_chi2_detects_a_different_distribution(pair):
    """The sequence test has power: target vs draft sampling is told apart."""
    target, draft = pair
    t_runner, d_runner = make_runner(target, 16), make_runner(draft, 16)
    sampling = SamplingParams(temperature=1.0)
    a = continuations(lambda g: target_decode(t_runner, PROMPT, max_new_tokens=2, sampling=sampling, generator=g),
                      800, 1)
    b = continuations(lambda g: target_decode(d_runner, PROMPT, max_new_tokens=2, sampling=sampling, generator=g),
                      800, 2)
    assert two_sample_pvalue(a, b) < 1e-4


@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("draft_kind", ["same", "different", "always_wrong"])
@pytest.mark.parametrize("backend", ["hf", "auto"])
def test_greedy_equals_target_only(pair, k, draft_kind, backend):
    target, other = pair
    draft = {"same": target, "different": other, "always_wrong": negated_copy(target)}[draft_kind]
    expected = generate(target, PROMPT, max_new_tokens=24, backend=backend)
    out = speculative_generate(target, draft, PROMPT, k=k, max_new_tokens=24,
                               backend="hf" if draft_kind == "always_wrong" else backend)
    assert out.tokens.tolist() == expected.tolist()
    if draft_kind == "same":
        assert out.stats.alpha == 1.0
    if draft_kind == "always_wrong":
        assert out.stats.accepted == 0


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("draft_kind", ["same", "always_wrong"])
def test_greedy_with_lookup_equals_target_only(pair, k, draft_kind):
    target, _ = pair
    draft = {"same": target, "always_wrong": negated_copy(target)}[draft_kind]
    expected = generate(target, REPETITIVE, max_new_tokens=24)
    out = speculative_generate(target, draft, REPETITIVE, k=k, max_new_tokens=24, lookup_ngram=2,
                               backend="hf" if draft_kind == "always_wrong" else "auto")
    assert out.tokens.tolist() == expected.tolist()
    assert out.stats.looked_up > 0
    if draft_kind == "always_wrong":  # every accepted token came from lookup
        assert out.stats.accepted == out.stats.looked_up_accepted


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("backend", ["hf", "auto"])
def test_draft_catches_up_after_lookup(pair, k, backend):
    """Looked-up tokens skip the draft; its next forward must feed every token it missed. With the
    target as its own draft (greedy), a proposal from a correct draft cache is never rejected:
    every rejection is of a looked-up token."""
    target, _ = pair
    out = speculative_generate(target, target, REPETITIVE, k=k, max_new_tokens=40, lookup_ngram=2, backend=backend)
    stats = out.stats
    assert 0 < stats.looked_up < stats.proposed and stats.looked_up_accepted < stats.looked_up
    assert stats.tried - stats.accepted <= stats.looked_up - stats.looked_up_accepted


def test_full_acceptance_emits_k_plus_one_and_rejection_emits_one(pair):
    target, _ = pair
    k = 3
    full = speculative_generate(target, target, PROMPT, k=k, max_new_tokens=4 * (k + 1))
    assert full.stats.accept_length_hist == [0, 0, 0, 4] and full.stats.emitted == 16
    assert full.stats.target_forwards == 4 and full.stats.tau == k + 1
    none = speculative_generate(target, negated_copy(target), PROMPT, k=k, max_new_tokens=10, backend="hf")
    assert none.stats.accept_length_hist == [10, 0, 0, 0] and none.stats.target_forwards == 10
    # k shrinks for the last blocks (3, 2, 1 tokens left): 7 blocks of 3 + 2 + 1 + 0 drafted.
    assert none.stats.proposed == 24 and none.stats.tried == 9 and none.stats.alpha == 0.0
    assert none.stats.per_position_acceptance == [0.0, 0.0, 0.0]
    assert none.stats.position_tried == [9, 0, 0]  # a block stops at its first rejection


def test_accounting_bonus_not_counted(pair):
    target, draft = pair
    out = speculative_generate(target, draft, PROMPT, k=4, max_new_tokens=40, temperature=1.0,
                               generator=torch.Generator().manual_seed(0))
    s = out.stats
    assert s.emitted == len(out.tokens) == 40
    # Each block emits its accepted tokens plus exactly one residual or bonus token.
    assert s.emitted == s.accepted + s.target_forwards
    assert sum(s.accept_length_hist) == s.target_forwards
    assert sum(a * n for a, n in enumerate(s.accept_length_hist)) == s.accepted
    assert 0 <= s.alpha <= 1 and s.tau == pytest.approx(s.emitted / s.target_forwards)


def test_seeded_runs_are_reproducible(pair):
    target, draft = pair
    run = lambda seed: speculative_generate(target, draft, PROMPT, k=3, max_new_tokens=20, temperature=1.0,
                                            generator=torch.Generator().manual_seed(seed)).tokens.tolist()
    assert run(5) == run(5)
    assert run(5) != run(6)


def fresh_logits(model, tokens):
    with torch.no_grad():
        return model(input_ids=torch.tensor([tokens])).logits[0, -1].float()


@pytest.mark.parametrize("draft_kind", ["same", "different", "always_wrong"])
def test_caches_roll_back_to_the_committed_prefix(pair, draft_kind):
    """After the run, both caches hold exactly committed-1 tokens and match a no-cache forward."""
    target, other = pair
    draft = {"same": target, "different": other, "always_wrong": negated_copy(target)}[draft_kind]
    t_runner, d_runner = HFRunner(target, 16), HFRunner(draft, 16)
    out = speculative_decode(t_runner, DraftProposer(d_runner), PROMPT, k=4, max_new_tokens=13,
                             sampling=SamplingParams(temperature=1.0), generator=torch.Generator().manual_seed(0))
    committed = PROMPT[0].tolist() + out.tokens.tolist()
    assert t_runner.length == len(committed) - 1
    assert d_runner.length <= len(committed) - 1
    for runner, model in ((t_runner, target), (d_runner, draft)):
        pending = torch.tensor(committed[runner.length:])
        logits = runner.forward(pending, 1)[0]
        torch.testing.assert_close(logits, fresh_logits(model, committed), atol=1e-4, rtol=1e-4)


def test_runner_rollback_matches_fresh_forward(pair):
    target, _ = pair
    runner = HFRunner(target, 16)
    runner.forward(torch.tensor([0, 3, 7, 2]), 1)
    runner.forward(torch.tensor([5, 5, 5]), 3)
    runner.rollback(5)
    logits = runner.forward(torch.tensor([11]), 1)[0]
    torch.testing.assert_close(logits, fresh_logits(target, [0, 3, 7, 2, 5, 11]), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("eos_at", range(0, 9))
@pytest.mark.parametrize("draft_kind", ["same", "always_wrong"])
def test_eos_inside_a_block_stops_output(pair, eos_at, draft_kind):
    """EOS as an accepted token, the bonus token (draft == target) or the residual token (wrong draft)."""
    target, _ = pair
    greedy = generate(target, PROMPT, max_new_tokens=12).tolist()
    eos = greedy[eos_at]
    expected = greedy[: greedy.index(eos) + 1]
    draft = target if draft_kind == "same" else negated_copy(target)
    out = speculative_generate(target, draft, PROMPT, k=4, max_new_tokens=12, eos_token_id=eos, backend="hf")
    assert out.tokens.tolist() == expected
    assert generate(target, PROMPT, max_new_tokens=12, eos_token_id=eos).tolist() == expected


@pytest.mark.parametrize("max_new", range(1, 7))
def test_never_more_tokens_than_asked(pair, max_new):
    target, draft = pair
    k = 4
    for temperature in (0.0, 1.0):
        out = speculative_generate(target, draft, PROMPT, k=k, max_new_tokens=max_new, temperature=temperature,
                                   generator=torch.Generator().manual_seed(max_new))
        assert len(out.tokens) == max_new
        assert out.stats.emitted == max_new
    full = speculative_generate(target, target, PROMPT, k=k, max_new_tokens=max_new)
    assert full.tokens.tolist() == generate(target, PROMPT, max_new_tokens=max_new).tolist()


def test_context_limit_is_a_clear_error():
    target = small_llama(max_positions=16)
    draft = small_llama(seed=1, max_positions=16)
    ok = speculative_generate(target, draft, PROMPT, k=8, max_new_tokens=11)
    assert len(ok.tokens) == 11  # prompt 5 + 11 = 16: fits exactly, k shrinks near the end
    with pytest.raises(ValueError, match="exceeds the model's context"):
        speculative_generate(target, draft, PROMPT, k=4, max_new_tokens=12)
    with pytest.raises(ValueError, match="exceeds the model's context"):
        generate(target, PROMPT, max_new_tokens=12)


def test_k_must_be_positive(pair):
    target, draft = pair
    out = speculative_generate(target, draft, PROMPT, k=1, max_new_tokens=5)
    assert out.tokens.tolist() == generate(target, PROMPT, max_new_tokens=5).tolist()
    for bad_k in (0, -2):
        with pytest.raises(ValueError, match="k must be >= 1"):
            speculative_generate(target, draft, PROMPT, k=bad_k, max_new_tokens=5)


def test_bad_inputs_are_refused(pair):
    target, draft = pair
    with pytest.raises(ValueError, match="shape"):
        generate(target, PROMPT[0], max_new_tokens=3)
    with pytest.raises(ValueError, match="temperature"):
        speculative_generate(target, draft, PROMPT, k=2, max_new_tokens=3, temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        speculative_generate(target, draft, PROMPT, k=2, max_new_tokens=3, top_p=0.0)


def test_lookup_ngram_below_two_is_refused(pair):
    target, draft = pair
    with pytest.raises(ValueError, match="lookup_ngram"):
        speculative_generate(target, draft, PROMPT, k=2, max_new_tokens=3, lookup_ngram=1)


def test_bad_arguments_are_refused_before_any_runner_is_built(pair, monkeypatch):
    target, draft = pair

    def no_runner(*args, **kwargs):
        raise AssertionError("a runner was built before the arguments were checked")

    monkeypatch.setattr(decode.api, "make_runner", no_runner)
    spec = lambda **kw: speculative_generate(target, draft, **({"input_ids": PROMPT, "k": 2, "max_new_tokens": 3} | kw))
    with pytest.raises(TypeError, match="LongTensor"):
        generate(target, [[0, 3, 7]], max_new_tokens=3)
    with pytest.raises(TypeError, match="LongTensor"):
        spec(input_ids=PROMPT.int())
    with pytest.raises(ValueError, match=r"\[0, 16\).*-5"):  # not read as id 11 from the end
        spec(input_ids=torch.tensor([[0, -5, 7]]))
    with pytest.raises(ValueError, match=r"\[0, 16\).*16"):
        generate(target, torch.tensor([[0, 16]]), max_new_tokens=3)
    with pytest.raises(TypeError, match="k must be an int"):
        spec(k=2.5)
    with pytest.raises(ValueError, match="top_k must be >= 0"):
        spec(top_k=-3)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        generate(target, PROMPT, max_new_tokens=0)
    with pytest.raises(TypeError, match="max_new_tokens must be an int"):
        spec(max_new_tokens=3.0)
    with pytest.raises(ValueError, match="lookup_ngram"):
        spec(lookup_ngram=1)


# A draft with 8 embedding rows for the target's 16 ids (same tokenizer, no subset): the target puts
# about half its mass on ids >= 8 after PROMPT, and the draft can propose none of them.
SMALL_DRAFT_VOCAB = 8


def test_smaller_draft_vocabulary_never_cuts_the_target(pair):
    """Sampling: the speculative output has the target's ids >= 8 at the target's frequency (cutting the
    target to the draft's 8 ids would emit none), and its 2-token continuations the target's χ² profile."""
    target, _ = pair
    t_runner, d_runner = build_runners(target, small_llama(vocab_size=SMALL_DRAFT_VOCAB, seed=1))
    assert (t_runner.vocab_size, d_runner.vocab_size) == (16, SMALL_DRAFT_VOCAB)
    proposer, sampling = DraftProposer(d_runner), SamplingParams(temperature=1.0)
    n = 1000
    spec = continuations(lambda g: speculative_decode(t_runner, proposer, PROMPT, k=2, max_new_tokens=2,
                                                      sampling=sampling, generator=g).tokens, n, seed=1)
    base = target_only(target, PROMPT, 2, sampling, n)
    high = lambda counts: sum(c * sum(t >= SMALL_DRAFT_VOCAB for t in cell) for cell, c in counts.items()) / (2 * n)
    assert high(base) > 0.4 and abs(high(spec) - high(base)) < 0.05
    assert two_sample_pvalue(spec, base) > 1e-4


@pytest.mark.parametrize("lookup_ngram", [0, 2])
def test_smaller_draft_vocabulary_greedy_equals_target_only(pair, lookup_ngram):
    """The draft reads the target's ids >= 8 (it has no rows for them) and the output stays the target's."""
    target, _ = pair
    expected = generate(target, REPETITIVE, max_new_tokens=24)
    assert max(expected.tolist()) >= SMALL_DRAFT_VOCAB
    out = speculative_generate(target, small_llama(vocab_size=SMALL_DRAFT_VOCAB, seed=1), REPETITIVE, k=3,
                               max_new_tokens=24, lookup_ngram=lookup_ngram)
    assert out.tokens.tolist() == expected.tolist()


class FixedLogitsRunner:
    """A Runner whose logits ignore the context: every token a correct loop emits is then an
    independent draw from the warped target logits."""

    subset = None
    max_length = 10**6
    device = torch.device("cpu")
    hidden_layers = ()
    hidden_states = None

    def __init__(self, logits: torch.Tensor):
        self.logits, self.vocab_size, self.length = logits, logits.shape[-1], 0

    def reset(self) -> None:
        self.length = 0

    def forward(self, ids: torch.Tensor, num_logits: int = 1, full_vocab: bool = True) -> torch.Tensor:
        self.length += ids.shape[0]
        return self.logits.expand(num_logits, -1).clone()

    def rollback(self, length: int) -> None:
        assert 0 <= length <= self.length
        self.length = length


def test_spread_draft_proposes_from_its_full_vocabulary_distribution():
    """A spread subset draft's proposal carries the full-vocabulary distribution it was drawn from:
    the warped logits with its "other" logit at each outside id, outside tokens drawn uniformly."""
    draft = subset_llama(SUBSET_IDS, 16, spread_other=True)
    proposer, sampling = DraftProposer(make_runner(draft, 16)), SamplingParams(temperature=1.0)
    proposer.reset(PROMPT[0].tolist())
    proposal = proposer.propose(PROMPT[0].tolist(), 1, sampling, torch.Generator().manual_seed(0))
    full = HFRunner(draft, 16).forward(PROMPT[0], 1)[0]  # [16]
    outside = [i for i in range(16) if i not in SUBSET_IDS]
    assert proposal.draft_ids is None
    assert torch.allclose(proposal.draft_probs[0], sampling.warp(full), atol=1e-6)
    assert torch.all(full[outside] == full[outside[0]]) and full[outside[0]] > float("-inf")
    counts = torch.zeros(16)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3000):
        proposer.rollback(len(PROMPT[0]))
        counts[proposer.propose(PROMPT[0].tolist(), 1, sampling, gen).tokens[0]] += 1
    expected = proposal.draft_probs[0] * counts.sum()
    support = expected > 0
    assert scipy_stats.chisquare(counts[support].numpy(), expected[support].numpy()).pvalue > 1e-4


def test_accept_rule_gets_the_sampled_draft_distribution_and_the_same_warp(monkeypatch):
    """The draft distribution the accept rule sees is the one each token was drawn from, the target is
    warped by the same SamplingParams as in target-only decoding, and the emitted tokens follow it."""
    gen = torch.Generator().manual_seed(0)
    target_logits, draft_logits = 2 * torch.randn(12, generator=gen), 2 * torch.randn(12, generator=gen)
    sampling = SamplingParams(temperature=0.7, top_k=5, top_p=0.9)
    seen = []

    def spy(drafted, draft_probs, target_probs, generator, draft_ids):
        seen.append((draft_probs, target_probs))
        return verify_block(drafted, draft_probs, target_probs, generator, draft_ids)

    monkeypatch.setattr(decode.speculative, "verify_block", spy)
    t_runner, proposer = FixedLogitsRunner(target_logits), DraftProposer(FixedLogitsRunner(draft_logits))
    spec, base = torch.zeros(12), torch.zeros(12)
    for _ in range(600):
        out = speculative_decode(t_runner, proposer, PROMPT, k=3, max_new_tokens=8, sampling=sampling, generator=gen)
        spec += torch.bincount(out.tokens, minlength=12)
        base += torch.bincount(target_decode(t_runner, PROMPT, max_new_tokens=8, sampling=sampling, generator=gen),
                               minlength=12)
    target_probs = sampling.warp(target_logits)
    assert seen and all(torch.equal(p, sampling.warp(draft_logits)) for probs, _ in seen for p in probs)
    assert all(torch.equal(t, target_probs.expand_as(t)) for _, t in seen)
    for counts in (spec, base):
        support = target_probs > 0
        assert counts[~support].sum() == 0 and support.sum() < 12  # top-k/top-p cut tokens: never emitted
        expected = target_probs[support] * counts.sum()
        assert scipy_stats.chisquare(counts[support].numpy(), expected.numpy()).pvalue > 1e-4


@pytest.mark.parametrize("k", [1, 4])
def test_lookup_alone_equals_target_only(pair, k):
    """Prompt lookup with no draft: blocks with no match propose nothing and emit the target's token."""
    target, _ = pair
    t_runner, greedy = make_runner(target, 16), SamplingParams()
    expected = target_decode(t_runner, REPETITIVE, max_new_tokens=24, sampling=greedy)
    out = speculative_decode(t_runner, LookupProposer(2), REPETITIVE, k=k, max_new_tokens=24, sampling=greedy)
    assert out.tokens.tolist() == expected.tolist()
    assert 0 < out.stats.looked_up == out.stats.proposed and out.stats.draft_steps_per_forward == 0


def test_stats_round_trip_and_merge_cover_every_field(pair):
    """to_dict/from_dict/merge are driven by the dataclass fields: a report row rebuilds the stats,
    and merging two runs adds every count."""
    target, draft = pair
    runs = [speculative_generate(target, draft, REPETITIVE, k=3, max_new_tokens=12, temperature=1.0,
                                 generator=torch.Generator().manual_seed(seed), lookup_ngram=2).stats
            for seed in (0, 1)]
    rows = [json.loads(json.dumps(s.to_dict())) for s in runs]
    assert [SpeculativeStats.from_dict(row) for row in rows] == runs
    assert rows[0]["alpha"] == runs[0].alpha and rows[0]["tau"] == runs[0].tau
    merged = runs[0].merge(runs[1])
    assert merged.emitted == 24 and merged.looked_up == runs[0].looked_up + runs[1].looked_up
    assert merged.accept_length_hist == [a + b for a, b in zip(runs[0].accept_length_hist,
                                                               runs[1].accept_length_hist)]
