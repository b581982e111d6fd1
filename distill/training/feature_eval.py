"""Held-out evaluation of a feature draft, per unrolled step, summed over every rank.

α_j = Σ_v min(target_probs, draft_probs) at T = 1 over the positions step j is valid at (i >= j),
with the target's full-vocabulary distribution (the draft gives 0 outside its subset): the exact
expected acceptance of a token proposed at step j of a block. In the data the j tokens before it
are the target's own samples, which is what they are after the draft's proposals were accepted, so
α_j is the acceptance of proposal j + 1 given the first j were accepted, and
τ(k) = 1 + α_0 + α_0·α_1 + ... + α_0···α_{k-1} estimates the tokens per target forward at k.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from distill.losses import acceptance, kl_per_token
from distill.training.feature_loss import renormalised
from distill.training.feature_teacher import FeatureTeacher, step_masks


def tau_from_step_alphas(alphas: list[float], k: int) -> float:
    """1 + Σ_{m=1..k} Π_{j<m} α_j (the last α repeats when k exceeds the steps measured)."""
    tau, accepted = 1.0, 1.0
    for j in range(k):
        accepted *= alphas[min(j, len(alphas) - 1)]
        tau += accepted
    return tau


@torch.no_grad()
def evaluate_feature(model, teacher: FeatureTeacher, batches: Iterable[dict], accelerator, steps: int,
                     tau_k: int) -> dict:
    """eval/alpha_step{j} for j < steps, eval/alpha (= step 0's, comparable with a standalone draft's
    teacher-forced α), step 0's KL(p̂ ‖ draft) (p̂: the target renormalised over the subset) and top-1
    agreement, and eval/tau_k{tau_k}.

    batches: this rank's share of the held-out set, the same number of batches on every rank."""
    model.eval()
    sums = torch.zeros(2 * steps + 2, device=accelerator.device)  # [tokens_j..., α_j sums..., KL_0, top1_0]
    for batch in batches:
        features = teacher(batch)
        masks = step_masks(features.positions, steps)
        step_logits = model(features.hidden, features.embeds, masks)
        for j, (mask, logits) in enumerate(zip(masks, step_logits)):
            rows = mask[features.positions]
            draft_logp = torch.log_softmax(logits.float(), -1)
            target_logp = features.target_logp[rows]
            sums[j] += rows.sum()
            every = torch.ones(target_logp.shape[0], dtype=torch.bool, device=target_logp.device)
            sums[steps + j] += acceptance(draft_logp, target_logp, every)[0]
            if j == 0:
                sums[2 * steps] += kl_per_token(renormalised(target_logp)[0], draft_logp).sum()
                draft_top1 = teacher.subset_ids[logits.argmax(-1)]
                sums[2 * steps + 1] += (draft_top1 == features.target_top1).sum()
    model.train()
    sums = accelerator.reduce(sums, "sum")
    tokens = sums[:steps].clamp(min=1)
    alphas = (sums[steps:2 * steps] / tokens).tolist()
    metrics = {"eval/kl": float(sums[2 * steps] / tokens[0]), "eval/alpha": alphas[0],
               "eval/top1": float(sums[2 * steps + 1] / tokens[0])}
    metrics.update({f"eval/alpha_step{j}": a for j, a in enumerate(alphas)})
    metrics.update({f"eval/tau_k{tau_k}": tau_from_step_alphas(alphas, tau_k), "eval/tokens": int(sums[0])})
    return metrics
