"""RELIABILITY 2, 3, 6-12: speculative decoding with real (tiny, random) models."""

from collections import Counter

import pytest
import torch
from scipy import stats as scipy_stats

from decode import generate, speculative_generate
from decode.runner import ModelRunner, make_runner
from tests.conftest import negated_copy, small_llama, subset_llama

PROMPT = torch.tensor([[0, 3, 7, 2, 9]])
# Repeated bigrams: prompt lookup has something to propose from the first step.
REPETITIVE = torch.tensor([[0, 3, 7, 2, 9, 3, 7, 2, 9, 3]])


def continuations(fn, n, seed):
    gen = torch.Generator().manual_seed(seed)
    return Counter(tuple(fn(gen).tolist()) for _ in range(n))


# A subset draft speaks 9 of the 16 ids: every token outside them reaches the output only
# through the residual of a rejection.
SUBSET_IDS = [0, 1, 2, 3, 5, 7, 9, 11, 13]


@pytest.mark.parametrize("warp", [dict(temperature=1.0), dict(temperature=0.7, top_k=5, top_p=0.9)])
@pytest.mark.parametrize("draft_kind", ["full", "subset"])
def test_sequence_distribution_matches_target(pair, warp, draft_kind):
    """Two-sample χ² on the joint histogram of 3-token continuations."""
    target, draft = pair
    if draft_kind == "subset":
        draft = subset_llama(SUBSET_IDS, 16)
    t_runner, d_runner = make_runner(target, 16), make_runner(draft, 16)
    n = 1000
    spec = continuations(lambda g: speculative_generate(
        target, draft, PROMPT, k=2, max_new_tokens=3, generator=g, target_runner=t_runner, draft_runner=d_runner,
        **warp).tokens, n, seed=1)
    base = continuations(lambda g: generate(target, PROMPT, max_new_tokens=3, generator=g, target_runner=t_runner,
                                            **warp), n, seed=2)
    cells = sorted(set(spec) | set(base))
    table = [[spec[c] for c in cells], [base[c] for c in cells]]
    # Pool rare cells so expected counts are not tiny.
    frequent = [i for i, c in enumerate(cells) if spec[c] + base[c] >= 10]
    rare = [i for i in range(len(cells)) if i not in frequent]
    rows = [[row[i] for i in frequent] + [sum(row[i] for i in rare)] for row in table]
    p = scipy_stats.chi2_contingency(rows).pvalue
    assert p > 1e-4, p


@pytest.mark.parametrize("draft_kind", ["full", "subset"])
def test_sequence_distribution_with_lookup_matches_target(pair, draft_kind):
    """Prompt lookup mixes probability-1 proposals with the draft's: still the target's distribution."""
    target, draft = pair
    if draft_kind == "subset":
        draft = subset_llama(SUBSET_IDS, 16)
    t_runner, d_runner = make_runner(target, 16), make_runner(draft, 16)
    n, looked_up = 1000, []

    def spec(g):
        out = speculative_generate(target, draft, REPETITIVE, k=3, max_new_tokens=3, temperature=1.0, generator=g,
                                   target_runner=t_runner, draft_runner=d_runner, lookup_ngram=3)
        looked_up.append(out.stats.looked_up)
        return out.tokens

    spec_counts = continuations(spec, n, seed=1)
    base = continuations(lambda g: generate(target, REPETITIVE, max_new_tokens=3, temperature=1.0, generator=g,
                                            target_runner=t_runner), n, seed=2)
    assert sum(looked_up) > n  # most blocks start with a looked-up token
    cells = sorted(set(spec_counts) | set(base))
    frequent = [c for c in cells if spec_counts[c] + base[c] >= 10]
    rare = [c for c in cells if c not in frequent]
    rows = [[counts[c] for c in frequent] + [sum(counts[c] for c in rare)] for counts in (spec_counts, base)]
    assert scipy_stats.chi2_contingency(rows).pvalue > 1e-4


def test_chi2_detects_a_different_distribution(pair):
    """The sequence test has power: target vs draft sampling is told apart."""
    target, draft = pair
    t_runner, d_runner = make_runner(target, 16), make_runner(draft, 16)
    a = continuations(lambda g: generate(target, PROMPT, max_new_tokens=2, temperature=1.0, generator=g,
                                         target_runner=t_runner), 800, 1)
    b = continuations(lambda g: generate(draft, PROMPT, max_new_tokens=2, temperature=1.0, generator=g,
                                         target_runner=d_runner), 800, 2)
    cells = sorted(set(a) | set(b))
    frequent = [c for c in cells if a[c] + b[c] >= 10]
    rows = [[a[c] for c in frequent], [b[c] for c in frequent]]
    assert scipy_stats.chi2_contingency(rows).pvalue < 1e-4


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
    t_runner, d_runner = ModelRunner(target, 16), ModelRunner(draft, 16)
    out = speculative_generate(target, draft, PROMPT, k=4, max_new_tokens=13, temperature=1.0,
                               generator=torch.Generator().manual_seed(0),
                               target_runner=t_runner, draft_runner=d_runner)
    committed = PROMPT[0].tolist() + out.tokens.tolist()
    assert t_runner.length == len(committed) - 1
    assert d_runner.length <= len(committed) - 1
    for runner, model in ((t_runner, target), (d_runner, draft)):
        pending = torch.tensor(committed[runner.length:])
        logits = runner.forward(pending, 1)[0]
        torch.testing.assert_close(logits, fresh_logits(model, committed), atol=1e-4, rtol=1e-4)


def test_runner_rollback_matches_fresh_forward(pair):
    target, _ = pair
    runner = ModelRunner(target, 16)
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
