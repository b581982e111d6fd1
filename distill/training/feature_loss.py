"""The feature draft's training loss over its unrolled steps.

The draft's head covers only its N subset tokens, so its distribution lives on the subset while the
target's spreads over the whole vocabulary. At each position the target is renormalised over the
subset (p̂ = p / m, m = the target's mass inside the subset, as EAGLE-3 does) and the divergence
between p̂ and the draft is weighted by m. Both choices keep the same optimum (the draft = p̂, whose
acceptance Σ min(p, p̂) = m is the most any subset draft can get there); the weight makes each
position count as much as it can add to acceptance: a position whose target mass lies mostly outside
the subset (a rare token) can add at most m, so its divergence is scaled down instead of pulling the
draft as hard as a position it can actually win.
"""

from __future__ import annotations

import torch

from distill.losses import mixed_loss


def renormalised(target_logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """target_logp [n, N] (sums to the in-subset mass) -> (log p̂ [n, N] summing to 1, mass m [n])."""
    log_mass = torch.logsumexp(target_logp, -1, keepdim=True)
    return target_logp - log_mass, log_mass[:, 0].exp()


def unrolled_loss(dc, step_logits: list[torch.Tensor], target_logp: torch.Tensor, step_rows: list[torch.Tensor]):
    """Σ_j ttt_decay**j · Σ_i m_i · divergence(p̂_i, draft_ij), the distill.loss mix of divergences.

    step_logits[j] [n_j, N]: the draft's logits of step j at its valid positions; target_logp [n, N] at
    every position with a teacher; step_rows[j] [n] bool: which of those are step j's (n_j of them).
    Returns (loss sum, step 0's draft log-probs, step 0's p̂), the latter two for the logged KL."""
    total = target_logp.new_zeros(())
    for j, (logits, rows) in enumerate(zip(step_logits, step_rows)):
        target_hat, mass = renormalised(target_logp[rows])
        draft_logp = torch.log_softmax(logits.float(), -1)
        if j == 0:
            first = (draft_logp, target_hat)
        # No labels: 'ce' (the one term that reads them) is refused for a feature draft (common/config.py).
        part = mixed_loss(dc.loss, draft_logp, target_hat, logits, None, mass, dc.jsd_beta, dc.kd_temperature,
                          dc.lk_eta, dc.filter_hardest)
        total = total + dc.ttt_decay ** j * part
    return total, *first
