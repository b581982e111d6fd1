"""Distillation losses (RELIABILITY 18): zero on identical inputs, masking, -inf safety, slicing."""

import math

import pytest
import torch

from distill.data import Example, collate
from distill.losses import (acceptance, cross_entropy, forward_kl, full_vocab_buckets, jsd, kl_acceptance_blend,
                            mixed_loss, neg_log_acceptance, reverse_kl, subset_buckets, topk_buckets, tvd)
from distill.training.teacher import forward_at
from tests.conftest import small_llama


DIVERGENCES = [forward_kl, reverse_kl, tvd, lambda d, t, m: jsd(d, t, m, 0.3), neg_log_acceptance,
               kl_acceptance_blend]


def _logp(n=6, v=10, seed=0, neg_inf_cols=()):
    logits = torch.randn(n, v, generator=torch.Generator().manual_seed(seed)) * 3
    logits[:, list(neg_inf_cols)] = float("-inf")
    return torch.log_softmax(logits, -1)


@pytest.mark.parametrize("loss", DIVERGENCES)
def test_identical_distributions_give_zero(loss):
    logp = _logp(neg_inf_cols=(2, 7))  # zero-probability tokens too
    mask = torch.ones(6, dtype=torch.bool)
    total, count = loss(logp, logp.clone(), mask)
    assert abs(float(total)) < 1e-6 and int(count) == 6


@pytest.mark.parametrize("loss", DIVERGENCES)
def test_masked_tokens_contribute_nothing(loss):
    draft, target = _logp(seed=1), _logp(seed=2)
    mask = torch.tensor([1, 0, 1, 0, 0, 1], dtype=torch.bool)
    total, count = loss(draft, target, mask)
    changed = target.clone()
    changed[~mask] = _logp(seed=3)[~mask]  # anything at masked positions, even NaN-free garbage
    total2, _ = loss(draft, changed, mask)
    assert int(count) == 3
    assert torch.allclose(total, total2)
    assert float(total) > 0


def test_forward_kl_matches_torch_and_jsd_tvd_bounds():
    draft, target = _logp(seed=4), _logp(seed=5)
    mask = torch.ones(6, dtype=torch.bool)
    ref = torch.nn.functional.kl_div(draft, target, log_target=True, reduction="sum")
    assert torch.allclose(forward_kl(draft, target, mask)[0], ref, atol=1e-5)
    assert torch.allclose(reverse_kl(draft, target, mask)[0],
                          torch.nn.functional.kl_div(target, draft, log_target=True, reduction="sum"), atol=1e-5)
    j, _ = jsd(draft, target, mask, 0.5)
    assert 0 < float(j) <= 6 * math.log(2)
    assert torch.allclose(j, jsd(target, draft, mask, 0.5)[0], atol=1e-6)  # symmetric at β = 0.5
    # α = 1 - TVD, token by token
    assert torch.allclose(acceptance(draft, target, mask)[0], 6 - tvd(draft, target, mask)[0], atol=1e-5)


def test_forward_kl_gradient_with_and_without_zero_target_probabilities_matches_torch():
    """kl_per_token sums directly where the target has no zero and sanitises where it has: both give
    torch's gradient (at a zero the term is 0·log 0 = 0, as kl_div's)."""
    mask = torch.ones(6, dtype=torch.bool)
    for zero_cols in ((), (2, 7)):
        target = _logp(seed=5, neg_inf_cols=zero_cols)
        ours, theirs = (torch.randn(6, 10, generator=torch.Generator().manual_seed(4)).requires_grad_()
                        for _ in range(2))
        forward_kl(torch.log_softmax(ours, -1), target, mask)[0].backward()
        torch.nn.functional.kl_div(torch.log_softmax(theirs, -1), target, log_target=True, reduction="sum").backward()
        torch.testing.assert_close(ours.grad, theirs.grad)


