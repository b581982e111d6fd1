"""Two-sample χ² on sampled continuations: the lossless-sampling tests' one statistic.

A test draws n continuations through a speculative loop and compares their joint histogram with n
drawn by target-only decoding. The target-only sample depends only on the target, the prompt, the
length, the sampling parameters, n and the seed, so it is drawn once per such key and shared by every
test that compares against it (about a third of each test's time otherwise)."""

from __future__ import annotations

import weakref
from collections import Counter
from typing import Callable

import torch
from scipy import stats as scipy_stats

from common.sampling import SamplingParams
from decode.runners import make_runner
from decode.speculative import target_decode


_TARGET_ONLY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # target model -> {key: Counter}


def continuations(draw: Callable[[torch.Generator], torch.Tensor], n: int, seed: int) -> Counter:
    """Histogram of n token sequences, each `draw(generator)`, from one generator seeded with seed."""
    gen = torch.Generator().manual_seed(seed)
    return Counter(tuple(draw(gen).tolist()) for _ in range(n))


def target_only(target: torch.nn.Module, prompt: torch.Tensor, max_new_tokens: int, sampling: SamplingParams,
                n: int = 1000, seed: int = 2) -> Counter:
    """Histogram of n target-only continuations of prompt [1, T] (the lean runner), drawn once per key."""
    key = (tuple(prompt.flatten().tolist()), max_new_tokens, sampling, n, seed)
    drawn = _TARGET_ONLY.setdefault(target, {})
    if key not in drawn:
        runner = make_runner(target, target.config.vocab_size, "lean")
        drawn[key] = continuations(lambda g: target_decode(runner, prompt, max_new_tokens=max_new_tokens,
                                                           sampling=sampling, generator=g), n, seed)
    return drawn[key]


def two_sample_pvalue(a: Counter, b: Counter) -> float:
    """χ² p-value that histograms a and b come from one distribution. Cells seen fewer than 10 times in
    both together are pooled into one, so no expected count is tiny."""
    cells = sorted(set(a) | set(b))
    frequent = [c for c in cells if a[c] + b[c] >= 10]
    rare = [c for c in cells if c not in frequent]
    pooled = [[sum(counts[c] for c in rare)] if rare else [] for counts in (a, b)]
    rows = [[counts[c] for c in frequent] + extra for counts, extra in zip((a, b), pooled)]
    return scipy_stats.chi2_contingency(rows).pvalue
