"""Scored pairs and a feature draft's stored states from one forward (score mode with generate.features).

A feature draft trained with the stored teacher needs two passes of the target over scored text: the scoring
forward (its top-k per response token, in the shards) and `make features` (the hidden states of the layers
the draft reads). Both run the same teacher-forced decoder over the same rows. With generate.features the
scoring forward is the features forward (feature_store.teacher_forced_hidden: the decoder alone, right-padded,
at most distill.feature_batch_tokens positions a forward, longest rows first) keeping the draft's layers and
the last one; the head runs over the response positions only, and generate-data writes each shard's features
file beside it, as `make features` would have. The target runs as `make features` runs it (distill.precision),
so the stored states are those of `make features` and of the online teacher.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from common.config import Config, ConfigError
from common.precision import resolve_dtype
from common.progress import BatchProgress
from distill.feature_store import FeatureSpec, check_folder, forward_batches, is_current, teacher_forced_hidden, \
    write_features
from distill.generation.batched_loop import head_topk
from distill.generation.engine import Completion
from distill.generation.plan import Row
from distill.generation.runner_engine import SAMPLER
from distill.generation.shards import sha256_file, shard_name


class FeatureScoringEngine:
    """The score half of `Engine` whose completions also carry each row's stored states (Completion.hidden)."""

    # Score mode draws nothing, so the fingerprint names the runner's sampler: a folder scored without
    # features resumes with them (its earlier shards get theirs from fill_missing).
    sampler = SAMPLER

    def __init__(self, target, layers: list[int], eos_ids: list[int], batch_size: int, max_tokens: int, device):
        self.target = target
        self.layers = list(layers)
        self.last = target.config.num_hidden_layers - 1  # after the final norm: the head's input
        self.eos_ids = set(eos_ids)
        self.batch_size = batch_size
        self.max_tokens = max_tokens
        self.device = device

    def score(self, rows: list[Row], teacher_topk: int) -> Iterator[list[Completion]]:
        """Windows of generate.batch_size rows in row order; within one, forwards longest rows first."""
        for start in range(0, len(rows), self.batch_size):
            yield self.score_window(rows[start:start + self.batch_size], teacher_topk)

    @torch.no_grad()
    def score_window(self, rows: list[Row], teacher_topk: int) -> list[Completion]:
        prompts = [list(r.prompt.token_ids) for r in rows]
        responses = [list(r.completion_ids) for r in rows]
        sequences = [p + c for p, c in zip(prompts, responses)]
        out: list[Completion | None] = [None] * len(rows)
        for chosen in forward_batches([len(s) for s in sequences], self.batch_size, self.max_tokens):
            hidden = teacher_forced_hidden(self.target, [sequences[r] for r in chosen], self.layers + [self.last],
                                           self.device)  # [b, longest, L + 1, H], right-padded
            # Response token j of row r is predicted from the position before it: len(prompt) - 1 + j.
            final = torch.cat([hidden[b, len(prompts[r]) - 1:len(sequences[r]) - 1, -1] for b, r in enumerate(chosen)])
            ids, logprobs = head_topk(self.target.lm_head, final, teacher_topk)
            stored = hidden[:, :, :-1].to("cpu", torch.bfloat16)
            offset = 0
            for b, r in enumerate(chosen):
                n = len(responses[r])
                out[r] = Completion(np.asarray(responses[r], dtype=np.int32),
                                    "eos" if n and responses[r][-1] in self.eos_ids else "length",
                                    ids[offset:offset + n], logprobs[offset:offset + n],
                                    hidden=stored[b, :len(sequences[r])].clone())
                offset += n
        return out


def features_spec(config: Config, device: torch.device, generate_dtype: str) -> FeatureSpec:
    """The spec generate.features writes under generate.out_dir, checked before any model loads: the same
    dtype as `make features` and the online teacher run the target in, and a folder of no other spec."""
    features_precision = resolve_dtype(config.distill.precision, device, "distill.precision")
    if features_precision.name != generate_dtype:
        raise ConfigError(f"generate.features: the scoring forward gives the stored states, so it runs the target as "
                          f"`make features` does, in distill.precision ({features_precision.name}); generate.dtype "
                          f"resolves to {generate_dtype}: set both to the same dtype")
    spec = FeatureSpec.of(config)
    check_folder(config.generate.out_dir, spec)
    return spec


def fill_missing(load_target, spec: FeatureSpec, out_dir: Path, owned_rows: dict[int, int], batch: tuple[int, int],
                 device) -> int:
    """Features files for this rank's shards already on disk without a current one (a folder made before
    generate.features, or a run killed between a shard and its features): `make features`' pass over them.
    load_target() gives the target, called only when a file is missing. owned_rows: {shard
    index: planned rows}. Returns how many were written."""
    todo = {}
    for i, rows in owned_rows.items():
        path = out_dir / shard_name(i)
        if path.is_file():
            digest = (sha256_file(path), rows)
            if not is_current(path, digest):
                todo[path] = digest
    if todo:
        target = load_target()
        progress = BatchProgress("features of earlier shards", sum(r for _, r in todo.values()), "rows")
        for path, digest in todo.items():
            write_features(target, path, digest, spec.layers, batch, device, progress)
        progress.close()
    return len(todo)