def test_acceptance_losses_are_functions_of_acceptance_and_kl():
    draft, target = _logp(seed=4), _logp(seed=5)
    mask = torch.ones(6, dtype=torch.bool)
    alpha = torch.minimum(draft.exp(), target.exp()).sum(-1)  # [6]
    assert torch.allclose(neg_log_acceptance(draft, target, mask)[0], -alpha.log().sum(), atol=1e-5)
    kl = torch.nn.functional.kl_div(draft, target, log_target=True, reduction="none").sum(-1)
    weight = torch.exp(-3.0 * alpha)
    blend = (weight * kl + (1 - weight) * (1 - alpha)).sum()
    assert torch.allclose(kl_acceptance_blend(draft, target, mask, eta=3.0)[0], blend, atol=1e-5)
    # eta = 0: forward KL alone; a large eta: TVD (1 − α) alone.
    assert torch.allclose(kl_acceptance_blend(draft, target, mask, eta=0.0)[0], forward_kl(draft, target, mask)[0],
                          atol=1e-5)
    assert torch.allclose(kl_acceptance_blend(draft, target, mask, eta=1e4)[0], tvd(draft, target, mask)[0], atol=1e-5)


def test_acceptance_losses_raise_acceptance_by_gradient_descent():
    """A few steps of each acceptance loss on a free draft raise α towards the target's 1."""
    target = _logp(n=4, v=8, seed=7)
    mask = torch.ones(4, dtype=torch.bool)
    for loss in (neg_log_acceptance, kl_acceptance_blend, tvd):
        logits = torch.zeros(4, 8, requires_grad=True)
        start = float(acceptance(torch.log_softmax(logits, -1), target, mask)[0])
        optimizer = torch.optim.SGD([logits], lr=0.5)
        for _ in range(50):
            optimizer.zero_grad()
            loss(torch.log_softmax(logits, -1), target, mask)[0].backward()
            optimizer.step()
        assert float(acceptance(torch.log_softmax(logits, -1), target, mask)[0]) > start + 0.5


@pytest.mark.parametrize("name", ["forward_kl", "reverse_kl", "jsd", "tvd", "neg_log_accept", "lk", "ce"])
def test_neg_inf_entries_give_finite_gradients(name):
    logits = torch.randn(5, 12, generator=torch.Generator().manual_seed(0))
    logits[:, 3] = float("-inf")  # a token the draft can never emit
    logits = logits.requires_grad_()
    target_logits = torch.randn(5, 12, generator=torch.Generator().manual_seed(1))
    target_logits[:, 3] = float("-inf")
    if name != "reverse_kl":  # KL(draft ‖ target) is truly infinite where only the target is 0
        target_logits[:, 9] = float("-inf")  # a token the target never emits
    draft_logp, target_logp = full_vocab_buckets(logits, target_logits)
    labels = torch.tensor([0, 1, 2, 4, 5])
    mask = torch.tensor([1, 1, 0, 1, 1], dtype=torch.bool)
    total = mixed_loss({name: 1.0}, draft_logp, target_logp, logits, labels, mask)
    total.backward()
    assert torch.isfinite(total)
    assert torch.isfinite(logits.grad).all()


def test_topk_buckets_with_unmapped_rows_have_finite_gradients():
    logits = torch.randn(4, 20, requires_grad=True)
    rows = torch.tensor([[0, 5, -1], [3, -1, -1], [1, 2, 19], [7, 8, 9]])  # -1: outside the draft vocabulary
    topk_logp = torch.log(torch.tensor([[0.5, 0.2, 0.1], [0.9, 0.05, 0.01], [0.3, 0.3, 0.3], [0.6, 0.2, 0.1]]))
    draft, target = topk_buckets(logits, rows, topk_logp)
    assert torch.allclose(draft.exp().sum(-1), torch.ones(4), atol=1e-5)
    assert torch.allclose(target.exp().sum(-1), torch.ones(4), atol=1e-5)
    mask = torch.ones(4, dtype=torch.bool)
    for loss in DIVERGENCES:
        logits.grad = None
        total, _ = loss(draft, target, mask)
        total.backward(retain_graph=True)
        assert torch.isfinite(logits.grad).all()


