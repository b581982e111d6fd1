"""The token loop over a BatchedRunner (decode/runners/protocol.py): batched sampling and
teacher-forced scoring.

Each row draws its tokens from its own stream of uniforms (`uniforms[b, t]` for step t) through
`common.sampling.sample_rows`, so a completion depends on neither its batch nor its neighbours (up
to float rounding of batched GEMMs, which moves a draw only when a uniform lands within ~1e-9 of a
CDF step).
"""

from __future__ import annotations

import numpy as np
import torch

from common.sampling import ROW_CANDIDATES, SamplingParams, sample_rows
from distill.generation.engine import Completion


# Compact the cache once this fraction of its rows has finished: a compaction copies the filled
# cache (~1 GB at 128 rows x 200 slots for SmolLM2), about the cost of one decode step, while
# every step after it saves the finished fraction of the batch's compute.
COMPACT_DEAD_FRACTION = 0.25
# Scoring computes the LM head for at most this many positions at once
# (2048 x 49152 vocab x 4 B = 400 MB of fp32 logits).
SCORE_HEAD_POSITIONS = 2048


def generate_batch(runner, prompts: list[list[int]], uniforms: torch.Tensor, *, max_new_tokens: int,
                   sampling: SamplingParams, eos_ids: list[int], teacher_topk: int = 0) -> list[Completion]:
    """Sample one completion per prompt. uniforms: [B, max_new_tokens] in [0, 1).

    A runner with hidden_layers (generate.features) also gives each completion the states of its prompt and
    completion tokens (Completion.hidden, bf16 on the CPU): the prefill's and every step's, and one more step
    feeds each row's last token, which sampling alone never feeds."""
    B = len(prompts)
    keep_states = bool(getattr(runner, "hidden_layers", ()))
    logits = prefill_shared(runner, prompts, capacity=max(map(len, prompts)) + max_new_tokens)  # [B, V]
    device = logits.device
    eos = torch.tensor(eos_ids)
    tokens = torch.zeros(B, max_new_tokens, dtype=torch.long)
    lengths = torch.full((B,), max_new_tokens, dtype=torch.long)
    finished_eos = torch.zeros(B, dtype=torch.bool)
    topk_ids = torch.zeros(B, max_new_tokens, teacher_topk, dtype=torch.int32)
    topk_logprobs = torch.zeros(B, max_new_tokens, teacher_topk, dtype=torch.float32)
    states = CompletionStates(runner, prompts, max_new_tokens) if keep_states else None
    # One topk serves the teacher cache and the top-k/top-p candidates (temperature keeps the order).
    candidate_count = max(teacher_topk, ROW_CANDIDATES if sampling.top_k == 0 else sampling.top_k)
    share_candidates = teacher_topk or (not sampling.greedy and sampling.top_p < 1)
    rows = torch.arange(B)  # original row of each cache row
    alive = torch.ones(B, dtype=torch.bool)  # per cache row
    for t in range(max_new_tokens):
        candidates = logits.topk(candidate_count, dim=-1) if share_candidates else None
        if teacher_topk:
            # log_softmax at temperature 1 of the K largest logits: logit - logsumexp(all logits).
            alive_d = alive.to(device)
            values = candidates[0][alive_d, :teacher_topk] - logits.logsumexp(-1, keepdim=True)[alive_d]
            topk_ids[rows[alive], t] = candidates[1][alive_d, :teacher_topk].to(torch.int32).cpu()
            topk_logprobs[rows[alive], t] = values.cpu()  # [b, K]
        next_ids = sample_rows(logits, uniforms[rows, t].to(device), sampling, candidates)  # [cache rows]
        next_cpu = next_ids.cpu()
        tokens[rows[alive], t] = next_cpu[alive]
        sampled = alive.clone()  # the cache rows whose token t is part of their completion
        just_ended = alive & torch.isin(next_cpu, eos)
        lengths[rows[just_ended]] = t + 1
        finished_eos[rows[just_ended]] = True
        alive &= ~just_ended
        last = t == max_new_tokens - 1 or not alive.any()
        if last and states is None:
            break
        # Rows ending now stay one more step when their last token's states are wanted.
        staying = sampled if states is not None else alive
        if not last and (~staying).sum() >= COMPACT_DEAD_FRACTION * len(alive):
            keep = staying.nonzero().squeeze(-1)
            runner.keep(keep.to(device))
            rows, alive, sampled, next_ids = rows[keep], alive[keep], sampled[keep], next_ids[keep.to(device)]
        logits = runner.step(next_ids)
        if states is not None:
            states.add_step(rows[sampled], t, runner.hidden_states[sampled.to(device)])
        if last:
            break
    return [Completion(tokens[b, :n].numpy().astype(np.int32), "eos" if finished_eos[b] else "length",
                       topk_ids[b, :n].numpy() if teacher_topk else None,
                       topk_logprobs[b, :n].numpy() if teacher_topk else None,
                       hidden=states.row(b, n) if states is not None else None)
            for b, n in enumerate(lengths.tolist())]


