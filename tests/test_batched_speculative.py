"""Batched speculative decoding (decode/batched_speculative.py) over RaggedRunners (decode/runners/ragged.py):
rows of different lengths equal their batch-1 forwards, every row's greedy output equals batch-1 target-only
decoding, sampled rows follow the target (χ²), rows join and leave, bad input is refused."""

from collections import Counter

import pytest
import torch

from common.sampling import SamplingParams
from decode.api import build_runners
from decode.batched_speculative import AdaptiveK, serve
from decode.drafts.standalone.proposer import DraftProposer
from decode.proposers import LookupProposer, make_proposer
from decode.runners import make_runner
from decode.runners.ragged import RaggedRunner
from decode.speculative import speculative_decode, target_decode
from tests.chi2 import target_only, two_sample_pvalue
from tests.conftest import small_llama, subset_llama


PROMPTS = [[0, 3, 7, 2, 9], [5], [4, 4, 8], [2, 9, 3, 7, 2, 9, 3], [6, 1, 0, 12]]
pytestmark = pytest.mark.usefixtures("one_thread")


def test_ragged_rows_equal_their_batch1_forwards():
    model = small_llama(seed=0, layers=2)
    ragged, lean = RaggedRunner(model, 16), make_runner(model, 16, "lean")

    def check(logits, texts_and_rows):
        for text, row, n in texts_and_rows:
            lean.reset()
            torch.testing.assert_close(logits[row, :n], lean.forward(torch.tensor(text), n), rtol=1e-4, atol=1e-4)

    ragged.add([[0, 3, 7], [5], []])
    out = ragged.forward(torch.tensor([[2, 9, 1], [4, 0, 0], [6, 6, 0]]), torch.tensor([3, 1, 2]))
    check(out, [([0, 3, 7, 2, 9, 1], 0, 3), ([5, 4], 1, 1), ([6, 6], 2, 2)])
    ragged.truncate(torch.tensor([4, 2, 1]))  # row 0 keeps 0 3 7 2, row 2 keeps 6
    assert ragged.lengths.tolist() == [4, 2, 1]
    out = ragged.forward(torch.tensor([[8], [8], [8]]), torch.tensor([1, 1, 1]))
    check(out, [([0, 3, 7, 2, 8], 0, 1), ([5, 4, 8], 1, 1), ([6, 8], 2, 1)])
    ragged.keep(torch.tensor([2, 0]))
    ragged.add([[11, 12]])  # a row joining later, into fresh slots
    out = ragged.forward(torch.tensor([[1], [1], [1]]), torch.tensor([1, 1, 1]))
    check(out, [([6, 8, 1], 0, 1), ([0, 3, 7, 2, 8, 1], 1, 1), ([11, 12, 1], 2, 1)])


@pytest.mark.parametrize("batch_size", [1, 2, 5])
@pytest.mark.parametrize("k, p_min", [(0, 0.0), (3, 0.0), (4, 0.6)])
@pytest.mark.parametrize("draft_kind", ["full", "subset"])
def test_every_rows_greedy_output_equals_batch1_target_only(pair, batch_size, k, p_min, draft_kind):
    target, draft = pair
    if draft_kind == "subset":
        draft = subset_llama([0, 1, 2, 3, 5, 7, 9, 11, 13], 16, spread_other=True)
    outcomes = serve(RaggedRunner(target, 16), RaggedRunner(draft, 16), PROMPTS, batch_size=batch_size, k=k,
                     max_new_tokens=12, sampling=SamplingParams(), eos_token_id=15, p_min=p_min)
    lean = make_runner(target, 16, "lean")
    for prompt, outcome in zip(PROMPTS, outcomes):
        expected = target_decode(lean, torch.tensor([prompt]), max_new_tokens=12, sampling=SamplingParams(),
                                 eos_token_id=15)
        assert outcome.tokens == expected.tolist()
        assert outcome.stats.emitted >= len(outcome.tokens) and outcome.seconds > 0
        if k:
            assert outcome.stats.draft_forwards == outcome.stats.proposed
            assert outcome.stats.proposed <= k * outcome.stats.target_forwards


