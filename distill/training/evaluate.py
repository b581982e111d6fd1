"""Held-out evaluation of the draft against the teacher, summed over every rank."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from decode.stats import expected_tau
from distill.losses import acceptance, kl_per_token
from distill.training.teacher import Teacher, draft_logits


@torch.no_grad()
def evaluate(model, teacher: Teacher, batches: Iterable[dict], accelerator, tau_k: int) -> dict:
    """KL, top-1 agreement and α = Σ_v min(draft_probs, target_probs) at T = 1, per token.
    With a cached teacher α sums min() over the stored top-K tokens only: a lower bound on
    the true α (the overlap outside the top-K is unknown; counting the whole "rest" bucket
    would over-count it badly when the tail is heavy). The draft is used as the decoder uses
    it (an old subset draft's "other" row gets probability 0). A spread subset draft's outside
    bucket is dropped too: min() of the bucket totals over-counts the overlap of the V - N
    outside tokens, so α is a lower bound there (exact inside the subset).

    batches: this rank's share of the held-out set, the same number of batches on every rank."""
    model.eval()
    sums = torch.zeros(4, device=accelerator.device)  # [tokens, KL, α, top-1 agreement]
    for batch in batches:
        logits = draft_logits(model, batch, teacher.subset)
        target = teacher.targets(batch)
        draft_logp, target_logp = teacher.buckets(logits, target)
        decode_logp, decode_target_logp = teacher.buckets(teacher.decode_logits(logits), target)
        if target.logits is None or teacher.spread_other:  # drop the "rest" column (lower bound, see docstring)
            decode_logp, decode_target_logp = decode_logp[:, :-1], decode_target_logp[:, :-1]
        ones = torch.ones(logits.shape[0], dtype=torch.bool, device=accelerator.device)
        sums += torch.stack([ones.sum().float(), kl_per_token(target_logp, draft_logp).sum(),
                             acceptance(decode_logp, decode_target_logp, ones)[0],
                             (teacher.draft_top1(logits) == target.top1()).sum().float()])
    model.train()
    sums = accelerator.reduce(sums, "sum")
    n = float(sums[0].clamp(min=1))
    alpha = float(sums[2]) / n
    return {"eval/kl": float(sums[1]) / n, "eval/alpha": alpha, "eval/top1": float(sums[3]) / n,
            f"eval/tau_k{tau_k}": expected_tau(alpha, tau_k), "eval/tokens": int(sums[0])}