class CompletionStates:
    """The kept layers' states of each row's prompt (from the prefill) and completion tokens (one per step), bf16
    on the CPU: [tokens, layers, H] per row, as a features file stores them."""

    def __init__(self, runner, prompts: list[list[int]], max_new_tokens: int):
        prefill = runner.hidden_states  # [B, L, layers, H], left-padded
        L = prefill.shape[1]
        self.prompts = [prefill[b, L - len(p):].to("cpu", torch.bfloat16) for b, p in enumerate(prompts)]
        self.completions = torch.zeros((len(prompts), max_new_tokens) + prefill.shape[2:], dtype=torch.bfloat16)

    def add_step(self, rows: torch.Tensor, t: int, hidden: torch.Tensor) -> None:
        """hidden [len(rows), layers, H]: the states of token t of each of `rows` (original row indices)."""
        self.completions[rows, t] = hidden.to("cpu", torch.bfloat16)

    def row(self, b: int, n: int) -> torch.Tensor:
        return torch.cat([self.prompts[b], self.completions[b, :n]])


def prefill_shared(runner, prompts: list[list[int]], capacity: int) -> torch.Tensor:
    """runner.prefill(prompts) with each distinct prompt prefilled once: the samples of one prompt
    (generate.samples_per_prompt > 1 puts them side by side) get copies of its cache rows. Prefill was
    a fifth to a half of a batch's time in the demo's shards on a 2-core AMX Xeon."""
    first: dict[tuple[int, ...], int] = {}
    index = [first.setdefault(tuple(p), len(first)) for p in prompts]  # row -> its prompt's first row
    if len(first) == len(prompts):
        return runner.prefill(prompts, capacity=capacity)
    logits = runner.prefill([list(p) for p in first], capacity=capacity)  # [distinct, V]
    index = torch.tensor(index, device=logits.device)
    runner.keep(index)
    return logits[index]


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
    ids_all, logprobs_all = head_topk(runner.logits, hidden[index_b, index_slot], teacher_topk)
    out, offset = [], 0
    for c in completions:
        out.append((ids_all[offset:offset + len(c)], logprobs_all[offset:offset + len(c)]))
        offset += len(c)
    return out


def head_topk(logits_of, hidden: torch.Tensor, teacher_topk: int) -> tuple[np.ndarray, np.ndarray]:
    """(int32 ids, float32 logprobs) [n, teacher_topk] of the target's distribution at each of the n positions of
    hidden [n, H] (final-normed states), logits_of mapping [m, H] to [m, V]; the head runs over
    SCORE_HEAD_POSITIONS positions at a time."""
    ids_parts, logprob_parts = [], []
    for start in range(0, len(hidden), SCORE_HEAD_POSITIONS):
        logits = logits_of(hidden[start:start + SCORE_HEAD_POSITIONS].contiguous())  # [m, V]
        values, ids = logits.float().log_softmax(-1).topk(teacher_topk, dim=-1)
        ids_parts.append(ids.to(torch.int32).cpu())
        logprob_parts.append(values.cpu())
    if not ids_parts:
        return np.zeros((0, teacher_topk), np.int32), np.zeros((0, teacher_topk), np.float32)
    return torch.cat(ids_parts).numpy(), torch.cat(logprob_parts).numpy()