def test_a_draft_equal_to_the_target_accepts_every_guess(pair):
    target, _ = pair
    outcomes = serve(RaggedRunner(target, 16), RaggedRunner(target, 16), PROMPTS[:3], batch_size=3, k=3,
                     max_new_tokens=12, sampling=SamplingParams())
    for outcome in outcomes:  # 12 tokens in blocks of 3 accepted + 1
        assert outcome.stats.target_forwards == 3 and outcome.stats.accepted == 9


@pytest.mark.parametrize("warp", [dict(temperature=1.0), dict(temperature=0.7, top_k=5, top_p=0.9)])
def test_each_sampled_row_follows_the_target(pair, warp):
    """Two-sample χ² on 3-token continuations of row 1 of a batch of 3 (its neighbours decoding too)."""
    target, draft = pair
    t_runner, d_runner = RaggedRunner(target, 16), RaggedRunner(draft, 16)
    sampling = SamplingParams(**warp)
    gen = torch.Generator().manual_seed(1)
    spec = Counter()
    for _ in range(800):
        generators = [torch.Generator().manual_seed(int(torch.randint(2**31, (), generator=gen))) for _ in range(3)]
        outcomes = serve(t_runner, d_runner, PROMPTS[:3], batch_size=3, k=2, max_new_tokens=3, sampling=sampling,
                         generators=generators)
        spec[tuple(outcomes[1].tokens)] += 1
    assert two_sample_pvalue(spec, target_only(target, torch.tensor([PROMPTS[1]]), 3, sampling, 800)) > 1e-4


@pytest.mark.parametrize("kwargs, says", [(dict(batch_size=0), "batch size must be an int >= 1"),
                                           (dict(k=-1), "k must be an int >= 0"),
                                           (dict(p_min=1.0), r"p_min must lie in \[0, 1\)"),
                                           (dict(lookup_ngram=1), r"lookup_ngram must be 0 \(off\) or >= 2")])
def test_bad_serving_arguments_are_refused(pair, kwargs, says):
    target, draft = pair
    args = dict(batch_size=2, k=2, max_new_tokens=4, sampling=SamplingParams()) | kwargs
    with pytest.raises(ValueError, match=says):
        serve(RaggedRunner(target, 16), RaggedRunner(draft, 16), PROMPTS, **args)


def test_each_row_accepts_what_batch1_speculative_decoding_accepts(pair):
    """Greedy, the same draft: every row proposes and accepts exactly as the batch-1 chain does, so the
    draft's cache holds each row's committed text and guesses as the batch-1 draft's does."""
    target, draft = pair
    outcomes = serve(RaggedRunner(target, 16), RaggedRunner(draft, 16), PROMPTS, batch_size=3, k=3,
                     max_new_tokens=16, sampling=SamplingParams())
    target_runner, draft_runner = build_runners(target, draft, "lean")
    for prompt, outcome in zip(PROMPTS, outcomes):
        single = speculative_decode(target_runner, DraftProposer(draft_runner), torch.tensor([prompt]), k=3,
                                    max_new_tokens=16, sampling=SamplingParams())
        assert outcome.tokens == single.tokens.tolist()
        assert outcome.stats.accept_length_hist == single.stats.accept_length_hist
    assert sum(o.stats.accepted for o in outcomes) > 0


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.7)])
@pytest.mark.parametrize("first_guess_only", [False, True])
def test_rows_behind_prompt_lookup_propose_and_accept_what_batch1_lookup_does(pair, sampling, first_guess_only,
                                                                              monkeypatch):
    """Lookup first, the draft where it finds nothing: every row's guesses, acceptances and draft forwards are the
    batch-1 LookupThenDraft chain's (greedy; sampled with the same generator per row, the same draws)."""
    target, draft = pair
    if first_guess_only:
        # A lookup that guesses a block's first token only, so the draft guesses after reading a looked-up token
        # (n-gram lookup rarely stops once it matched); a draft equal to the target is right only if it read it.
        monkeypatch.setattr(LookupProposer, "guess",
                            lambda self, committed, drafted: None if drafted else (3 * committed[-1] + 1) % 16)
        draft = target
    seeds = range(len(PROMPTS))
    outcomes = serve(RaggedRunner(target, 16), RaggedRunner(draft, 16), PROMPTS, batch_size=3, k=3,
                     max_new_tokens=16, sampling=sampling, lookup_ngram=2,
                     generators=[torch.Generator().manual_seed(seed) for seed in seeds])
    target_runner, draft_runner = build_runners(target, draft, "lean")
    for prompt, outcome, seed in zip(PROMPTS, outcomes, seeds):
        single = speculative_decode(target_runner, make_proposer(draft_runner, 2), torch.tensor([prompt]), k=3,
                                    max_new_tokens=16, sampling=sampling,
                                    generator=torch.Generator().manual_seed(seed))
        assert outcome.tokens == single.tokens.tolist()
        assert outcome.stats.accept_length_hist == single.stats.accept_length_hist
        assert (outcome.stats.looked_up, outcome.stats.draft_forwards) == (single.stats.looked_up,
                                                                             single.stats.draft_forwards)
    looked_up = sum(o.stats.looked_up for o in outcomes)
    assert looked_up > 0 and sum(o.stats.draft_forwards for o in outcomes) < sum(o.stats.proposed for o in outcomes)


