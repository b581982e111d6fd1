"""The generation engine seam: plan rows in, completions (+ the teacher's top-k) out.

generate-data asks an engine for whole shards of rows and never sees tokens, caches or batches, so
another engine (vLLM, a server) can stand behind it without reproducing the token-level interface.
The one implementation today is `runner_engine.RunnerEngine`: the project's batched runner and
token loop.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from decode.sampling import SamplingParams
from distill.generation.plan import Row


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


class Engine(Protocol):
    sampler: str
    """What fixes the token each row draws (its random stream and how a draw inverts it); the resume
    fingerprint records it, so a resumed run never mixes rows of two samplers."""

    def generate(self, rows: list[Row], sampling: SamplingParams, max_new_tokens: int, teacher_topk: int,
                 seed: int) -> Iterator[Completion]:
        """One sampled completion per row, in row order. A row's tokens depend only on (seed,
        prompt_id, sample_index) and the model, never on the other rows. teacher_topk > 0 also
        returns the target's top-k before each completion token."""

    def score(self, rows: list[Row], teacher_topk: int) -> Iterator[Completion]:
        """Per row, the target teacher-forced over the row's completion_ids: their top-k, in row order."""