def test_kl_of_a_model_with_itself_is_zero_on_every_support():
    logits = torch.randn(7, 50, generator=torch.Generator().manual_seed(3)) * 4
    mask = torch.ones(7, dtype=torch.bool)
    full = full_vocab_buckets(logits, logits.clone())
    assert abs(float(forward_kl(*full, mask)[0])) < 1e-6
    top = torch.log_softmax(logits, -1).topk(8, -1)
    cached = topk_buckets(logits, top.indices, top.values)
    assert abs(float(forward_kl(*cached, mask)[0])) < 1e-5
    assert abs(float(acceptance(*cached, mask)[0]) - 7) < 1e-4
    # a subset draft that is the target restricted to 10 tokens + an "other" row with the rest
    subset = torch.arange(0, 50, 5)
    target_logp = torch.log_softmax(logits, -1)
    outside = torch.logsumexp(target_logp.index_fill(1, subset, float("-inf")), -1, keepdim=True)
    draft_logits = torch.cat([target_logp[:, subset], outside], -1)
    assert abs(float(forward_kl(*subset_buckets(draft_logits, logits, subset), mask)[0])) < 1e-5


def test_teacher_logits_are_sliced_to_the_shared_vocabulary():
    draft_logits = torch.randn(3, 16)
    target_logits = torch.randn(3, 16)
    padded = torch.cat([target_logits, torch.full((3, 8), 50.0)], -1)  # padded embedding rows
    sliced = full_vocab_buckets(draft_logits, padded)
    plain = full_vocab_buckets(draft_logits, target_logits)
    assert sliced[1].shape == (3, 16)
    assert torch.allclose(sliced[1], plain[1]) and torch.allclose(sliced[0], plain[0])


def test_temperature_and_mixing_weights():
    draft, target = _logp(seed=6), _logp(seed=7)
    logits, labels = draft.clone(), torch.arange(6)
    mask = torch.ones(6, dtype=torch.bool)
    kl = mixed_loss({"forward_kl": 1.0}, draft, target, logits, labels, mask)
    ce, _ = cross_entropy(logits, labels, mask)
    mixed = mixed_loss({"forward_kl": 0.5, "ce": 2.0}, draft, target, logits, labels, mask)
    assert torch.allclose(mixed, 0.5 * kl + 2.0 * ce)
    assert torch.allclose(mixed_loss({"forward_kl": 0.5, "ce": 0.0}, draft, target, logits, labels, mask), 0.5 * kl)
    hot = mixed_loss({"forward_kl": 1.0}, draft, target, logits, labels, mask, temperature=4.0)
    assert float(hot) < float(kl)  # softer distributions are closer
    same = mixed_loss({"forward_kl": 1.0}, target, target, logits, labels, mask, temperature=2.0)
    assert abs(float(same)) < 1e-6


def test_spread_draft_buckets_equal_its_full_vocabulary_export_bucketed():
    """A spread subset draft's training buckets (its "other" logit counted V - N times) are its
    full-vocabulary distribution (the "other" logit at every outside id, as hf-full exports it)
    bucketed the same way: online (subset + outside) and cached (top-K + rest, top-K ids inside and
    outside the subset)."""
    from decode.vocab import VocabSubset

    gen = torch.Generator().manual_seed(0)
    full_vocab, ids = 40, [0, 3, 4, 9, 17, 22, 31]
    subset = VocabSubset(ids, full_vocab, spread_other=True)
    rows = torch.randn(5, len(ids) + 1, generator=gen) * 3  # the draft's head: N tokens + "other"
    exported = subset.full_logits(rows)  # [5, V]
    target_logits = torch.randn(5, full_vocab, generator=gen) * 3

    draft_b, _ = subset_buckets(subset.bucket_logits(rows), target_logits, subset.ids)
    exported_logp = torch.log_softmax(exported, -1)
    outside = exported_logp.index_fill(1, subset.ids, float("-inf")).logsumexp(-1, keepdim=True)
    assert torch.allclose(draft_b, torch.cat([exported_logp[:, ids], outside], -1), atol=1e-5)

    topk_ids = torch.stack([torch.randperm(full_vocab, generator=gen)[:6] for _ in range(5)])  # [5, 6]
    topk_logp = torch.log_softmax(target_logits, -1).gather(1, topk_ids)
    draft_k, _ = topk_buckets(subset.bucket_logits(rows), subset.output_rows[topk_ids], topk_logp)
    exported_k, _ = topk_buckets(exported, topk_ids, topk_logp)
    # Top-K tokens outside the subset: the draft has no row for them (its rest holds them); the
    # export gives each the "other" logit. Compare the subset columns and the total of the rest.
    inside = subset.output_rows[topk_ids] >= 0
    assert torch.allclose(draft_k[:, :-1][inside], exported_k[:, :-1][inside], atol=1e-5)
    rest_of_export = torch.logsumexp(torch.cat([exported_k[:, :-1].masked_fill(inside, float("-inf")),
                                                exported_k[:, -1:]], -1), -1)
    assert torch.allclose(draft_k[:, -1], rest_of_export, atol=1e-5)
    # An old draft's "other" logit is the outside mass itself: no count added.
    assert torch.equal(VocabSubset(ids, full_vocab).bucket_logits(rows), rows)