def test_a_sampled_row_behind_prompt_lookup_follows_the_target(pair):
    """Two-sample χ² on 4-token continuations of row 1 of a batch of 3, a prompt whose tail occurred before (so
    lookup proposes with probability 1 and the draft proposes where it finds nothing)."""
    target, draft = pair
    t_runner, d_runner = RaggedRunner(target, 16), RaggedRunner(draft, 16)
    prompts, sampling = [PROMPTS[0], PROMPTS[3], PROMPTS[2]], SamplingParams(temperature=1.0)
    gen = torch.Generator().manual_seed(2)
    spec, looked_up = Counter(), 0
    for _ in range(800):
        generators = [torch.Generator().manual_seed(int(torch.randint(2**31, (), generator=gen))) for _ in range(3)]
        outcomes = serve(t_runner, d_runner, prompts, batch_size=3, k=3, max_new_tokens=4, sampling=sampling,
                         generators=generators, lookup_ngram=2)
        spec[tuple(outcomes[1].tokens)] += 1
        looked_up += outcomes[1].stats.looked_up
    assert looked_up >= 800  # the first block's first guess is always looked up
    assert two_sample_pvalue(spec, target_only(target, torch.tensor([prompts[1]]), 4, sampling, 800)) > 1e-4


def test_rolled_back_slots_are_reused_instead_of_grown(pair, monkeypatch):
    """8-slot chunks: each row's text sits at its positions, so rejected guesses' slots are written again
    and the cache holds only the longest row's text and a block of guesses; outputs do not change."""
    monkeypatch.setattr("decode.runners.ragged.CACHE_CHUNK", 8)
    target, draft = pair
    target_runner, draft_runner = RaggedRunner(target, 16), RaggedRunner(draft, 16)
    outcomes = serve(target_runner, draft_runner, PROMPTS, batch_size=2, k=3, max_new_tokens=16,
                     sampling=SamplingParams())
    lean = make_runner(target, 16, "lean")
    for prompt, outcome in zip(PROMPTS, outcomes):
        assert outcome.tokens == target_decode(lean, torch.tensor([prompt]), max_new_tokens=16,
                                               sampling=SamplingParams()).tolist()
    # The longest text (a 7-token prompt + 16 tokens) and a block of 4 fit in 32 slots; 5 requests of ~20
    # tokens each, written one after another, would have used well over 100.
    assert target_runner.cache.capacity <= 32


def test_bf16_rows_get_the_bits_of_one_token_batch1_forwards():
    """In bf16 on a CPU every query of a ragged forward (rows of different lengths, blocks of guesses, a row
    joining later, more rows than a matmul block) gets bit for bit the logits the batch-1 runner's one-token
    forward gives it: batched greedy output equals bf16 batch-1 target-only output token for token."""
    # Width 256 (head_dim 64): at the tiny models' width every summation order happens to give the same bits.
    model = small_llama(vocab_size=1000, hidden=256, layers=2, init_std=0.02).to(torch.bfloat16)
    ragged, lean = RaggedRunner(model, 1000), make_runner(model, 1000, "lean")
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 1000, (n,), generator=gen).tolist() for n in (70, 3, 130, 1, 60, 64, 9, 33)]
    block, counts = torch.randint(0, 1000, (8, 5), generator=gen), [5, 5, 5, 1, 5, 3, 5, 5]

    def one_token_logits(text: list[int]) -> torch.Tensor:
        lean.reset()
        return torch.cat([lean.forward(torch.tensor([t]), 1) for t in text])

    ragged.add(prompts)
    out = ragged.forward(block, torch.tensor(counts))
    texts = [p + block[row, :n].tolist() for row, (p, n) in enumerate(zip(prompts, counts))]
    for row, (text, n) in enumerate(zip(texts, counts)):
        assert torch.equal(out[row, :n], one_token_logits(text)[-n:]), row
    kept = [text[: len(text) - 2] if len(text) > 3 else text for text in texts]  # guesses rejected
    ragged.truncate(torch.tensor([len(t) for t in kept]))
    ragged.add([prompts[0][:40]])  # a row joining later
    out = ragged.forward(torch.full((9, 2), 7), torch.full((9,), 2))
    for row, text in enumerate(kept + [prompts[0][:40]]):
        assert torch.equal(out[row], one_token_logits(text + [7, 7])[-2:]), row


