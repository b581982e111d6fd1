"""Speculative decoding of many requests at once (continuous batching), lossless per row.

    outcomes = serve(target_runner, draft_runner, prompts, batch_size=4, k=4, max_new_tokens=64,
                     sampling=SamplingParams(), generators=[...])

Up to `batch_size` requests decode together on two RaggedRunners (decode/runners/ragged.py). Each
round every live row drafts up to k tokens (one batched draft forward per position; a row stops early
where the draft's most probable token has less than `p_min`; with lookup_ngram > 0 a row first takes the
free guesses of prompt lookup, decode/lookup.py, and the draft reads them on its next forward), one
batched target forward verifies every row's [last committed, drafted...], and each row keeps what the
acceptance rule of decode/speculative.py accepts for it, drawing from its own generator, so a row's output
does not depend on its neighbours. Rows that finish (EOS or max_new_tokens) leave; queued requests join.
`draft_runner=None` is target-only decoding at the same batch size: the baseline a serving speedup is
measured against.

adaptive=True makes k a maximum: each round drafts the k (0..k, 0: none) of the most expected tokens
per second, from the acceptance so far at each depth and the wall time of the rounds run with that k,
timed on the rounds themselves, so measuring costs no forwards of its own (`AdaptiveK`); an
AdaptiveK(k, p_mins=...) also weighs drafting up to k with each p_min (rows stop where the draft is unsure).

The invariants, per row: the target holds its committed text but the last token; the draft holds a
prefix of committed + drafted text (`pending`: the committed tokens it has not read yet).
"""

from __future__ import annotations

import os
import statistics
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from common.sampling import SamplingParams, draw_each, sample_each
from decode.proposers import LookupProposer, check_lookup_ngram
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
    lookup: LookupProposer | None = None

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


def check_cache_memory(batch_size: int, longest_prompt: int, max_new_tokens: int, k: int,
                       models: list[torch.nn.Module]) -> None:
    """Refuse a batch size whose caches would not fit in the memory free now, before any forward: each row
    holds its text and a block of guesses in every layer's keys and values, twice over (growth headroom),
    for the target and the draft (`models`)."""
    slots = 2 * (longest_prompt + max_new_tokens + k + 1)
    per_slot = sum(m.config.num_hidden_layers * 2 * m.config.num_key_value_heads
                   * (getattr(m.config, "head_dim", None) or m.config.hidden_size // m.config.num_attention_heads)
                   * next(m.parameters()).element_size() for m in models)
    needed = batch_size * slots * per_slot
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if needed > free:
        raise ValueError(f"batch {batch_size} needs ~{needed / 2**30:.1f} GiB of cache ({slots} slots x "
                         f"{per_slot / 2**10:.0f} KiB per row), {free / 2**30:.1f} GiB is free; use a smaller "
                         "batch size or fewer new tokens")


def serve(target: RaggedRunner, draft: RaggedRunner | None, prompts: list[list[int]], *, batch_size: int, k: int,
          max_new_tokens: int, sampling: SamplingParams, eos_token_id: int | list[int] | None = None,
          generators: list[torch.Generator | None] | None = None, p_min: float = 0.0,
          adaptive: bool | AdaptiveK = False, lookup_ngram: int = 0) -> list[RowOutcome]:
    """Decode every prompt, `batch_size` at a time; outcomes in prompt order. adaptive: True, or an
    AdaptiveK(k) to keep across calls (what it measured carries over, as in a server that keeps running);
    its rounds' p_min replaces `p_min`. lookup_ngram > 0 (at least 2): prompt lookup over n-grams of up to
    that many tokens proposes first, the draft where it finds nothing (a draft that reads its guesses one at
    a time, the feature draft, cannot follow looked-up text: standalone drafts only)."""
    check_serving(batch_size, k if draft is not None else 0, p_min)
    check_lookup_ngram(lookup_ngram)
    if lookup_ngram and not getattr(draft, "follows_lookup", True):
        raise ValueError(f"{type(draft).__name__} reads its guesses one at a time: it cannot follow prompt lookup")
    eos = eos_set(eos_token_id)
    generators = generators or [None] * len(prompts)
    target.reset()
    if draft is not None:
        draft.reset()
    queue, live, done = list(range(len(prompts))), [], {}
    chooser = None
    if adaptive is not False and draft is not None and k > 0:
        chooser = adaptive if isinstance(adaptive, AdaptiveK) else AdaptiveK(k)
        if chooser.k_max != k:
            raise ValueError(f"the AdaptiveK given chooses k up to {chooser.k_max}, serve was asked for k={k}")
        chooser.expect_rows(min(batch_size, len(prompts)))
    while queue or live:
        joining = [queue.pop(0) for _ in range(min(batch_size - len(live), len(queue)))]
        if joining:
            live += _join(target, draft, prompts, joining, generators, max(k, 1), lookup_ngram)
        arm = chooser.choose() if chooser is not None else None
        round_k, round_p_min = chooser.arms[arm] if chooser is not None else (k, p_min)
        started = time.perf_counter()
        blocks = []
        if draft is not None:  # round_k = 0 verifies no guesses, and the draft follows what the target emits
            blocks = _speculative_round(target, draft, live, round_k, max_new_tokens, sampling, round_p_min)
        else:
            _target_round(target, live, sampling)
        if chooser is not None:
            chooser.observe(arm, time.perf_counter() - started, blocks, rows=len(live))
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
          generators: list, k: int, lookup_ngram: int) -> list[_Row]:
    """New rows: each runner reads the prompt but its last token (the first round feeds that one)."""
    texts = [list(prompts[i][:-1]) for i in joining]
    target.add(texts)
    if draft is not None:
        draft.add(texts)
    now = time.perf_counter()
    rows = [_Row(i, list(prompts[i]), len(prompts[i]), generators[i], SpeculativeStats(k=k), now,
                 pending=[prompts[i][-1]]) for i in joining]
    for row in rows if lookup_ngram and draft is not None else ():
        row.lookup = LookupProposer(lookup_ngram)
        row.lookup.reset(row.committed)
    return rows


