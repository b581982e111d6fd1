"""Distillation losses: pure functions, fp32, masked, each returning (sum, count).

Every divergence compares two log-distributions over the SAME support of B buckets,
`draft_logp` and `target_logp`, both [N, B] (N = token positions, rows sum to 1 in prob).
The caller divides the summed loss by the GLOBAL token count (all micro-batches, all ranks).

The support is built by one of three functions below:
  full_vocab_buckets  online teacher, full-vocabulary draft: every shared token is a bucket
  subset_buckets      online teacher, vocab-subset draft: the N subset tokens + one "rest" bucket
  topk_buckets        cached teacher (top-K logprobs stored on disk): the K stored tokens + "rest"

Tail mass with a cached teacher: the teacher's probability outside its stored top-K is known
only in total (1 - Σ top-K). Both sides are therefore coarsened to K + 1 buckets: the K stored
tokens and one "rest" bucket holding everything else (teacher: 1 - Σ p_topk; draft: the exact
log-sum-exp of its logits outside the K tokens). Divergences on the coarsened pair are lower
bounds of the full-vocabulary ones (data processing inequality) and are exactly 0 when the
draft equals the target. With a subset draft, top-K tokens outside the subset fall into "rest",
and the draft's extra "other" output row is part of its "rest" mass during training (the
decoder ignores that row and renormalises over the subset).

-inf entries (probability 0) are legal everywhere: terms with zero weight are masked out on
sanitised inputs, so they contribute 0 to the loss and never produce NaN gradients.
"""

from __future__ import annotations

import math

import torch

# A finite stand-in for log(0) on the draft side of a bucket that is empty by construction
# (e.g. every draft row lies in the top-K): keeps logsumexp and its gradient finite.
_LOG_ZERO = -1e30
# The cached teacher's rest mass (1 - Σ top-K) can round to exactly 0 in fp32 for peaked
# distributions; a floor of 1e-6 keeps reverse KL / JSD finite at a negligible bias.
_REST_FLOOR = 1e-6


