"""On-policy data for a feature draft (generate.rollout_draft naming one): the draft writes each completion as
it drafts in the decoder, and the target reads it block by block.

A round, for every live row of a batch: the feature draft proposes generate.rollout_k tokens at
generate.temperature from the target's states of the text so far and its own outputs past them
(decode/drafts/feature/ragged.py, one batched draft forward per position: the decoder's drafting); one batched
target forward reads [last token, guesses...] (decode/runners/ragged.py: the decoder's verification forward)
and gives at each of those positions the target's top-k (the label of the token after it) and the states of
the layers the draft reads (its features). Every guess is kept, and the target samples one more token after
the last guess, as the decoder emits after a block it accepts whole. So a completion is blocks of the draft's
own guesses, each drafted from the target's states of all the text before it: the contexts the draft drafts
in, where the target's own samples hold only text the target wrote. The target's cost is one forward per
block of k + 1 tokens, which also gives the labels and the features; the finished rows' last token, which no
block reads, gets one more one-token forward (the draft's states need every token's).

Each row draws from its own generator, seeded by (seed, prompt_id, sample_index), so its completion depends
on neither its batch nor its neighbours (up to the float rounding of batched forwards).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from common.sampling import SamplingParams, draw_each
from decode.api import build_ragged_runners
from decode.batched_speculative import draft_guesses
from decode.drafts.feature.model import FeatureDraft
from decode.drafts.feature.ragged import RaggedFeatureDrafter
from decode.runners.ragged import RaggedRunner
from decode.speculative import cut_at_eos
from distill.generation.engine import Completion, row_seed
from distill.generation.plan import Row
from distill.generation.runner_engine import batches


SAMPLER = "feature-rollout-v1"


@dataclass
class _Rollout:
    """One row's text so far and what the target's forwards gave for it (what `draft_guesses` reads of a row:
    committed, pending, generator, lookup)."""
    committed: list[int]
    prompt_len: int
    generator: torch.Generator | None
    pending: list[int]
    states: list[torch.Tensor] = field(default_factory=list)
    """bf16 [n, layers, H] per target forward: the states of the tokens it read, in order from the first."""
    topk_ids: list[torch.Tensor] = field(default_factory=list)
    topk_logprobs: list[torch.Tensor] = field(default_factory=list)
    """[n, K] per target forward: the target's top-k after each token it read, the next token's label."""
    lookup = None  # rollouts draft with the feature draft alone (no prompt lookup)

    @property
    def produced(self) -> int:
        return len(self.committed) - self.prompt_len

    @property
    def read(self) -> int:
        """Tokens the target has read (every one but the last, between rounds)."""
        return sum(s.shape[0] for s in self.states)


def rollout_batch(target: RaggedRunner, drafter: RaggedFeatureDrafter, prompts: list[list[int]],
                  generators: list[torch.Generator | None], *, k: int, max_new_tokens: int, sampling: SamplingParams,
                  eos_ids: list[int], teacher_topk: int) -> list[Completion]:
    """One rollout per prompt (each at least 2 tokens), k guesses per block; completions in prompt order, with
    the target's top-k (teacher_topk >= 1) and the states of prompt and completion tokens."""
    if min(map(len, prompts)) < 2:
        raise ValueError("a rollout's prompt needs 2 tokens or more: the draft drafts from the target's states")
    eos = set(eos_ids)
    target.reset()
    drafter.reset()
    texts = [p[:-1] for p in prompts]  # each runner reads the prompt but its last token; the first block feeds it
    target.add(texts)
    prompt_states = target.hidden_states.to("cpu", torch.bfloat16)  # [B, L, layers, H]
    drafter.add(texts)
    rows = [_Rollout(list(p), len(p), g, pending=[p[-1]], states=[prompt_states[i, : len(t)]])
            for i, (p, t, g) in enumerate(zip(prompts, texts, generators))]
    live = list(range(len(rows)))  # the row of each cache row
    while live:
        batch = [rows[i] for i in live]
        limits = [max(0, min(k, max_new_tokens - row.produced - 1)) for row in batch]  # the block's token after them
        guesses = draft_guesses(drafter, batch, limits, sampling, p_min=0.0)[0]
        logits = _read(target, [[row.committed[-1]] + guess for row, guess in zip(batch, guesses)], batch,
                       teacher_topk)  # [b, width, V]
        held = drafter.lengths.tolist()
        keep_target, keep_draft = [], []
        after = logits[torch.arange(len(batch)), [len(guess) for guess in guesses]]  # [b, V]: after the last guess
        tokens = draw_each(after, sampling, [row.generator for row in batch])
        for i, (row, guess, token) in enumerate(zip(batch, guesses, tokens)):
            before = len(row.committed)
            row.committed += guess + [token]
            keep_target.append(len(row.committed) - 1)
            keep_draft.append(min(held[i], before + len(guess)))
        target.truncate(torch.tensor(keep_target))
        drafter.truncate(torch.tensor(keep_draft))  # the feature draft keeps what the target read
        for row, kept in zip(batch, drafter.lengths.tolist()):
            row.pending = row.committed[kept:]
        finished = [i for i, row in enumerate(batch) if row.produced >= max_new_tokens
                    or cut_at_eos(row.committed[row.prompt_len:], eos)[1]]
        unread = [i for i in finished if _row_length(batch[i], eos) > batch[i].read]
        if unread:  # a completion's last token: one forward reads it for its states
            _read(target, [[batch[i].committed[-1]] for i in unread], [batch[i] for i in unread], 0,
                  torch.tensor(unread))
        if finished:
            kept = torch.tensor([i for i in range(len(batch)) if i not in finished], dtype=torch.long)
            target.keep(kept)
            drafter.keep(kept)
            live = [live[i] for i in kept.tolist()]
    return [_completion(row, eos) for row in rows]