def _target_round(target: RaggedRunner, live: list[_Row], sampling: SamplingParams) -> None:
    """One token per row: target-only decoding."""
    tokens = torch.tensor([[row.committed[-1]] for row in live])
    logits = target.forward(tokens, torch.ones(len(live), dtype=torch.long))[:, 0]  # [B, V]
    for row, token in zip(live, draw_each(logits, sampling, [row.generator for row in live])):
        row.committed.append(token)
        row.stats.record_block(proposed=0, tried=0, accepted=0, emitted=1, draft_forwards=0)


def _speculative_round(target: RaggedRunner, draft: RaggedRunner, live: list[_Row], k: int, max_new_tokens: int,
                       sampling: SamplingParams, p_min: float) -> list[tuple[int, int]]:
    """One draft-and-verify block for every live row; returns each row's (guesses, accepted guesses)."""
    blocks = []
    limits = [max(0, min(k, max_new_tokens - row.produced - 1)) for row in live]
    drafted, draft_probs, looked_up, forwards = draft_guesses(draft, live, limits, sampling, p_min)
    width = 1 + max(map(len, drafted))
    tokens = torch.zeros(len(live), width, dtype=torch.long)
    for i, (row, guess) in enumerate(zip(live, drafted)):
        tokens[i, : 1 + len(guess)] = torch.tensor([row.committed[-1]] + guess)
    counts = torch.tensor([1 + len(guess) for guess in drafted])
    logits = target.forward(tokens, counts)  # [B, width, V]
    if not sampling.greedy:  # every row's read positions warped at once, the padding left out
        read = (torch.arange(width) < counts[:, None]).to(logits.device)  # [B, width]
        target_probs = sampling.warp(logits[read]).split(counts.tolist())
    keep_target, keep_draft = [], []
    held = draft.lengths.tolist()
    for i, (row, guess) in enumerate(zip(live, drafted)):
        if sampling.greedy:
            emitted, accepted = verify_greedy(guess, logits[i, : 1 + len(guess)])
        else:
            emitted, accepted = verify_block(guess, draft_probs[i], target_probs[i], row.generator)
        before = len(row.committed)
        row.committed += emitted
        row.stats.record_block(proposed=len(guess), tried=min(len(guess), accepted + 1), accepted=accepted,
                               emitted=len(emitted), draft_forwards=forwards[i], looked_up=sum(looked_up[i]),
                               looked_up_accepted=sum(looked_up[i][:accepted]))
        blocks.append((len(guess), accepted))
        keep_target.append(len(row.committed) - 1)
        keep_draft.append(min(held[i], before + accepted))  # the draft read committed text, then the guesses
    target.truncate(torch.tensor(keep_target))
    draft.truncate(torch.tensor(keep_draft))  # a draft may keep less (a feature draft: what the target verified)
    for row, kept in zip(live, draft.lengths.tolist()):
        row.pending = row.committed[kept:]
    return blocks