def _masked_sum(per_token: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ over positions where mask is True; (sum, count) with count as a float tensor. A float mask
    weighs each position instead (0 = left out, the count is the total weight): a feature draft weighs
    its positions by the target's mass inside its vocabulary subset (distill/training/feature_loss.py)."""
    weight = mask.to(per_token.dtype)
    # `where`, not a product alone: an inf at a masked position must not turn the sum into NaN.
    return torch.where(mask != 0, per_token * weight, torch.zeros_like(per_token)).sum(), weight.sum()


def kl_per_token(logp_a: torch.Tensor, logp_b: torch.Tensor) -> torch.Tensor:
    """Per-token KL(a ‖ b) = Σ_v a_v (log a_v − log b_v), with 0·log 0 = 0.

    Inputs are sanitised BEFORE the arithmetic: a `where` on the output alone still lets the
    masked branch's inf/NaN leak into the gradient (0 · inf = NaN in the chain rule). Where a has no
    zero (a teacher over the whole subset, the usual case) the plain sum is the same value and gradient
    without the three `where`s: forward and backward of [700, 2,048] took 3.1-3.4 ms against 7.9-8.1, and 40
    steps of the feature preset 0.966x the wall time (2-core AMX Xeon, paired runs; the standalone demo's level)."""
    if not torch.isneginf(logp_a).any():
        return (logp_a.exp() * (logp_a - logp_b)).sum(-1)
    present = logp_a > float("-inf")
    a = torch.where(present, logp_a, torch.zeros_like(logp_a))
    b = torch.where(present, logp_b, torch.zeros_like(logp_b))
    return torch.where(present, a.exp() * (a - b), torch.zeros_like(a)).sum(-1)


def forward_kl(draft_logp, target_logp, mask):
    """KL(target ‖ draft): mass-covering; the usual distillation loss."""
    return _masked_sum(kl_per_token(target_logp.float(), draft_logp.float()), mask)


def reverse_kl(draft_logp, target_logp, mask):
    """KL(draft ‖ target): mode-seeking."""
    return _masked_sum(kl_per_token(draft_logp.float(), target_logp.float()), mask)


def jsd(draft_logp, target_logp, mask, beta: float = 0.5):
    """Generalised Jensen-Shannon: β·KL(target ‖ m) + (1−β)·KL(draft ‖ m), m = β·target + (1−β)·draft.

    β = 0.5 is the symmetric JSD (bounded by ln 2); β must lie strictly inside (0, 1)."""
    if not 0.0 < beta < 1.0:
        raise ValueError(f"jsd beta must be in (0, 1), got {beta}")
    d, t = draft_logp.float(), target_logp.float()
    # Where both are 0 the mixture is 0 too and logsumexp's gradient would be NaN (0/0):
    # compute the mixture on finite stand-ins there; those terms have zero weight anyway.
    both_zero = (d == float("-inf")) & (t == float("-inf"))
    d_safe, t_safe = d.masked_fill(both_zero, 0.0), t.masked_fill(both_zero, 0.0)
    mix = torch.logsumexp(torch.stack([t_safe + math.log(beta), d_safe + math.log(1 - beta)]), dim=0)
    per_token = beta * kl_per_token(t, mix) + (1 - beta) * kl_per_token(d, mix)
    return _masked_sum(per_token, mask)


def tvd(draft_logp, target_logp, mask):
    """Total variation ½ Σ |target − draft|. Note 1 − TVD is exactly the acceptance rate α."""
    return _masked_sum(_tvd_per_token(draft_logp, target_logp), mask)


def _tvd_per_token(draft_logp, target_logp):
    return 0.5 * (target_logp.float().exp() - draft_logp.float().exp()).abs().sum(-1)


def _acceptance_per_token(draft_logp, target_logp):
    """α = Σ_v min(draft_probs, target_probs) per position [N]."""
    return torch.minimum(draft_logp.float().exp(), target_logp.float().exp()).sum(-1)


# −log α of a position where the draft has no mass on the target's support: log of this floor
# (α = 1e-6 gives a loss of 13.8 nats) instead of inf, so one such position cannot swamp a step.
_ACCEPT_FLOOR = 1e-6


def neg_log_acceptance(draft_logp, target_logp, mask):
    """−log α per position: acceptance itself as the objective. Its gradient is the TVD's divided by α,
    so positions the draft barely matches weigh more than under TVD (which gives every position the
    same bounded gradient)."""
    per_token = -torch.log(_acceptance_per_token(draft_logp, target_logp).clamp(min=_ACCEPT_FLOOR))
    return _masked_sum(per_token, mask)


def kl_acceptance_blend(draft_logp, target_logp, mask, eta: float = 3.0):
    """λ·KL(target ‖ draft) + (1 − λ)·TVD per position, λ = exp(−η·α) with α not differentiated: where
    the draft is far from the target (α small) the smooth, mass-covering KL leads; as α grows the
    objective turns into 1 − α itself. After the LK losses (arXiv 2602.23881): a small draft settles
    where minimising KL alone does not maximise acceptance."""
    alpha = _acceptance_per_token(draft_logp, target_logp).detach()
    weight = torch.exp(-eta * alpha)
    kl = kl_per_token(target_logp.float(), draft_logp.float())
    return _masked_sum(weight * kl + (1 - weight) * _tvd_per_token(draft_logp, target_logp), mask)


def cross_entropy(draft_logits, labels, mask):
    """−log draft(label) on the sampled tokens (draft rows; T = 1). draft_logits [N, V], labels [N]."""
    logp = torch.log_softmax(draft_logits.float(), dim=-1)
    per_token = -logp.gather(-1, labels.clamp(min=0)[:, None])[:, 0]
    return _masked_sum(per_token, mask)


def acceptance(draft_logp, target_logp, mask):
    """Expected acceptance α = Σ_v min(draft_probs, target_probs) per token (Leviathan et al.)."""
    return _masked_sum(_acceptance_per_token(draft_logp, target_logp), mask)


DIVERGENCES = {"forward_kl": forward_kl, "reverse_kl": reverse_kl, "tvd": tvd, "neg_log_accept": neg_log_acceptance}


def temper(logp: torch.Tensor, temperature: float) -> torch.Tensor:
    """Distillation temperature on a bucketed log-distribution: log_softmax(logp / T).

    Applied identically to draft and target after bucketing, so identical inputs stay
    identical; for full-vocabulary buckets it equals log_softmax(logits / T). With a "rest"
    bucket, the rest mass is tempered as if it were one token (exact only at T = 1)."""
    if temperature == 1.0:
        return logp
    return torch.log_softmax(logp / temperature, dim=-1)


def drop_hardest(mask: torch.Tensor, difficulty: torch.Tensor, fraction: float) -> torch.Tensor:
    """`mask` [N] (bool, or float weights) without the floor(fraction · count) of its positions where
    `difficulty` [N] is highest."""
    inside = mask != 0
    drop = int(fraction * int(inside.sum()))
    if drop == 0:
        return mask
    hardest = torch.where(inside, difficulty.detach(), float("-inf")).topk(drop).indices
    keep = torch.ones_like(inside).index_fill(0, hardest, False)
    return mask & keep if mask.dtype == torch.bool else mask * keep


def mixed_loss(weights: dict[str, float], draft_logp, target_logp, draft_logits, labels, mask,
               jsd_beta: float = 0.5, temperature: float = 1.0, lk_eta: float = 3.0,
               filter_hardest: float = 0.0) -> torch.Tensor:
    """Σ_name weight · loss_name, summed over the masked positions (the caller divides by the
    global token count).

    The divergences see the tempered bucket distributions; CE sees the raw draft logits.
    filter_hardest > 0 leaves out that fraction of the positions, those of largest KL(target ‖ draft):
    tokens the draft cannot fit, whose gradient would pull capacity from the ones it can (after AdaSPEC,
    arXiv 2510.19779, which ranks them by a reference draft's loss instead of the draft's own)."""
    d, t = temper(draft_logp, temperature), temper(target_logp, temperature)
    if filter_hardest > 0:
        mask = drop_hardest(mask, kl_per_token(t.float(), d.float()), filter_hardest)
    total = draft_logp.new_zeros((), dtype=torch.float32)
    for name, weight in weights.items():
        if weight == 0:
            continue
        if name == "ce":
            part, _ = cross_entropy(draft_logits, labels, mask)
        elif name == "jsd":
            part, _ = jsd(d, t, mask, jsd_beta)
        elif name == "lk":
            part, _ = kl_acceptance_blend(d, t, mask, lk_eta)
        else:
            part, _ = DIVERGENCES[name](d, t, mask)
        total = total + weight * part
    return total


# ---------------------------------------------------------------------------------------------
# Building the common support


def full_vocab_buckets(draft_logits: torch.Tensor, target_logits: torch.Tensor):
    """Online teacher, full-vocabulary draft. Logits are sliced to the shared vocabulary
    (models often pad their embedding matrix past the tokenizer's size). Returns log-probs [N, V]."""
    vocab = min(draft_logits.shape[-1], target_logits.shape[-1])
    return (torch.log_softmax(draft_logits[:, :vocab].float(), -1),
            torch.log_softmax(target_logits[:, :vocab].float(), -1))


def subset_buckets(draft_logits: torch.Tensor, target_logits: torch.Tensor, subset_ids: torch.Tensor):
    """Online teacher, subset draft. draft_logits [N, Ns+1] (row Ns = "other"), target_logits
    [N, V_target], subset_ids [Ns] full-vocabulary ids. Returns log-probs [N, Ns+1]: the subset
    tokens and one bucket with the target's mass outside the subset (the draft's "other" row)."""
    target_logp = torch.log_softmax(target_logits.float(), -1)  # [N, V_target]
    inside = target_logp[:, subset_ids]  # [N, Ns]
    outside = torch.logsumexp(target_logp.index_fill(1, subset_ids, float("-inf")), -1, keepdim=True)
    return torch.log_softmax(draft_logits.float(), -1), torch.cat([inside, outside], -1)


def topk_buckets(draft_logits: torch.Tensor, topk_rows: torch.Tensor, topk_logp: torch.Tensor):
    """Cached teacher. draft_logits [N, Vd]; topk_rows [N, K] draft rows of the target's top-K
    tokens (-1 where the token is not a draft output, e.g. outside a subset); topk_logp [N, K]
    the target's log-probs (T = 1). Returns (draft_logp, target_logp), each [N, K+1]; column K is "rest"."""
    draft_logp = torch.log_softmax(draft_logits.float(), -1)  # [N, Vd]
    n, vocab = draft_logp.shape
    valid = topk_rows >= 0
    # An extra column absorbs the invalid entries, so they neither gather nor mask a real row.
    rows = torch.where(valid, topk_rows, vocab)
    padded = torch.cat([draft_logp, draft_logp.new_full((n, 1), _LOG_ZERO)], -1)  # [N, Vd+1]
    draft_top = torch.where(valid, padded.gather(1, rows), float("-inf"))  # [N, K]
    outside = padded.scatter(1, rows, _LOG_ZERO)[:, :vocab]
    draft_rest = torch.logsumexp(outside, -1, keepdim=True)  # [N, 1]

    target_logp = target_topk_buckets(torch.where(valid, topk_logp.float(), float("-inf")))
    return torch.cat([draft_top, draft_rest], -1), target_logp


def target_topk_buckets(topk_logp: torch.Tensor) -> torch.Tensor:
    """The cached teacher's side [N, K+1]: its stored top-K log-probs (-inf where a token has no draft bucket)
    and the "rest" bucket, 1 - Σ top-K."""
    target_top = topk_logp.float()
    # Stored top-K mass can reach or exceed 1 by float error: floor the rest bucket.
    target_rest = torch.log((1 - target_top.exp().sum(-1, keepdim=True)).clamp(min=_REST_FLOOR))
    return torch.cat([target_top, target_rest], -1)