def test_bf16_queries_attend_alone_where_one_call_differs(monkeypatch):
    """Where the build-time checks find other bits, queries attend alone: padded as the batch-1 runner pads
    them, or its exact keys where that runner's own check fails, and each row still matches it bit for bit."""
    import decode.runners.lean as lean_module
    import decode.runners.ragged as ragged_module

    model = small_llama(vocab_size=1000, hidden=256, layers=2, init_std=0.02).to(torch.bfloat16)
    monkeypatch.setattr(ragged_module, "ragged_attention_matches_alone", lambda core: False)
    for lean_pads, alone in [(True, "padded"), (False, "exact")]:
        monkeypatch.setattr(ragged_module, "padded_attention_is_row_invariant", lambda cache: lean_pads)
        monkeypatch.setattr(lean_module, "padded_attention_is_row_invariant", lambda cache: lean_pads)
        ragged, lean = RaggedRunner(model, 1000), make_runner(model, 1000, "lean")
        assert ragged.alone == alone
        ragged.add([[1, 2, 3], [4] * 70])
        out = ragged.forward(torch.tensor([[5, 6], [7, 8]]), torch.tensor([2, 2]))
        for row, text in enumerate([[1, 2, 3, 5, 6], [4] * 70 + [7, 8]]):
            lean.reset()
            alone_logits = torch.cat([lean.forward(torch.tensor([t]), 1) for t in text])
            assert torch.equal(out[row], alone_logits[-2:]), (alone, row)


@pytest.mark.parametrize("extra_per_guess, drafts", [(0.01, True), (2.0, False)])
def test_adaptive_k_drafts_only_where_timed_rounds_say_it_pays(pair, monkeypatch, extra_per_guess, drafts):
    target = pair[0]
    draft = small_llama(seed=0, layers=2)  # the target itself: every guess accepted
    observe, choices = AdaptiveK.observe, []

    def observe_synthetic_seconds(self, k, seconds, blocks, rows):  # tiny rounds time as noise: a known cost instead
        choices.append(k)
        observe(self, k, 1.0 + extra_per_guess * k, blocks, rows)

    monkeypatch.setattr(AdaptiveK, "observe", observe_synthetic_seconds)
    outcomes = serve(RaggedRunner(target, 16), RaggedRunner(draft, 16), PROMPTS, batch_size=3, k=3,
                     max_new_tokens=64, sampling=SamplingParams(), adaptive=True)
    lean = make_runner(target, 16, "lean")
    for prompt, outcome in zip(PROMPTS, outcomes):
        assert outcome.tokens == target_decode(lean, torch.tensor([prompt]), max_new_tokens=64,
                                               sampling=SamplingParams()).tolist()
    assert choices[:12] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]  # every k 3 times, its first round not timed
    after = choices[12:]
    assert len(after) > AdaptiveK.EXPLORE_EVERY
    if drafts:  # k = 3 but for the exploration rounds (k = 2)
        assert set(after) == {2, 3} and after.count(2) <= len(after) / AdaptiveK.EXPLORE_EVERY + 1
    else:  # only the exploration rounds draft (one guess: k = 1, the neighbour of 0)
        assert set(after) == {0, 1} and after.count(1) <= len(after) / AdaptiveK.EXPLORE_EVERY + 1


