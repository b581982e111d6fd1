"""Batched sampling and teacher-forced scoring on top of a batched runner (gen_llama / gen_hf).

Reproducibility: every (prompt_id, sample_index) owns a stream of uniforms seeded by a hash,
and each token is drawn by inverting the CDF of `decode.sampling.warp_probs`' distribution at
that row's uniform for that step. A prompt's completion therefore depends on neither its batch, its
neighbours nor its rank (up to float rounding of batched GEMMs, which moves a draw only when a
uniform lands within ~1e-6 of a CDF step).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch


# Compact the cache once this fraction of its rows has finished: a compaction copies the filled
# cache (~1 GB at 128 rows x 200 slots for SmolLM2), about the cost of one decode step, while
# every step after it saves the finished fraction of the batch's compute.
COMPACT_DEAD_FRACTION = 0.25
# Top-p candidates sorted per row; at T=0.7, top-p 0.95 SmolLM2's nucleus rarely exceeds ~100 tokens.
NUCLEUS_CANDIDATES = 512
# Scoring computes the LM head for at most this many positions at once
# (2048 x 49152 vocab x 4 B = 400 MB of fp32 logits).
SCORE_HEAD_POSITIONS = 2048


@dataclass
class Completion:
    completion_ids: np.ndarray
    """int32 [n], EOS included when finish_reason is 'eos'."""
    finish_reason: str
    """'eos' or 'length'."""
    topk_ids: np.ndarray | None = None
    """int32 [n, K]: the target's K most likely tokens before each completion token."""
    topk_logprobs: np.ndarray | None = None
    """float32 [n, K]: their log-probabilities at temperature 1 (log_softmax of raw logits)."""


