"""RELIABILITY 1, 4, 5: the acceptance rule on synthetic distributions (χ² tests)."""

import pytest
import torch
from scipy import stats as scipy_stats

from common.sampling import SamplingParams, draw_each, sample, sample_each
from decode.speculative import verify_block, verify_greedy


V = 6
P_MIN = 1e-4


def random_dist(gen, zero=()):
    p = torch.rand(V, generator=gen) + 0.05
    p[list(zero)] = 0.0
    return p / p.sum()


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    support = probs > 0
    assert counts[~support].sum() == 0, "a zero-probability token was emitted"
    expected = probs[support] * counts.sum()
    return scipy_stats.chisquare(counts[support].numpy(), expected.numpy()).pvalue


def simulate(target, draft, k, length, n_runs, gen):
    """Run the speculative algorithm over context-free per-position distributions
    target[n], draft[n] (absolute position n) and histogram the token at each position."""
    counts = [[0] * V for _ in range(length)]
    for _ in range(n_runs):
        out = []
        while len(out) < length:
            pos = len(out)
            k_block = min(k, length - pos - 1)
            drafted = sample(draft[pos: pos + k_block], gen).tolist() if k_block else []  # one draw per row
            emitted, _ = verify_block(drafted, list(draft[pos: pos + k_block]), target[pos: pos + k_block + 1], gen)
            out.extend(emitted)
        for pos, tok in enumerate(out[:length]):
            counts[pos][tok] += 1
    return torch.tensor(counts, dtype=torch.float)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_every_position_matches_target(k):
    gen = torch.Generator().manual_seed(k)
    length = k + 2
    # Position 1: the draft puts mass where the target has none; position 2: target zeros.
    target = torch.stack([random_dist(gen, zero=(2,) if n == 2 else ()) for n in range(length)])
    draft = torch.stack([random_dist(gen, zero=(0,) if n == 0 else ()) for n in range(length)])
    counts = simulate(target, draft, k, length, n_runs=6000, gen=gen)
    for pos in range(length):
        assert chi2_pvalue(counts[pos], target[pos]) > P_MIN, f"position {pos}"


def test_residual_distribution():
    gen = torch.Generator().manual_seed(7)
    target, draft = random_dist(gen), random_dist(gen)
    counts = torch.zeros(V)
    for token in sample(draft.expand(20000, V), gen).tolist():
        emitted, accepted = verify_block([token], [draft], torch.stack([target, target]), gen)
        if accepted == 0:
            counts[emitted[0]] += 1
    residual = torch.clamp(target - draft, min=0)
    assert chi2_pvalue(counts, residual / residual.sum()) > P_MIN


def test_lookup_proposal_gives_the_target_distribution():
    """A token proposed with probability 1 (prompt lookup, draft_probs None) is kept with the
    target's probability of it, else the target without it is sampled: together, the target."""
    gen = torch.Generator().manual_seed(8)
    target = random_dist(gen)
    counts = torch.zeros(V)
    for _ in range(12000):
        emitted, accepted = verify_block([3], [None], torch.stack([target, target]), gen)
        counts[emitted[0]] += 1
        assert (accepted == 1) == (emitted[0] == 3)  # a rejection never emits the looked-up token
    assert chi2_pvalue(counts, target) > P_MIN


def test_acceptance_rate_matches_sum_of_minimums():
    gen = torch.Generator().manual_seed(3)
    target, draft = random_dist(gen), random_dist(gen)
    n = 20000
    accepted = 0
    for token in sample(draft.expand(n, V), gen).tolist():
        emitted, a = verify_block([token], [draft], torch.stack([target, target]), gen)
        accepted += a
        assert len(emitted) == 1 + a  # the bonus token comes only after an acceptance
    alpha = torch.minimum(target, draft).sum().item()
    stderr = (alpha * (1 - alpha) / n) ** 0.5
    assert abs(accepted / n - alpha) < 5 * stderr


def test_draft_equals_target_always_accepts():
    gen = torch.Generator().manual_seed(0)
    dists = torch.stack([random_dist(gen) for _ in range(4)])
    for _ in range(500):
        drafted = [int(sample(dists[i], gen)) for i in range(3)]
        emitted, accepted = verify_block(drafted, list(dists[:3]), dists, gen)
        assert accepted == 3 and len(emitted) == 4 and emitted[:3] == drafted


def test_disjoint_supports_always_reject_and_follow_target():
    gen = torch.Generator().manual_seed(1)
    target = torch.tensor([0.5, 0.3, 0.2, 0.0, 0.0, 0.0])
    draft = torch.tensor([0.0, 0.0, 0.0, 0.6, 0.4, 0.0])
    counts = torch.zeros(V)
    for _ in range(5000):
        token = int(sample(draft, gen))
        emitted, accepted = verify_block([token], [draft], torch.stack([target, target]), gen)
        assert accepted == 0 and len(emitted) == 1
        counts[emitted[0]] += 1
    assert chi2_pvalue(counts, target) > P_MIN


def test_greedy_one_hot_is_exact():
    """T = 0: one-hot distributions; accept iff the tokens agree, else emit the target's argmax."""
    eye = torch.eye(V)
    emitted, accepted = verify_block([3, 4], [eye[3], eye[4]], torch.stack([eye[3], eye[1], eye[5]]))
    assert emitted == [3, 1] and accepted == 1
    emitted, accepted = verify_block([3, 4], [eye[3], eye[4]], torch.stack([eye[3], eye[4], eye[5]]))
    assert emitted == [3, 4, 5] and accepted == 2