def test_an_adaptive_k_kept_across_calls_carries_what_it_measured(pair):
    target, draft = pair
    chooser = AdaptiveK(3)
    target_runner, draft_runner = RaggedRunner(target, 16), RaggedRunner(draft, 16)
    serve(target_runner, draft_runner, PROMPTS[:2], batch_size=2, k=3, max_new_tokens=6, sampling=SamplingParams(),
          adaptive=chooser)
    rounds, tried = chooser.rounds, sum(chooser.tried)
    outcomes = serve(target_runner, draft_runner, PROMPTS[2:], batch_size=2, k=3, max_new_tokens=6,
                     sampling=SamplingParams(), adaptive=chooser)
    assert chooser.rounds > rounds and sum(chooser.tried) >= tried and all(len(o.tokens) == 6 for o in outcomes)
    with pytest.raises(ValueError, match="chooses k up to 3, serve was asked for k=2"):
        serve(target_runner, draft_runner, PROMPTS[:1], batch_size=1, k=2, max_new_tokens=2,
              sampling=SamplingParams(), adaptive=chooser)


def timed_chooser(k_max: int, seconds: dict[int, float]) -> AdaptiveK:
    """An AdaptiveK past its first rounds, each k's rounds having taken seconds[k]."""
    chooser = AdaptiveK(k_max)
    for k in range(k_max + 1):
        for _ in range(3):
            assert chooser.choose() == k
            chooser.observe(k, seconds[k], [])
    return chooser


def test_adaptive_k_follows_the_acceptance_and_the_timed_rounds():
    seconds = {k: 1.0 + 0.05 * k for k in range(7)}
    far_ahead = timed_chooser(6, seconds)
    far_ahead.observe(6, seconds[6], [(6, 6)] * 16)  # every guess accepted: draft far ahead
    assert far_ahead.choose() == 6
    useless = timed_chooser(6, seconds)
    useless.observe(1, seconds[1], [(1, 0)] * 50)  # nothing accepted: no drafting
    assert useless.choose() == 0
    chooser = timed_chooser(6, {k: 1.0 + 0.2 * k for k in range(7)})
    half = [(2, 0), (2, 0), (2, 1), (2, 2)]  # α = 0.5 at depths 1 and 2
    chooser.observe(2, 1.4, half * 5)
    assert chooser.choose() == 1  # α = 0.5: 1.5 tokens in 1.2 s beats 1.75 in 1.4 s and 1 in 1.0 s
    for _ in range(10):  # k = 1 rounds turn out to take 1.6 s: no longer worth it
        chooser.observe(1, 1.6, half)
    assert chooser.seconds(1) == pytest.approx(1.6)
    explored = []
    for _ in range(4 * AdaptiveK.EXPLORE_EVERY):
        explored.append(chooser.choose())
        chooser.observe(explored[-1], chooser.seconds(explored[-1]), [])
    best = max(set(explored), key=explored.count)
    assert best == 2  # 1.75 tokens in 1.4 s
    assert set(explored) - {best} <= {best - 1, best + 1} and len(set(explored)) >= 2  # neighbours explored


def test_adaptive_k_times_only_rounds_of_the_most_rows():
    """A queue running dry leaves a few rows whose rounds are cheap at any k: timing k = 0 on them would make
    not drafting look faster than it is at the full batch."""
    chooser = timed_chooser(1, {0: 1.0, 1: 1.2})  # not counted: timed as they come
    half = [(1, 0), (1, 1)]  # α = 0.5: k = 1 emits 1.5 tokens per row
    chooser.observe(1, 1.2, half * 8, rows=16)  # 16 rows: the timings of unknown row counts are dropped
    assert list(chooser.timed[0]) == [] and list(chooser.timed[1]) == [1.2]
    for seconds_at_16, seconds_at_2 in ((1.0, 0.3), (1.0, 0.3), (1.0, 0.3)):
        chooser.observe(0, seconds_at_16, [(0, 0)] * 16, rows=16)
        chooser.observe(0, seconds_at_2, [(0, 0)] * 2, rows=2)
        chooser.observe(1, 1.2, half * 8, rows=16)
    assert chooser.seconds(0) == 1.0 and chooser.full_rows == 16
    assert chooser.choose() == 1  # 1.5 tokens in 1.2 s beat 1 in 1.0 s (the 2-row rounds' 0.3 s would say k = 0)