def draft_guesses(draft: RaggedRunner, live: list[_Row], limits: list[int], sampling: SamplingParams, p_min: float
                  ) -> tuple[list[list[int]], list[list[torch.Tensor | None]], list[list[bool]], list[int]]:
    """Up to limits[i] tokens per row (rows: committed, pending, generator and lookup as `_Row`'s), one batched
    draft forward per position the rows' lookups cannot fill:
    every row first reads the tokens it has not read (pending, then looked-up guesses), then its own last guess.
    Returns each row's guesses, their draft probabilities (None: looked up, probability 1), which were looked
    up, and the draft forwards the row took part in."""
    drafted: list[list[int]] = [[] for _ in live]
    draft_probs: list[list[torch.Tensor | None]] = [[] for _ in live]
    looked_up: list[list[bool]] = [[] for _ in live]
    forwards = [0] * len(live)
    active = [limit > 0 for limit in limits]
    unread = [list(row.pending) for row in live]
    while True:
        for i, row in enumerate(live):  # free guesses first: a looked-up token needs no forward
            while active[i] and (token := _looked_up(row, drafted[i])) is not None:
                drafted[i].append(token)
                draft_probs[i].append(None)
                looked_up[i].append(True)
                unread[i].append(token)
                active[i] = len(drafted[i]) < limits[i]
        if not any(active):
            return drafted, draft_probs, looked_up, forwards
        width = max(len(u) for u, on in zip(unread, active) if on)
        tokens = torch.zeros(len(live), width, dtype=torch.long)
        counts = torch.tensor([len(u) if on else 0 for u, on in zip(unread, active)])
        for i, (u, on) in enumerate(zip(unread, active)):
            if on:
                tokens[i, : len(u)] = torch.tensor(u)
        logits = draft.forward(tokens, counts)
        rows = [i for i, on in enumerate(active) if on]
        last = logits[rows, counts[rows] - 1]  # [R, V]: each drafting row's last position
        if sampling.greedy:
            guesses, probs = last.argmax(-1).tolist(), [None] * len(rows)
            confidences = last.float().softmax(-1).amax(-1).tolist() if p_min else [1.0] * len(rows)
        else:  # all rows warped and drawn at once, each from its own generator
            probs = sampling.warp(last)
            guesses = sample_each(probs, [live[i].generator for i in rows]).tolist()
            confidences = probs.amax(-1).tolist()
        for i, token, row_probs, confidence in zip(rows, guesses, probs, confidences):
            drafted[i].append(token)
            draft_probs[i].append(row_probs)
            looked_up[i].append(False)
            unread[i] = [token]
            forwards[i] += 1
            # A row stops after a guess its draft gave less than p_min (llama.cpp's p-min), or at its limit.
            active[i] = len(drafted[i]) < limits[i] and confidence >= p_min


def _looked_up(row: _Row, drafted: list[int]) -> int | None:
    return row.lookup.guess(row.committed, drafted) if row.lookup is not None else None