def test_subset_rows_give_the_full_vocabulary_rule():
    """A draft over a subset's rows (draft_ids) decides exactly as the same draft spread over the
    full vocabulary: same accept/reject choices and the same residual samples, draw for draw."""
    gen = torch.Generator().manual_seed(5)
    draft_ids = torch.tensor([0, 2, 3, 5])  # the draft can emit only these ids
    for trial in range(200):
        k = 1 + trial % 3
        target = torch.stack([random_dist(gen) for _ in range(k + 1)])
        rows = [torch.rand(len(draft_ids), generator=gen) + 0.05 for _ in range(k)]
        rows = [r / r.sum() for r in rows]
        full = [torch.zeros(V).index_copy_(0, draft_ids, r) for r in rows]
        drafted = [int(draft_ids[sample(r, gen)]) for r in rows]
        seed = int(torch.randint(0, 2**31, (), generator=gen))
        by_rows = verify_block(drafted, rows, target, torch.Generator().manual_seed(seed), draft_ids)
        by_vocab = verify_block(drafted, full, target, torch.Generator().manual_seed(seed))
        assert by_rows == by_vocab


def test_verify_greedy_equals_the_one_hot_rule():
    """T = 0: the argmax shortcut decides as verify_block does on one-hot distributions."""
    gen = torch.Generator().manual_seed(6)
    eye = torch.eye(V)
    for trial in range(300):
        k = 1 + trial % 4
        target_logits = torch.randn(k + 1, V, generator=gen)
        best = target_logits.argmax(-1)
        # Drafted tokens agree with the target's argmax for a random prefix, then are random.
        agree = int(torch.randint(0, k + 1, (), generator=gen))
        drafted = [int(best[i]) if i < agree else int(torch.randint(0, V, (), generator=gen)) for i in range(k)]
        expected = verify_block(drafted, [eye[t] for t in drafted], eye[best])
        assert verify_greedy(drafted, target_logits) == expected


def test_sample_draws_each_row_from_its_distribution():
    """The sampler itself: χ² per row, zero-probability tokens first, inside and last never drawn."""
    gen = torch.Generator().manual_seed(11)
    rows = torch.stack([random_dist(gen, zero=(0, 3)), random_dist(gen, zero=(V - 1,))])  # [2, V]
    counts = torch.zeros(2, V)
    for _ in range(6000):
        ids = sample(rows, gen)
        assert ids.shape == (2,)
        counts[0, ids[0]] += 1
        counts[1, ids[1]] += 1
    for row in range(2):
        assert chi2_pvalue(counts[row], rows[row]) > P_MIN


def test_rows_drawn_together_are_the_rows_drawn_one_by_one():
    """sample_each / draw_each (the batched decoder's and the rollouts' draws) give row i what sample() gives it
    with generators[i], and leave each generator where sample() leaves it, so a row's text depends on neither its
    batch nor its neighbours."""
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(3)) * 3
    for sampling in (SamplingParams(0.7, top_p=0.9), SamplingParams(1.0, top_k=20), SamplingParams(0.0)):
        together = [torch.Generator().manual_seed(seed) for seed in range(5)]
        alone = [torch.Generator().manual_seed(seed) for seed in range(5)]
        for _ in range(3):
            drawn = draw_each(logits, sampling, together)
            one_by_one = [int(logits[i].argmax()) if sampling.greedy else int(sample(sampling.warp(logits[i]), g))
                          for i, g in enumerate(alone)]
            assert drawn == one_by_one
        assert [g.get_state().tolist() for g in together] == [g.get_state().tolist() for g in alone]
    probs = SamplingParams(0.7).warp(logits)
    assert len(set(sample_each(probs, [torch.Generator().manual_seed(0)] * 5).tolist())) > 1  # one stream, 5 draws


def test_sample_never_returns_past_the_last_token_with_mass(monkeypatch):
    """u * total rounding up to the total falls back to the last token with probability > 0."""
    probs = torch.tensor([0.2, 0.5, 0.3, 0.0, 0.0])
    monkeypatch.setattr(torch, "rand", lambda *shape, **kw: torch.ones(*shape, dtype=kw.get("dtype")))
    assert int(sample(probs)) == 2


def test_fewer_draft_rows_give_the_zero_padded_rule():
    """A draft with fewer rows than the target's vocabulary (row r = token r, no draft_ids) decides
    exactly as the same draft padded with zeros: the ids above its rows have draft probability 0."""
    gen = torch.Generator().manual_seed(9)
    rows_n = 4
    for trial in range(200):
        k = 1 + trial % 3
        target = torch.stack([random_dist(gen) for _ in range(k + 1)])
        rows = [torch.rand(rows_n, generator=gen) + 0.05 for _ in range(k)]
        rows = [r / r.sum() for r in rows]
        padded = [torch.cat([r, torch.zeros(V - rows_n)]) for r in rows]
        drafted = [int(sample(r, gen)) for r in rows]
        seed = int(torch.randint(0, 2**31, (), generator=gen))
        by_rows = verify_block(drafted, rows, target, torch.Generator().manual_seed(seed))
        by_vocab = verify_block(drafted, padded, target, torch.Generator().manual_seed(seed))
        assert by_rows == by_vocab
