"""The generation engine seam: plan rows in, completions (+ the teacher's top-k) out.

generate-data hands an engine every row it has to do, in shard order, and writes each shard as its
rows come back; it never sees tokens, caches or batches, so another engine (vLLM, a server) can
stand behind it without reproducing the token-level interface.
Two implementations: `runner_engine.RunnerEngine` (the project's batched runner and token loop) and
`vllm_engine.VllmEngine` (vLLM in its own environment, behind a worker process); score mode with
generate.features uses `feature_scoring.FeatureScoringEngine`, which also returns the stored states of a
feature draft (in generate mode the RunnerEngine's runner keeps them as it samples).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from common.sampling import SamplingParams
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
    hidden: torch.Tensor | None = None
    """bf16 [prompt + completion tokens, L, H]: the states a feature draft reads (generate.features: the
    scoring forward's, feature_scoring.py, or the sampling runner's, batched_loop.py), written to the shard's
    features file."""


class Engine(Protocol):
    sampler: str
    """What fixes the token each row draws (its random stream and how a draw inverts it); the resume
    fingerprint records it, so a resumed run never mixes rows of two samplers."""

    def generate(self, rows: list[Row], sampling: SamplingParams, max_new_tokens: int, teacher_topk: int,
                 seed: int) -> Iterator[list[Completion]]:
        """One sampled completion per row, in row order, a list per finished batch (progress moves by them). A row's tokens depend only on (seed,
        prompt_id, sample_index) and the model, never on the other rows. teacher_topk > 0 also
        returns the target's top-k before each completion token."""

    def score(self, rows: list[Row], teacher_topk: int) -> Iterator[list[Completion]]:
        """Per row, the target teacher-forced over the row's completion_ids: their top-k, in row order,
        a list per finished batch."""


def row_seed(seed: int, prompt_id: str, sample_index: int) -> int:
    """The 63-bit seed of one (prompt, sample)'s random stream: every engine draws a row's tokens
    from its own stream, so a completion depends on neither its batch nor its neighbours."""
    digest = hashlib.sha256(f"{seed}:{prompt_id}:{sample_index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def eos_ids(tokenizer, generation) -> list[int]:
    """Every id that ends a completion: the tokenizer's EOS and the target's generation config ones."""
    configured = generation.eos_token_id
    configured = [] if configured is None else [configured] if isinstance(configured, int) else list(configured)
    return sorted(({tokenizer.eos_token_id} | set(configured)) - {None})