def _read(target: RaggedRunner, texts: list[list[int]], rows: list[_Rollout], teacher_topk: int,
          cache_rows: torch.Tensor | None = None) -> torch.Tensor | None:
    """The target reads texts[i] after row i's text (cache rows `cache_rows`, default all); each row keeps the
    states and (teacher_topk > 0) the top-k at every token read. Returns fp32 logits [b, width, V] (None with
    teacher_topk 0: a last token read for its states alone needs none)."""
    tokens = torch.zeros(len(texts), max(map(len, texts)), dtype=torch.long)
    for i, text in enumerate(texts):
        tokens[i, : len(text)] = torch.tensor(text)
    counts = torch.tensor([len(text) for text in texts])
    logits = target.forward(tokens, counts, cache_rows, logits=teacher_topk > 0)
    states = target.hidden_states.to("cpu", torch.bfloat16)  # [b, width, layers, H]
    top = logits.log_softmax(-1).topk(teacher_topk, dim=-1) if teacher_topk else None
    for i, (row, n) in enumerate(zip(rows, counts.tolist())):
        row.states.append(states[i, :n])
        if top is not None:
            row.topk_ids.append(top.indices[i, :n].to("cpu", torch.int32))
            row.topk_logprobs.append(top.values[i, :n].cpu())
    return logits


def _row_length(row: _Rollout, eos: set[int]) -> int:
    """Prompt + completion tokens of a finished row (its text cut after the first EOS)."""
    return row.prompt_len + len(cut_at_eos(row.committed[row.prompt_len:], eos)[0])


def _completion(row: _Rollout, eos: set[int]) -> Completion:
    tokens, ended = cut_at_eos(row.committed[row.prompt_len:], eos)
    n = len(tokens)
    # The first block read the prompt's last token first: its top-k labels completion token 0, and so on.
    return Completion(np.asarray(tokens, dtype=np.int32), "eos" if ended else "length",
                      torch.cat(row.topk_ids)[:n].numpy(), torch.cat(row.topk_logprobs)[:n].numpy(),
                      hidden=torch.cat(row.states)[: row.prompt_len + n])


class FeatureRolloutEngine:
    """The generation engine of a feature draft's rollouts (generate mode only: an `Engine`'s `generate`)."""

    def __init__(self, target: torch.nn.Module, draft: FeatureDraft, eos_ids: list[int], k: int, batch_size: int,
                 max_batch_tokens: int):
        self.target_runner, self.drafter = build_ragged_runners(target, draft)
        self.context_length = getattr(target.config, "max_position_embeddings", None)
        self.eos_ids, self.k = eos_ids, k
        self.batch_size, self.max_batch_tokens = batch_size, max_batch_tokens
        self.sampler = f"{SAMPLER}:k={k}"

    def generate(self, rows: list[Row], sampling: SamplingParams, max_new_tokens: int, teacher_topk: int,
                 seed: int) -> Iterator[list[Completion]]:
        for batch in batches(rows, self.batch_size, self.max_batch_tokens, max_new_tokens + self.k):
            generators = [torch.Generator().manual_seed(row_seed(seed, r.prompt.prompt_id, r.sample_index))
                          for r in batch]
            yield rollout_batch(self.target_runner, self.drafter, [list(r.prompt.token_ids) for r in batch],
                                generators, k=self.k, max_new_tokens=max_new_tokens, sampling=sampling,
                                eos_ids=self.eos_ids, teacher_topk=teacher_topk)