def row_uniforms(seed: int, prompt_id: str, sample_index: int, n: int) -> torch.Tensor:
    """n uniforms in (0, 1] owned by one (prompt, sample); 1 - U[0,1) never gives 0."""
    digest = hashlib.sha256(f"{seed}:{prompt_id}:{sample_index}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    return 1.0 - torch.rand(n, generator=generator, dtype=torch.float64)


def draw(logits: torch.Tensor, uniforms: torch.Tensor, temperature: float, top_k: int,
         top_p: float, candidates: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """One token per row of logits [B, V] from warp_probs' distribution, at uniforms [B] -> ids [B].

    Inverse CDF in vocabulary order over the kept tokens, accumulated in fp64: a rounding-level
    change of the logits (another batch, another rank) then moves a draw only when the uniform
    lands within ~1e-9 of a CDF step. (Descending-probability order would not do: near-ties
    reorder under rounding noise.)
    warp_probs sorts all 49k logits per row for top-p (30% of a batch-128 decode step on this
    CPU); the nucleus at T=0.7, top-p 0.95 almost always lies within the top NUCLEUS_CANDIDATES,
    so only those are found (topk), and a row whose candidates hold less than top_p of the mass is
    fully sorted. Same distribution as warp_probs (tests compare them). `candidates` =
    logits.topk(C) when the caller has it (the teacher top-k shares it: temperature keeps the order).
    """
    if temperature == 0:
        return logits.argmax(-1)
    scaled = logits.float() / temperature  # [B, V]
    V = scaled.shape[-1]
    if top_k == 0 and top_p >= 1.0:  # plain temperature sampling over every token
        return _inverse_cdf(scaled.softmax(-1), uniforms, None)
    count = min(V, top_k if top_k > 0 else NUCLEUS_CANDIDATES)
    if candidates is None or candidates[0].shape[-1] < count:
        candidates = logits.topk(count, dim=-1)
    values, ids = candidates[0][:, :count].float() / temperature, candidates[1][:, :count]  # [B, C], descending
    # Probabilities under warp_probs: renormalised over the top-k set when top-k is on.
    log_norm = (values if top_k > 0 else scaled).logsumexp(-1, keepdim=True)
    probs = (values - log_norm).exp()  # [B, C]
    if top_p >= 1.0:
        return _inverse_cdf_by_id(probs, ids, uniforms)
    short = probs.sum(-1) < top_p  # the nucleus may extend past the candidates
    out = _inverse_cdf_by_id(_nucleus(probs, top_p), ids, uniforms)
    if short.any():
        values_full, ids_full = scaled[short].sort(dim=-1, descending=True)
        kept = _nucleus((values_full - log_norm[short]).exp(), top_p)
        out[short] = _inverse_cdf_by_id(kept, ids_full, uniforms[short])
    return out


def _nucleus(sorted_probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero the tokens whose preceding mass already reaches top_p (warp_probs' rule)."""
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    return sorted_probs.masked_fill(mass_before >= top_p, 0.0)


def _inverse_cdf_by_id(weights: torch.Tensor, ids: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """weights [B, C] of token ids [B, C] -> inverse CDF with the tokens in id order."""
    ids_in_order, order = ids.sort(dim=-1)
    return ids_in_order.gather(-1, _inverse_cdf(weights.gather(-1, order), uniforms, None)[:, None]).squeeze(-1)


def _inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor, ids: torch.Tensor | None) -> torch.Tensor:
    """weights [B, C] (unnormalised), uniforms [B] in (0, 1] -> the chosen column (or its id) [B]."""
    cdf = weights.double().cumsum(-1)
    # The first column whose CDF reaches u * total has positive weight (u > 0).
    target = (uniforms.to(cdf) * cdf[:, -1])[:, None]
    column = torch.searchsorted(cdf, target).clamp(max=cdf.shape[-1] - 1)  # [B, 1]
    return (column if ids is None else ids.gather(-1, column)).squeeze(-1)


def generate_batch(runner, prompts: list[list[int]], uniforms: torch.Tensor, *, max_new_tokens: int,
                   temperature: float, top_k: int, top_p: float, eos_ids: list[int],
                   teacher_topk: int = 0) -> list[Completion]:
    """Sample one completion per prompt. uniforms: [B, max_new_tokens]."""
    B = len(prompts)
    logits = runner.prefill(prompts, capacity=max(map(len, prompts)) + max_new_tokens)  # [B, V]
    device = logits.device
    eos = torch.tensor(eos_ids)
    tokens = torch.zeros(B, max_new_tokens, dtype=torch.long)
    lengths = torch.full((B,), max_new_tokens, dtype=torch.long)
    finished_eos = torch.zeros(B, dtype=torch.bool)
    if teacher_topk:
        topk_ids = torch.zeros(B, max_new_tokens, teacher_topk, dtype=torch.int32)
        topk_logprobs = torch.zeros(B, max_new_tokens, teacher_topk, dtype=torch.float32)
    rows = torch.arange(B)  # original row of each cache row
    alive = torch.ones(B, dtype=torch.bool)  # per cache row
    for t in range(max_new_tokens):
        candidates = logits.topk(max(teacher_topk, NUCLEUS_CANDIDATES if top_k == 0 else top_k), dim=-1) if (
            teacher_topk or (temperature > 0 and top_p < 1)) else None
        if teacher_topk:
            # log_softmax at temperature 1 of the K largest logits: logit - logsumexp(all logits).
            alive_d = alive.to(device)
            values = candidates[0][alive_d, :teacher_topk] - logits[alive_d].logsumexp(-1, keepdim=True)
            topk_ids[rows[alive], t] = candidates[1][alive_d, :teacher_topk].to(torch.int32).cpu()
            topk_logprobs[rows[alive], t] = values.cpu()  # [b, K]
        next_ids = draw(logits, uniforms[rows, t].to(device), temperature, top_k, top_p, candidates)  # [cache rows]
        next_cpu = next_ids.cpu()
        tokens[rows[alive], t] = next_cpu[alive]
        just_ended = alive & torch.isin(next_cpu, eos)
        lengths[rows[just_ended]] = t + 1
        finished_eos[rows[just_ended]] = True
        alive &= ~just_ended
        if t == max_new_tokens - 1 or not alive.any():
            break
        if (~alive).sum() >= COMPACT_DEAD_FRACTION * len(alive):
            keep = alive.nonzero().squeeze(-1)
            runner.keep(keep.to(device))
            rows, alive, next_ids = rows[keep], alive[keep], next_ids[keep.to(device)]
        logits = runner.step(next_ids)
    out = []
    for b in range(B):
        n = int(lengths[b])
        completion = Completion(tokens[b, :n].numpy().astype(np.int32), "eos" if finished_eos[b] else "length")
        if teacher_topk:
            completion.topk_ids = topk_ids[b, :n].numpy()
            completion.topk_logprobs = topk_logprobs[b, :n].numpy()
        out.append(completion)
    return out


def score_batch(runner, prompts: list[list[int]], completions: list[list[int]],
                teacher_topk: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Teacher-forced target over prompt + completion -> per completion token (topk ids, logprobs)."""
    sequences = [p + c for p, c in zip(prompts, completions)]
    L = max(map(len, sequences))
    hidden = runner.prefill(sequences, capacity=L, all_hidden=True)  # [B, L, H], left-padded
    # Completion token j of row b sits at slot pad + len(prompt) + j and is predicted from the slot before.
    where = [(b, L - len(s) + len(p) - 1 + j) for b, (s, p, c) in enumerate(zip(sequences, prompts, completions))
             for j in range(len(c))]
    index_b = torch.tensor([b for b, _ in where], dtype=torch.long)
    index_slot = torch.tensor([s for _, s in where], dtype=torch.long)
    ids_parts, logprob_parts = [], []
    for start in range(0, len(where), SCORE_HEAD_POSITIONS):
        chunk = slice(start, start + SCORE_HEAD_POSITIONS)
        logits = runner.logits(hidden[index_b[chunk], index_slot[chunk]])  # [n, V]
        values, ids = logits.log_softmax(-1).topk(teacher_topk, dim=-1)
        ids_parts.append(ids.to(torch.int32).cpu())
        logprob_parts.append(values.cpu())
    ids_all = torch.cat(ids_parts).numpy() if ids_parts else np.zeros((0, teacher_topk), np.int32)
    logprobs_all = torch.cat(logprob_parts).numpy() if logprob_parts else np.zeros((0, teacher_topk), np.float32)
    out, offset = [], 0
    for c in completions:
        out.append((ids_all[offset:offset + len(c)], logprobs_all[offset:offset + len(c)]))
        offset += len(c)
    return out