def test_filter_hardest_leaves_out_the_positions_the_draft_fits_worst():
    """filter_hardest = 0.25 over 8 positions: the 2 of largest KL(target ‖ draft) add nothing, and get no gradient;
    the other 6 give exactly the unfiltered loss over them. A float mask keeps its weights on the kept positions."""
    target = _logp(n=8, v=6, seed=3)
    logits = torch.randn(8, 6, generator=torch.Generator().manual_seed(4), requires_grad=True)
    draft = torch.log_softmax(logits, -1)
    kl = torch.nn.functional.kl_div(draft, target, log_target=True, reduction="none").sum(-1)
    hardest = set(kl.topk(2).indices.tolist())
    kept = torch.tensor([i not in hardest for i in range(8)])
    weights = {"forward_kl": 1.0, "tvd": 0.5}
    filtered = mixed_loss(weights, draft, target, logits, None, torch.ones(8, dtype=torch.bool), filter_hardest=0.25)
    assert torch.allclose(filtered, mixed_loss(weights, draft, target, logits, None, kept), atol=1e-6)
    filtered.backward()
    assert logits.grad[sorted(hardest)].abs().max() == 0 and logits.grad[kept].abs().max() > 0
    weighted = torch.linspace(0.1, 0.8, 8)
    assert torch.allclose(mixed_loss(weights, draft, target, logits, None, weighted, filter_hardest=0.25),
                          mixed_loss(weights, draft, target, logits, None, weighted * kept), atol=1e-6)
    assert torch.equal(mixed_loss(weights, draft, target, logits, None, kept, filter_hardest=0.1),
                       mixed_loss(weights, draft, target, logits, None, kept))  # floor(0.1 · 6) = 0 positions left out


def test_the_head_runs_only_at_the_loss_positions_with_the_logits_and_gradients_of_a_full_forward():
    model = small_llama(seed=4, layers=2, tie=True).train()
    rng = torch.Generator().manual_seed(0)
    # rows of different lengths whose completions start at different positions, right-padded
    examples = [Example(torch.randint(2, 16, (n,), generator=rng).numpy(), prompt, None, None, "x")
                for n, prompt in ((9, 6), (4, 2), (7, 1))]
    batch = collate(examples, 1, with_topk=False)
    mask = batch["loss_mask"]
    inputs = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    head_rows = []
    model.lm_head.register_forward_hook(lambda module, args, out: head_rows.append(args[0].shape[:-1].numel()))
    gathered = forward_at(model, mask, **inputs).logits[0]
    full = model(**inputs).logits[mask]
    # the head saw the loss positions only, and a plain forward after forward_at sees every position
    assert head_rows == [int(mask.sum()), mask.numel()] and head_rows[0] < mask.numel()
    assert torch.allclose(gathered, full, atol=1e-5)
    grads = torch.autograd.grad(gathered.square().sum(), list(model.parameters()))
    for grad, full_grad in zip(grads, torch.autograd.grad(full.square().sum(), list(model.parameters()))):
        assert torch.allclose(grad, full_grad, rtol=1e-4, atol=1e-4)