class AdaptiveK:
    """The k of each round (0: no drafting), and optionally a p_min, from what rounds with each took and the
    acceptance so far.

    The choices are `arms`, (k, p_min) pairs: arm i <= k_max drafts k = i guesses; the arms after them draft
    up to k_max guesses, each row stopping after a guess its draft gave less than p_min (one arm per value
    of `p_mins`), so the length follows the draft's confidence row by row, which no fixed k does.
    An arm's cost is the wall time of its rounds (the median of its last TIMED rounds, so a round the OS
    interrupted does not stick): the draft forwards, the verification of the guesses at this batch size,
    and the host work per row (acceptance, sampling, bookkeeping), all of it measured on rounds that
    decode, so knowing the costs takes no forwards of its own. The first rounds run every arm three times
    (an arm's first round is not timed: the first calls at a new shape allocate); after that each round
    runs the arm of the most expected tokens per second, and every EXPLORE_EVERY rounds a neighbour of it
    in `arms` (the one timed longer ago) instead, so the costs near the choice follow the machine and the
    batch. Only rounds of the full batch are timed (serve gives its rows, min(batch size, requests), and a
    chooser kept for another batch size drops its timings): a round's time grows with its rows, and the rounds
    of a queue running dry (a few rows left) would price an arm by the rows it happened to meet (at batch
    16 in bf16 on a 2-core AMX CPU, the median k = 0 round over all rounds took 25 ms, over 16-row rounds 38
    ms, so k = 0 looked 1.5x as cheap as it is at full batch). A fixed-k round is worth the expected tokens
    per row, 1 + sum over j <= k of α_1 ... α_j, with α_j the acceptance of the guess at depth j once the
    j - 1 before it were accepted, counted per depth on fixed-k rounds: acceptance is not the same at every
    depth (the demo's draft at k = 4: 0.38 at depth 1, 0.41-0.55 at depths 2-4), and one α pooled over
    depths misprices each k by the depths it does not reach. A p_min round is worth the tokens its rows
    emitted per round so far (its guesses stop where the draft is unsure, so its depths are not a fair
    sample of the per-depth acceptance)."""

    PRIOR = (1, 2)
    """Acceptance before any block: 1 of 2 guesses, worth two guesses of evidence."""
    DEPTH_PRIOR_WEIGHT = 2
    """A depth's α starts at the acceptance pooled over all depths, worth this many tests of that depth."""
    P_MIN_PRIOR_ROWS = 4
    """A p_min arm's tokens per row start at k_max's expected tokens, worth this many rows' rounds."""
    EXPLORE_EVERY = 16
    TIMED = 8
    """An arm's cost is the median of its last this many timed rounds."""

    def __init__(self, k_max: int, p_mins: tuple[float, ...] = ()):
        if any(not 0 < p < 1 for p in p_mins):
            raise ValueError(f"p_mins must lie in (0, 1), got {list(p_mins)}")
        self.k_max = k_max
        self.arms = [(k, 0.0) for k in range(k_max + 1)] + [(k_max, p) for p in sorted(p_mins) if k_max > 0]
        self.accepted = [0] * (k_max + 1)  # [j]: guesses at depth j accepted (index 0 unused)
        self.tried = [0] * (k_max + 1)  # [j]: guesses at depth j tested (those before it all accepted)
        self.emitted = [[0, 0] for _ in self.arms]  # [arm]: (tokens emitted, rows' rounds) on p_min arms
        self.timed: dict[int, deque[float]] = {i: deque(maxlen=self.TIMED) for i in range(len(self.arms))}
        self.runs = dict.fromkeys(range(len(self.arms)), 0)
        self.last_used = dict.fromkeys(range(len(self.arms)), 0)
        self.rounds = 0
        self.full_rows = 0  # the rows of a full-batch round: the rounds timed

    def depth_acceptance(self, depth: int) -> float:
        prior_accepted, prior_tried = self.PRIOR
        pooled = (prior_accepted + sum(self.accepted)) / (prior_tried + sum(self.tried))
        weight = self.DEPTH_PRIOR_WEIGHT
        return min((self.accepted[depth] + weight * pooled) / (self.tried[depth] + weight), 0.99)

    def expected_tokens(self, arm: int) -> float:
        """Tokens per row a round of `arm` emits (arm <= k_max: k = arm)."""
        if arm > self.k_max:
            tokens, rows = self.emitted[arm]
            weight = self.P_MIN_PRIOR_ROWS
            return (tokens + weight * self.expected_tokens(self.k_max)) / (rows + weight)
        tokens = reach = 1.0
        for depth in range(1, arm + 1):
            reach *= self.depth_acceptance(depth)  # the chance that the first `depth` guesses are accepted
            tokens += reach
        return tokens

    def seconds(self, arm: int) -> float:
        return statistics.median(self.timed[arm])

    def choose(self) -> int:
        """The arm of the next round: its (k, p_min) is arms[arm]."""
        self.rounds += 1
        unmeasured = [arm for arm, times in self.timed.items() if len(times) < 2]
        if unmeasured:
            return unmeasured[0]
        best = max(self.timed, key=lambda arm: self.expected_tokens(arm) / self.seconds(arm))
        if self.rounds % self.EXPLORE_EVERY == 0:
            neighbours = [arm for arm in (best - 1, best + 1) if arm in self.timed]
            return min(neighbours, key=self.last_used.get, default=best)
        return best

    def expect_rows(self, rows: int) -> None:
        """Rounds of `rows` rows are the full batch from now on (serve: min(batch size, requests)); timings
        of another row count are dropped, as they price every arm at that count."""
        if rows != self.full_rows:
            self.full_rows = rows
            for times in self.timed.values():
                times.clear()

    def observe(self, arm: int, seconds: float, blocks: list[tuple[int, int]], rows: int | None = None) -> None:
        """One round of `arm` with `rows` live rows (None: not counted) took `seconds`; `blocks`: each row's
        (guesses, accepted guesses)."""
        if arm > self.k_max:
            self.emitted[arm][0] += sum(accepted + 1 for _, accepted in blocks)
            self.emitted[arm][1] += len(blocks)
        for guesses, accepted in blocks if arm <= self.k_max else ():
            for depth in range(1, min(guesses, accepted + 1) + 1):
                self.tried[depth] += 1
                self.accepted[depth] += depth <= accepted
        self.runs[arm] += 1
        self.last_used[arm] = self.rounds
        if rows is not None and rows > self.full_rows:  # more rows than any round timed so far: time afresh
            self.expect_rows(rows)
        if self.runs[arm] > 1 and (rows is None or rows == self.full_rows):
            self.timed[arm].append(seconds)
