"""Speculative decoding of many requests at once (continuous batching), lossless per row.

    outcomes = serve(target_runner, draft_runner, prompts, batch_size=4, k=4, max_new_tokens=64,
                     sampling=SamplingParams(), generators=[...])

Up to `batch_size` requests decode together on two RaggedRunners (decode/runners/ragged.py). Each
round every live row drafts up to k tokens (one batched draft forward per position; a row stops early
where the draft's most probable token has less than `p_min`), one batched target forward verifies every
row's [last committed, drafted...], and each row keeps what the acceptance rule of decode/speculative.py
accepts for it, drawing from its own generator, so a row's output does not depend on its neighbours.
Rows that finish (EOS or max_new_tokens) leave; queued requests join. `draft_runner=None` is target-only
decoding at the same batch size: the baseline a serving speedup is measured against.

adaptive=True makes k a maximum: when a batch forms, one draft forward and target forwards of 1..k+1
tokens per row are timed on it (r(n, batch) and c in target steps), and each round drafts the k
(0..k, 0: none) that maximises the predicted tokens per unit time, (1 - α^(k+1)) / (1 - α) / cost(k), α
being the acceptance so far and cost(k) = k c + r(k) scaled by how much longer the timed rounds took
than predicted (`AdaptiveK`).

The invariants, per row: the target holds its committed text but the last token; the draft holds a
prefix of committed + drafted text (`pending`: the committed tokens it has not read yet).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from common.sampling import SamplingParams, sample
from decode.runners.ragged import RaggedRunner
from decode.speculative import cut_at_eos, eos_set, verify_block, verify_greedy
from decode.stats import SpeculativeStats


@dataclass
class RowOutcome:
    tokens: list[int]
    """New tokens (prompt excluded)."""
    stats: SpeculativeStats
    seconds: float
    """From the request joining the batch to its last token."""


@dataclass
class _Row:
    request: int
    committed: list[int]
    prompt_len: int
    generator: torch.Generator | None
    stats: SpeculativeStats
    started: float
    pending: list[int] = field(default_factory=list)

    @property
    def produced(self) -> int:
        return len(self.committed) - self.prompt_len


def check_serving(batch_size: int, k: int, p_min: float) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch size must be an int >= 1, got {batch_size!r}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"k must be an int >= 0 (0: target-only), got {k!r}")
    if not 0 <= p_min < 1:
        raise ValueError(f"p_min must lie in [0, 1) (0: always draft k), got {p_min}")


def serve(target: RaggedRunner, draft: RaggedRunner | None, prompts: list[list[int]], *, batch_size: int, k: int,
          max_new_tokens: int, sampling: SamplingParams, eos_token_id: int | list[int] | None = None,
          generators: list[torch.Generator | None] | None = None, p_min: float = 0.0,
          adaptive: bool = False) -> list[RowOutcome]:
    """Decode every prompt, `batch_size` at a time; outcomes in prompt order."""
    check_serving(batch_size, k if draft is not None else 0, p_min)
    eos = eos_set(eos_token_id)
    generators = generators or [None] * len(prompts)
    target.reset()
    if draft is not None:
        draft.reset()
    queue, live, done = list(range(len(prompts))), [], {}
    chooser = AdaptiveK(k) if adaptive and draft is not None and k > 0 else None
    while queue or live:
        joining = [queue.pop(0) for _ in range(min(batch_size - len(live), len(queue)))]
        if joining:
            live += _join(target, draft, prompts, joining, generators, max(k, 1))
            if chooser is not None and chooser.step_seconds is None:
                chooser.start(*measure_costs(target, draft, live, k))
        round_k = chooser.choose() if chooser is not None else k
        started = time.perf_counter()
        accepted = tried = 0
        if draft is not None and round_k > 0:
            accepted, tried = _speculative_round(target, draft, live, round_k, max_new_tokens, sampling, p_min)
        else:
            _target_round(target, live, sampling)
        if chooser is not None:
            chooser.observe(round_k, time.perf_counter() - started, accepted, tried)
        finished = [i for i, row in enumerate(live) if row.produced >= max_new_tokens
                    or cut_at_eos(row.committed[row.prompt_len:], eos)[1]]
        for i in finished:
            row = live[i]
            new, _ = cut_at_eos(row.committed[row.prompt_len:][:max_new_tokens], eos)
            done[row.request] = RowOutcome(new, row.stats, time.perf_counter() - row.started)
        if finished:
            kept = torch.tensor([i for i in range(len(live)) if i not in finished], dtype=torch.long)
            for runner in (target, draft):
                if runner is not None:
                    runner.keep(kept)
            live = [live[i] for i in kept.tolist()]
    return [done[i] for i in range(len(prompts))]


def _join(target: RaggedRunner, draft: RaggedRunner | None, prompts: list[list[int]], joining: list[int],
          generators: list, k: int) -> list[_Row]:
    """New rows: each runner reads the prompt but its last token (the first round feeds that one)."""
    texts = [list(prompts[i][:-1]) for i in joining]
    target.add(texts)
    if draft is not None:
        draft.add(texts)
    now = time.perf_counter()
    return [_Row(i, list(prompts[i]), len(prompts[i]), generators[i], SpeculativeStats(k=k), now,
                 pending=[prompts[i][-1]]) for i in joining]


def _target_round(target: RaggedRunner, live: list[_Row], sampling: SamplingParams) -> None:
    """One token per row: target-only decoding."""
    tokens = torch.tensor([[row.committed[-1]] for row in live])
    logits = target.forward(tokens, torch.ones(len(live), dtype=torch.long))[:, 0]  # [B, V]
    for row, row_logits in zip(live, logits):
        token = int(row_logits.argmax()) if sampling.greedy else int(sample(sampling.warp(row_logits), row.generator))
        row.committed.append(token)
        row.stats.record_block(proposed=0, tried=0, accepted=0, emitted=1, draft_forwards=0)


def _speculative_round(target: RaggedRunner, draft: RaggedRunner, live: list[_Row], k: int, max_new_tokens: int,
                       sampling: SamplingParams, p_min: float) -> tuple[int, int]:
    """One draft-and-verify block for every live row; returns (accepted, tried) guesses over the rows."""
    accepted_before, tried_before = sum(r.stats.accepted for r in live), sum(r.stats.tried for r in live)
    limits = [max(0, min(k, max_new_tokens - row.produced - 1)) for row in live]
    drafted, draft_probs = _draft(draft, live, limits, sampling, p_min)
    width = 1 + max(map(len, drafted))
    tokens = torch.zeros(len(live), width, dtype=torch.long)
    for i, (row, guess) in enumerate(zip(live, drafted)):
        tokens[i, : 1 + len(guess)] = torch.tensor([row.committed[-1]] + guess)
    counts = torch.tensor([1 + len(guess) for guess in drafted])
    logits = target.forward(tokens, counts)  # [B, width, V]
    keep_target, keep_draft = [], []
    held = draft.lengths.tolist()
    for i, (row, guess) in enumerate(zip(live, drafted)):
        target_logits = logits[i, : 1 + len(guess)]
        if sampling.greedy:
            emitted, accepted = verify_greedy(guess, target_logits)
        else:
            emitted, accepted = verify_block(guess, draft_probs[i], sampling.warp(target_logits), row.generator)
        before = len(row.committed)
        row.committed += emitted
        row.stats.record_block(proposed=len(guess), tried=min(len(guess), accepted + 1), accepted=accepted,
                               emitted=len(emitted), draft_forwards=len(guess))
        keep_target.append(len(row.committed) - 1)
        kept = min(held[i], before + accepted)  # the draft read committed text, then the guesses
        keep_draft.append(kept)
        row.pending = row.committed[kept:]
    target.truncate(torch.tensor(keep_target))
    draft.truncate(torch.tensor(keep_draft))
    return sum(r.stats.accepted for r in live) - accepted_before, sum(r.stats.tried for r in live) - tried_before


def _draft(draft: RaggedRunner, live: list[_Row], limits: list[int], sampling: SamplingParams,
           p_min: float) -> tuple[list[list[int]], list[list[torch.Tensor | None]]]:
    """Up to limits[i] tokens per row, one batched draft forward per position: every row first reads its
    pending tokens, then its own last guess."""
    drafted: list[list[int]] = [[] for _ in live]
    draft_probs: list[list[torch.Tensor | None]] = [[] for _ in live]
    active = [limit > 0 for limit in limits]
    feed = [row.pending for row in live]
    while any(active):
        width = max(len(f) for f, on in zip(feed, active) if on)
        tokens = torch.zeros(len(live), width, dtype=torch.long)
        counts = torch.tensor([len(f) if on else 0 for f, on in zip(feed, active)])
        for i, (f, on) in enumerate(zip(feed, active)):
            if on:
                tokens[i, : len(f)] = torch.tensor(f)
        logits = draft.forward(tokens, counts)
        last = logits[torch.arange(len(live)), (counts - 1).clamp(min=0)]  # [B, V]
        for i, row in enumerate(live):
            if not active[i]:
                continue
            if sampling.greedy:
                token, probs = int(last[i].argmax()), None
                confidence = float(last[i].float().softmax(-1).max()) if p_min else 1.0
            else:
                probs = sampling.warp(last[i])
                token, confidence = int(sample(probs, row.generator)), float(probs.max())
            drafted[i].append(token)
            draft_probs[i].append(probs)
            # A row stops after a guess its draft gave less than p_min (llama.cpp's p-min), or at its limit.
            active[i] = len(drafted[i]) < limits[i] and confidence >= p_min
        feed = [[guess[-1]] if guess else [] for guess in drafted]
    return drafted, draft_probs


class AdaptiveK:
    """The k of each round (0: no drafting) from each k's cost and the acceptance so far.

    A k's cost is the time of a round with it, in one-token target forwards: predicted from the forwards
    `measure_costs` times (k draft forwards + a verification of k + 1 tokens per row), times that k's
    ratio of timed to predicted rounds (until it has one, the ratio of the rounds timed so far): the host
    work per row that the forwards leave out (acceptance, sampling, bookkeeping) enters too. A round is
    worth the expected tokens per row, (1 - α^(k+1)) / (1 - α) at acceptance α."""

    PRIOR = (1, 2)
    """Acceptance before any block: 1 of 2 guesses, worth two guesses of evidence."""
    EXPLORE_EVERY = 16
    """Every this many rounds a neighbour of the best k (one more or one fewer, the one timed longer ago)
    runs instead, so the estimates near the choice stay measured, also while drafting is off."""
    TIMED_WEIGHT = 0.3
    """How far one timed round moves its k's ratio."""

    def __init__(self, k_max: int):
        self.k_max = k_max
        self.accepted, self.tried = self.PRIOR
        self.step_seconds: float | None = None
        self.predicted: dict[int, float] = {}
        self.ratio: dict[int, float] = {}
        self.last_used: dict[int, int] = {}
        self.rounds = 0

    def start(self, step_seconds: float, c: float, r: dict[int, float]) -> None:
        """The predicted costs from measure_costs' figures."""
        self.step_seconds = step_seconds
        self.predicted = {0: 1.0} | {k: k * c + r[k] for k in range(1, self.k_max + 1)}
        self.last_used = dict.fromkeys(self.predicted, 0)

    def cost(self, k: int) -> float:
        shared = sum(self.ratio.values()) / len(self.ratio) if self.ratio else 1.0
        return self.predicted[k] * self.ratio.get(k, shared)

    def expected_tokens(self, k: int) -> float:
        alpha = min(self.accepted / self.tried, 0.99)
        return (1 - alpha ** (k + 1)) / (1 - alpha)

    def choose(self) -> int:
        self.rounds += 1
        best = max(self.predicted, key=lambda k: self.expected_tokens(k) / self.cost(k))
        if self.rounds % self.EXPLORE_EVERY == 0:
            neighbours = [k for k in (best - 1, best + 1) if k in self.predicted]
            return min(neighbours, key=self.last_used.get, default=best)
        return best

    def observe(self, k: int, seconds: float, accepted: int, tried: int) -> None:
        """One round with k took `seconds` and accepted `accepted` of `tried` guesses."""
        self.accepted += accepted
        self.tried += tried
        timed = seconds / self.step_seconds / self.predicted[k]
        self.ratio[k] = self.ratio.get(k, timed) + self.TIMED_WEIGHT * (timed - self.ratio.get(k, timed))
        self.last_used[k] = self.rounds


def measure_costs(target: RaggedRunner, draft: RaggedRunner, live: list[_Row],
                  k_max: int) -> tuple[float, float, dict]:
    """(seconds of a one-token target forward, c, {k: r(k)}) on this batch: a one-token draft forward and
    target forwards of k + 1 tokens per row, in units of the one-token target forward; each forward's slots are dropped again. Medians of 5, after
    one untimed forward of each width (the first calls at a new shape allocate)."""
    rows = len(live)

    def seconds(runner: RaggedRunner, width: int) -> float:
        lengths = runner.lengths.clone()
        tokens = torch.tensor([[row.committed[-1]] * width for row in live])
        times = []
        for _ in range(6):
            start = time.perf_counter()
            runner.forward(tokens, torch.full((rows,), width))
            times.append(time.perf_counter() - start)
            runner.truncate(lengths)
        return sorted(times[1:])[2]

    step = seconds(target, 1)
    return step, seconds(draft, 1) / step, {k: seconds(target, k + 1) / step for k in range(1, k_max + 1)}
