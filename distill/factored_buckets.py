"""The cached teacher's K + 1 buckets (distill/losses.py, topk_buckets) for a draft with factored outside rows
(decode/vocab.py), without its [positions, V] logits.

Such a draft's distribution covers the whole vocabulary, so each position needs the log-normaliser over all V
logits, and V - N of them are other + z . U_j. Built with autograd over the full logits, a training step of the
demo's draft (8,192-token subset, ~700 positions, V - N = 40,960) took 2.0 s instead of 0.43 s on a 2-core AVX2
EPYC: a dozen [700, 49152] intermediates (115 MB each) and their backward copies. Here the outside logits are
made a chunk of columns at a time, summed, and made again in backward, which needs only the sums: forward
and backward each stream them once through a cache-sized chunk.

Per position, with Z = Σ_j exp(l_j) over all V logits, T the stored top-K columns and R = Z - Σ_{j in T} exp(l_j):
  buckets = [l_t - log Z for t in T] + [log R - log Z]
  d/dl_j  = g_t [j = t] + g_rest exp(l_j) / R [j not in T] - (Σ g) exp(l_j) / Z
R is summed over the columns outside T (masked), never as a difference, so it stays exact when T holds nearly
all the mass.
"""

from __future__ import annotations

import torch

from distill.losses import target_topk_buckets


# Outside columns per chunk: [~700 positions, 4096] fp32 is 11 MB, within a server core's L2/L3 share.
CHUNK = 4096


def factored_topk_buckets(row_logits: torch.Tensor, factors: torch.Tensor, topk_columns: torch.Tensor,
                          topk_logp: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(draft_logp, target_logp), each [P, K + 1] (column K: "rest"), as topk_buckets gives them on the
    full-vocabulary logits. row_logits [P, N + 1 + r]: the draft's N token rows, "other", then z = P h;
    factors U [V - N, r]; topk_columns [P, K]: the target's top-K tokens as columns of [N token rows, V - N
    outside ids] (VocabSubset.full_columns); size: N."""
    draft_logp = _FactoredBuckets.apply(row_logits.float(), factors.float(), topk_columns, size)
    return draft_logp, target_topk_buckets(topk_logp)


def _outside_chunks(row_logits: torch.Tensor, factors: torch.Tensor, size: int, topk_columns: torch.Tensor):
    """(start column, outside logits [P, C], (rows, columns) of the top-K entries in the chunk) a chunk at a time."""
    other, basis = row_logits[:, size:size + 1], row_logits[:, size + 1:]
    for start in range(0, factors.shape[0], CHUNK):
        chunk = factors[start:start + CHUNK]
        yield start, torch.addmm(other, basis, chunk.T), _hits(topk_columns, size + start, chunk.shape[0])


def _hits(topk_columns: torch.Tensor, start: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, columns - start) of the top-K columns in start..start + width - 1."""
    local = topk_columns - start
    hit = (local >= 0) & (local < width)
    return hit.nonzero()[:, 0], local[hit]


def _log_sums(row_logits, factors, topk_columns, size):
    """(log Z, log R) [P]: every logit's exp summed, and those outside the top-K columns'. One exp per logit:
    each block's exps are summed, the top-K entries zeroed, and summed again (the rest never a difference)."""
    blocks = [(row_logits[:, :size], _hits(topk_columns, 0, size))]
    blocks += [(logits, hits) for _, logits, hits in _outside_chunks(row_logits, factors, size, topk_columns)]
    maxima, sums_all, sums_rest = [], [], []
    for logits, (rows, columns) in blocks:
        peak = logits.amax(-1, keepdim=True)
        exps = (logits - peak).exp_()
        sums_all.append(exps.sum(-1))
        exps[rows, columns] = 0
        sums_rest.append(exps.sum(-1))
        maxima.append(peak[:, 0])
    peaks = torch.stack(maxima)  # [blocks, P]
    top = peaks.amax(0)
    scale = (peaks - top).exp()
    log_z = top + ((scale * torch.stack(sums_all)).sum(0)).log()
    # A rest of exactly 0 (all mass in the top-K, to fp32) is floored as topk_buckets' -1e30 stand-in is.
    log_rest = top + ((scale * torch.stack(sums_rest)).sum(0)).clamp(min=1e-30).log()
    return log_z, log_rest