def test_an_adaptive_k_kept_for_another_batch_size_times_that_batch_afresh(pair):
    target, draft = pair
    chooser = AdaptiveK(2)
    target_runner, draft_runner = RaggedRunner(target, 16), RaggedRunner(draft, 16)
    serve(target_runner, draft_runner, PROMPTS[:3], batch_size=3, k=2, max_new_tokens=12, sampling=SamplingParams(),
          adaptive=chooser)
    assert chooser.full_rows == 3 and all(len(times) >= 2 for times in chooser.timed.values())
    serve(target_runner, draft_runner, PROMPTS[3:4], batch_size=3, k=2, max_new_tokens=12, sampling=SamplingParams(),
          adaptive=chooser)  # one request: its one-row rounds are the batch now, timed from scratch
    assert chooser.full_rows == 1 and all(len(times) >= 1 for times in chooser.timed.values())


def test_adaptive_k_counts_acceptance_per_depth():
    chooser = AdaptiveK(3)
    chooser.observe(3, 1.0, [(3, 0), (3, 1), (3, 3), (2, 2), (1, 0)])
    # a guess is tested when every guess before it was accepted; (2, 2) drafted no third guess
    assert chooser.tried[1:] == [5, 3, 1] and chooser.accepted[1:] == [3, 2, 1]
    # First guesses nearly always accepted, second ones rarely: one more guess costs 0.1 s and is worth
    # 0.09 tokens, so k = 1. One α pooled over the depths (0.52) would price the second guess at 0.27.
    chooser = timed_chooser(3, {k: 1.0 + 0.1 * k for k in range(4)})
    chooser.observe(2, 1.2, [(2, 0)] * 10 + [(2, 1)] * 81 + [(2, 2)] * 9)
    assert chooser.depth_acceptance(1) == pytest.approx(0.9, abs=0.01)
    assert chooser.depth_acceptance(2) == pytest.approx(0.1, abs=0.01)
    assert chooser.choose() == 1


def test_rounds_without_guesses_keep_the_draft_in_step(pair, monkeypatch):
    """After a round that drafts nothing (k = 0), the draft reads the token the target emitted before it
    guesses again: a draft equal to the target then has every guess accepted."""
    target = pair[0]
    plan = iter([0, 2, 0, 0, 3] * 20)
    monkeypatch.setattr(AdaptiveK, "choose", lambda self: next(plan))
    outcomes = serve(RaggedRunner(target, 16), RaggedRunner(small_llama(seed=0, layers=2), 16), PROMPTS,
                     batch_size=3, k=3, max_new_tokens=20, sampling=SamplingParams(), adaptive=True)
    assert all(o.stats.proposed > 0 and o.stats.accepted == o.stats.proposed for o in outcomes)


def test_adaptive_k_weighs_p_min_arms_on_the_tokens_their_rounds_emit(pair):
    chooser = AdaptiveK(3, p_mins=(0.7, 0.5))
    assert chooser.arms == [(0, 0.0), (1, 0.0), (2, 0.0), (3, 0.0), (3, 0.5), (3, 0.7)]
    for arm in range(len(chooser.arms)):  # the sweep: every arm three times
        for _ in range(3):
            assert chooser.choose() == arm
            chooser.observe(arm, {4: 1.1}.get(arm, 1.0 + 0.1 * arm), [])
    tried = chooser.tried[:]
    chooser.observe(4, 1.1, [(3, 3), (1, 0), (2, 2)] * 10)  # 8 tokens per 3 rows in 1.1 s
    assert chooser.tried == tried  # p_min rounds stop where the draft is unsure: not a per-depth sample
    assert chooser.expected_tokens(4) == pytest.approx((80 + 4 * chooser.expected_tokens(3)) / 34)
    assert chooser.choose() == 4
    with pytest.raises(ValueError, match=r"p_mins must lie in \(0, 1\)"):
        AdaptiveK(3, p_mins=(1.0,))
    # Served: greedy rows still equal target-only decoding whichever arm each round takes.
    target, draft = pair
    outcomes = serve(RaggedRunner(target, 16), RaggedRunner(draft, 16), PROMPTS, batch_size=2, k=3,
                     max_new_tokens=24, sampling=SamplingParams(), adaptive=AdaptiveK(3, p_mins=(0.5,)))
    lean = make_runner(target, 16, "lean")
    for prompt, outcome in zip(PROMPTS, outcomes):
        assert outcome.tokens == target_decode(lean, torch.tensor([prompt]), max_new_tokens=24,
                                               sampling=SamplingParams()).tolist()
