"""The project's generation engine: a BatchedRunner (decode/runners) driven by the batched token loop.

Reproducibility: every (prompt_id, sample_index) owns a stream of uniforms seeded by a hash, and
step t's token is `common.sampling.sample_rows` at that row's uniform t. A prompt's completion
therefore depends on neither its batch, its neighbours nor its rank.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from common.sampling import SamplingParams
from decode.runners.protocol import BatchedRunner
from distill.generation.batched_loop import generate_batch, score_batch
from distill.generation.engine import Completion, row_seed
from distill.generation.plan import Row


# The row streams (row_uniforms) and common.sampling's inverse CDF: u ~ U[0, 1), the first token
# whose cumulative probability exceeds u * total. Version 1 (plan.json without a "sampler" field)
# drew 1 - u and took the first token reaching it: other tokens for the same seed, so a resume of
# such a run is refused.
SAMPLER = "runner-inverse-cdf-v2"


def row_uniforms(seed: int, prompt_id: str, sample_index: int, n: int) -> torch.Tensor:
    """n uniforms in [0, 1) owned by one (prompt, sample): fp64 [n]."""
    generator = torch.Generator().manual_seed(row_seed(seed, prompt_id, sample_index))
    return torch.rand(n, generator=generator, dtype=torch.float64)


def batches(rows: list[Row], batch_size: int, max_batch_tokens: int, new_tokens: int) -> Iterator[list[Row]]:
    """Consecutive rows (sorted by length) in batches of <= batch_size rows and <= max_batch_tokens
    cache slots (rows x longest sequence), which bounds KV-cache memory."""
    batch: list[Row] = []
    for row in rows:
        longest = len(row.prompt.token_ids) + len(row.completion_ids) + new_tokens
        if batch and (len(batch) == batch_size or (len(batch) + 1) * longest > max_batch_tokens):
            yield batch
            batch = []
        batch.append(row)
    if batch:
        yield batch


class RunnerEngine:
    """`Engine` over one BatchedRunner; yields each batch's completions as soon as the batch is done."""

    sampler = SAMPLER

    def __init__(self, runner: BatchedRunner, eos_ids: list[int], batch_size: int, max_batch_tokens: int):
        self.runner = runner
        self.eos_ids = eos_ids
        self.batch_size = batch_size
        self.max_batch_tokens = max_batch_tokens

    def generate(self, rows: list[Row], sampling: SamplingParams, max_new_tokens: int, teacher_topk: int,
                 seed: int) -> Iterator[list[Completion]]:
        for batch in batches(rows, self.batch_size, self.max_batch_tokens, max_new_tokens):
            uniforms = torch.stack([row_uniforms(seed, r.prompt.prompt_id, r.sample_index, max_new_tokens)
                                    for r in batch])  # [B, max_new_tokens]
            yield generate_batch(self.runner, [list(r.prompt.token_ids) for r in batch], uniforms,
                                      max_new_tokens=max_new_tokens, sampling=sampling, eos_ids=self.eos_ids,
                                      teacher_topk=teacher_topk)

    def score(self, rows: list[Row], teacher_topk: int) -> Iterator[list[Completion]]:
        for batch in batches(rows, self.batch_size, self.max_batch_tokens, 0):
            completions = [list(r.completion_ids) for r in batch]
            scored = score_batch(self.runner, [list(r.prompt.token_ids) for r in batch], completions, teacher_topk)
            yield [Completion(np.asarray(c, dtype=np.int32), "eos" if c and c[-1] in self.eos_ids else "length",
                              topk_ids, topk_logprobs) for c, (topk_ids, topk_logprobs) in zip(completions, scored)]