def _top_logits(row_logits, factors, topk_columns, size):
    """The logits at the top-K columns [P, K]: token rows read directly, outside ones as other + z . U_j."""
    inside = row_logits[:, :size].gather(1, topk_columns.clamp(max=size - 1))
    outside_index = (topk_columns - size).clamp(min=0)
    basis = row_logits[:, size + 1:]
    outside = row_logits[:, size:size + 1] + torch.einsum("pr,pkr->pk", basis, factors[outside_index])
    return torch.where(topk_columns < size, inside, outside)


class _FactoredBuckets(torch.autograd.Function):
    @staticmethod
    def forward(ctx, row_logits, factors, topk_columns, size):
        log_z, log_rest = _log_sums(row_logits, factors, topk_columns, size)
        top = _top_logits(row_logits, factors, topk_columns, size)
        ctx.save_for_backward(row_logits, factors, topk_columns, log_z, log_rest)
        ctx.size = size
        return torch.cat([top - log_z[:, None], (log_rest - log_z)[:, None]], -1)

    @staticmethod
    def backward(ctx, grad):
        row_logits, factors, topk_columns, log_z, log_rest = ctx.saved_tensors
        size = ctx.size
        grad_top, grad_rest = grad[:, :-1], grad[:, -1]
        total = grad.sum(-1)
        # Off the top-K: d/dl_j = exp(l_j - log Z) * (g_rest Z / R - Σ g); on it: exp(l_j - log Z) * (-Σ g) + g_t.
        off_top = (grad_rest * (log_z - log_rest).exp() - total)[:, None]
        log_z = log_z[:, None]

        def logit_grads(logits, rows, columns):
            """d loss / d logits of a block of columns, but for the top-K entries' own g_t (added below)."""
            on_top = -total[rows] * (logits[rows, columns] - log_z[rows, 0]).exp()
            grads = (logits - log_z).exp_().mul_(off_top)
            grads[rows, columns] = on_top
            return grads

        grad_rows = torch.zeros_like(row_logits)
        grad_rows[:, :size] = logit_grads(row_logits[:, :size], *_hits(topk_columns, 0, size))
        grad_factors = torch.zeros_like(factors)
        basis = row_logits[:, size + 1:]
        for start, logits, hits in _outside_chunks(row_logits, factors, size, topk_columns):
            grad_logits = logit_grads(logits, *hits)  # [P, C]
            chunk = factors[start:start + grad_logits.shape[1]]
            grad_rows[:, size] += grad_logits.sum(-1)  # "other" is in every outside logit
            # Both products as [r, *] = [r, .] @ [., *]: MKL ran grad_logits.T @ basis 7x slower on 2 AVX2 cores
            # (15 vs 2.2 ms at P = 700, C = 4096, r = 8).
            grad_rows[:, size + 1:] += (chunk.T @ grad_logits.T).T
            grad_factors[start:start + grad_logits.shape[1]] = (basis.T @ grad_logits).T
        # The top-K columns' own terms: each g_t once, at its column.
        inside_hit = topk_columns < size
        grad_rows[:, :size].scatter_add_(1, topk_columns.clamp(max=size - 1), torch.where(inside_hit, grad_top, 0.0))
        outside_grad = torch.where(inside_hit, 0.0, grad_top)  # [P, K]
        outside_index = (topk_columns - size).clamp(min=0)
        grad_rows[:, size] += outside_grad.sum(-1)
        grad_rows[:, size + 1:] += torch.einsum("pk,pkr->pr", outside_grad, factors[outside_index])
        per_entry = (outside_grad[:, :, None] * basis[:, None, :]).flatten(0, 1)  # [P K, r]
        grad_factors.index_add_(0, outside_index.flatten(), per_entry)
        return grad_rows, grad_factors, None, None
