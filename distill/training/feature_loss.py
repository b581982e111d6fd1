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


def acceptance(draft_logp: torch.Tensor, target_logp: torch.Tensor) -> torch.Tensor:
    """[n] Σ over the subset of min(p, q): the chance the draft's sample is accepted at T = 1, with
    target_logp [n, N] the target's full-vocabulary log-probs of the subset tokens and draft_logp [n, N] the
    draft's (tokens outside the subset: q = 0)."""
    return torch.minimum(draft_logp.exp(), target_logp.exp()).sum(-1)


def reach_weights(step_masks: list[torch.Tensor], step_acceptance: list[torch.Tensor]) -> list[torch.Tensor]:
    """[n_j] per step j: the chance a block reaches its step j at each of step j's positions (step_masks[j]
    [B, T]), the product of the acceptance (step_acceptance[m] [n_m], at step_masks[m]) of the same
    block's steps m < j. Step j at position i read the target's features up to i - j, so its block's step
    m sits at i - j + m. A step with no teacher there (a prompt position) counts as accepted."""
    grids = []
    for mask, alpha in zip(step_masks, step_acceptance):
        grid = alpha.new_ones(mask.shape)
        grid[mask] = alpha
        grids.append(grid)
    out = []
    for j, mask in enumerate(step_masks):
        reach = grids[0].new_ones(mask.shape)
        for m in range(j):
            shift = j - m  # step m of the block sits `shift` positions before step j
            reach[:, shift:] *= grids[m][:, :max(mask.shape[1] - shift, 0)]
        out.append(reach[mask])
    return out


def unrolled_loss(dc, step_logits: list[torch.Tensor], target_logp: torch.Tensor, step_rows: list[torch.Tensor],
                  step_masks: list[torch.Tensor]):
    """Σ_j ttt_decay**j · Σ_i w_ij · m_i · divergence(p̂_i, draft_ij), the distill.loss mix of divergences,
    w_ij = 1, or with distill.ttt_reach the chance a block reaches step j at i (reach_weights).

    step_logits[j] [n_j, N]: the draft's logits of step j at its valid positions, step_masks[j] [B, T];
    target_logp [n, N] at every position with a teacher; step_rows[j] [n] bool: which of those are step j's
    (n_j of them). Returns (loss sum, step 0's draft log-probs, step 0's p̂), the latter two for the logged KL."""
    draft_logps = [torch.log_softmax(logits.float(), -1) for logits in step_logits]
    if dc.ttt_reach:
        with torch.no_grad():
            alphas = [acceptance(d, target_logp[rows]) for d, rows in zip(draft_logps, step_rows)]
            reach = reach_weights(step_masks, alphas)
    total = target_logp.new_zeros(())
    for j, (logits, draft_logp, rows) in enumerate(zip(step_logits, draft_logps, step_rows)):
        target_hat, mass = renormalised(target_logp[rows])
        if j == 0:
            first = (draft_logp, target_hat)
        weight = mass * reach[j] if dc.ttt_reach else mass
        # No labels: 'ce' (the one term that reads them) is refused for a feature draft (common/config.py).
        part = mixed_loss(dc.loss, draft_logp, target_hat, logits, None, weight, dc.jsd_beta, dc.kd_temperature,
                          dc.lk_eta, dc.filter_hardest)
        total = total + dc.ttt_decay ** j * part
    return total, *first
