"""How close another engine's teacher data are to the project engine's: a shard folder's stored
top-K logprobs against the project engine teacher-forced over the same prompts and completions.

Per completion token: KL(stored || project) over the stored top-K ids (both renormalised over
those ids, so it measures the distribution a cached-teacher loss sees) and whether both engines
rank the same token first. scripts/check_vllm_equivalence.py prints them for a folder;
tests/test_vllm_engine.py holds the vLLM engine to them.
"""

from __future__ import annotations

import numpy as np
import torch

# What vLLM in bf16 may differ from the project engine's bf16 GEMMs by, per completion token. The
# first smoke run (16 demo prompts, 505 tokens) measured mean KL 8e-4 and 97% top-1 agreement.
BF16_MAX_MEAN_KL = 0.01
BF16_MIN_TOP1_AGREEMENT = 0.93


def project_scores(runner, prompts: list[list[int]], completions: list[list[int]],
                   ids: list[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
    """The project engine's batched runner teacher-forced over each prompt + completion, one batch
    -> per row, its logprobs at `ids` (int [n, K], the other engine's top-K) as float32 [n, K] and
    its own top-1 ids [n]."""
    sequences = [list(p) + list(c) for p, c in zip(prompts, completions)]
    L = max(map(len, sequences))
    hidden = runner.prefill(sequences, capacity=L, all_hidden=True)  # [B, L, H], left-padded
    out = []
    for b, (sequence, prompt) in enumerate(zip(sequences, prompts)):
        # Completion token j sits at pad + len(prompt) + j and is predicted from the slot before it.
        first = L - len(sequence) + len(prompt) - 1
        logprobs = runner.logits(hidden[b, first:L - 1]).float().log_softmax(-1).cpu()  # [n, V]
        out.append((logprobs.gather(-1, torch.from_numpy(np.asarray(ids[b], dtype=np.int64))).numpy(),
                    logprobs.argmax(-1).numpy()))
    return out


def compare_topk(stored_ids: np.ndarray, stored_logprobs: np.ndarray, project_at_ids: np.ndarray,
                 project_top1: np.ndarray) -> dict:
    """Stored top-K (ids and logprobs, [n, K]) against the project engine's logprobs at those ids
    [n, K] and its top-1 [n], over n completion tokens -> mean KL (nats per token), top-1 agreement,
    mean |difference| of the top-1 logprob, and n."""
    stored = torch.from_numpy(np.ascontiguousarray(stored_logprobs, dtype=np.float64))
    project = torch.from_numpy(np.ascontiguousarray(project_at_ids, dtype=np.float64))
    p_log, q_log = stored.log_softmax(-1), project.log_softmax(-1)
    kl = (p_log.exp() * (p_log - q_log)).sum(-1)
    return {"mean_kl": float(kl.mean()),
            "top1_agreement": float(np.mean(np.asarray(stored_ids)[:, 0] == np.asarray(project_top1))),
            "mean_abs_top1_logprob_diff": float((stored[:, 0] - project[:, 0]).abs().mean()),
            "tokens": len(stored)}


def compare_rows(runner, rows: list[dict], batch_size: int = 8) -> dict:
    """compare_topk over every completion token of shard rows (dicts with prompt_ids,
    completion_ids, teacher_topk_ids, teacher_topk_logprobs)."""
    parts = []
    with torch.inference_mode():
        for start in range(0, len(rows), batch_size):
            batch = rows[start:start + batch_size]
            ids = [np.asarray(r["teacher_topk_ids"], dtype=np.int64) for r in batch]
            scores = project_scores(runner, [r["prompt_ids"] for r in batch], [r["completion_ids"] for r in batch], ids)
            parts += [(i, np.asarray(r["teacher_topk_logprobs"], dtype=np.float32), at_ids, top1)
                      for i, r, (at_ids, top1) in zip(ids, batch, scores)]
    return compare_topk(*(np.concatenate(column) for column in zip(*parts)))
