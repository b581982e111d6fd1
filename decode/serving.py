"""eval-speedup's serving table: the speedup a server would see at batch > 1 (decode/batched_speculative.py).

For each batch size of eval.serving_batches and each temperature: the first prompt set's prompts, repeated
to make eval.serving_requests requests (at least twice the batch), decoded with continuous batching by
target-only decoding, by each draft measured (the standalone draft, "draft", and the feature draft,
"feature", decode/drafts/feature/ragged.py; with eval.lookup_ngram > 0 also the standalone draft behind prompt
lookup, "draft+lookup") at each k of eval.ks (also with eval.serving_p_min when set) and with k chosen per
round ("... auto"), the methods taking turns on groups
of requests (SERVING_GROUPS). Each row: tokens/s over all requests, speedup over target-only at the same
batch size, τ, the mean time from a request joining to its last token, and
whether every greedy row equals batch-1 target-only decoding.
"""

from __future__ import annotations

import hashlib
import statistics
import sys
import time

import torch
from tqdm import tqdm

from common.config import ConfigError
from common.progress import BatchProgress
from common.sampling import SamplingParams
from decode.api import build_ragged_runners
from decode.batched_speculative import AdaptiveK, check_cache_memory, serve
from decode.runners.ragged import RaggedRunner
from decode.stats import SpeculativeStats


def serving_methods(ks: list[int], p_min: float, kinds: list[str]) -> list[tuple[str, str | None, int, float, bool]]:
    """(name, draft kind, k, p_min, adaptive) of every row measured at a batch size: target-only first, then per
    draft kind ("draft", "draft+lookup", "feature") each k and "<kind> auto" (k chosen per round up to the largest k,
    decode/batched_speculative.py)."""
    methods: list[tuple[str, str | None, int, float, bool]] = [("target-only", None, 0, 0.0, False)]
    for kind in kinds:
        methods += [(kind, kind, k, 0.0, False) for k in ks]
        methods += [(f"{kind} p_min", kind, k, p_min, False) for k in ks] if p_min else []
        methods.append((f"{kind} auto", kind, max(ks), 0.0, True))
    return methods


AUTO_P_MINS = (0.5, 0.7)
"""The "auto" rows also weigh drafting up to the largest k with each of these p_min (decode/batched_speculative.py
AdaptiveK): rows that stop where the draft is unsure can beat every fixed k (docs/results.md, "Serving")."""


SERVING_GROUPS = 4
"""A batch size's requests are decoded in up to this many groups of at least two batches each, every method
on each group in turn (the order rotated per group), so a drift in the machine's speed falls on every method
alike, as the batch-1 rows interleave per prompt. "draft auto" keeps its AdaptiveK from group to group."""


def serving_requests(prompts: list, requests: int, batch: int) -> list:
    """The requests a batch size serves: the prompts in order, repeated to `requests` (at least twice the batch,
    so rows finish and new ones join)."""
    return [prompts[i % len(prompts)] for i in range(max(requests, 2 * batch))]


def request_groups(n_requests: int, batch: int) -> list[range]:
    groups = max(1, min(SERVING_GROUPS, n_requests // (2 * batch)))
    bounds = [round(g * n_requests / groups) for g in range(groups + 1)]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def serving_runners(s) -> dict[str | None, tuple[RaggedRunner, object | None]]:
    """(target runner, draft runner) by draft kind (None: target-only) for `s` (decode.eval_speedup.Setup). The feature
    draft verifies on a target runner of its own, which keeps the hidden states it reads. "draft" and "draft+lookup"
    share target-only's target runner (the feature draft cannot follow looked-up text, batched_speculative.serve)."""
    target, draft = build_ragged_runners(s.target, s.draft)
    out: dict[str | None, tuple[RaggedRunner, object | None]] = {None: (target, None)}
    if draft is not None:
        out["draft"] = (target, draft)
        if s.cfg.eval.lookup_ngram:
            out["draft+lookup"] = out["draft"]
    if s.feature is not None:
        out["feature"] = build_ragged_runners(s.target, s.feature)
    return out


def measure_serving(s, greedy_tokens: dict[tuple[str, str], list[int]]) -> list[dict]:
    """The serving rows of `s` (decode.eval_speedup.Setup); greedy_tokens: batch-1 target-only greedy outputs."""
    ev = s.cfg.eval
    runners = serving_runners(s)
    set_name, prompts = next(iter(s.prompt_sets.items()))
    methods = serving_methods(ev.ks, ev.serving_p_min, [kind for kind in runners if kind])
    plan = [(batch, serving_requests(prompts, ev.serving_requests, batch)) for batch in ev.serving_batches]
    # Every method decodes every request once per temperature: 64 requests of up to 192 tokens at batch 4 and 16,
    # seven methods, greedy, took ~20 of eval-speedup's 22 minutes on a 2-core AVX2 CPU (docs/results.md). The
    # expectation line follows the first group, a small batch size's, and so overestimates when larger ones follow.
    progress = BatchProgress("eval-speedup serving", sum(len(requests) for _, requests in plan) * len(ev.temperatures)
                             * len(methods), "requests")
    rows = []
    for batch, requests in plan:
        for temperature in ev.temperatures:
            sampling = SamplingParams(temperature, ev.top_k, ev.top_p)
            runs: list[list[dict]] = [[] for _ in methods]
            choosers = [AdaptiveK(k, AUTO_P_MINS) if adaptive else False for _, _, k, _, adaptive in methods]
            for g, group in enumerate(request_groups(len(requests), batch)):
                for i in [*range(g % len(methods), len(methods)), *range(g % len(methods))]:
                    _, kind, k, p_min, _ = methods[i]
                    lookup_ngram = ev.lookup_ngram if kind and kind.endswith("+lookup") else 0
                    runs[i].append(_timed_serve(s, *runners[kind], requests, group, batch, k, p_min, choosers[i],
                                                sampling, lookup_ngram))
                    progress.batch_done(len(group), tokens=sum(len(o.tokens) for o in runs[i][-1]["outcomes"]))
            baseline = None
            for (name, _, k, p_min, _), method_runs in zip(methods, runs):
                row = _merged(method_runs)
                row.update(prompt_set=set_name, batch=batch, temperature=temperature, method=name, k=k, p_min=p_min)
                outputs = row.pop("outputs")
                row["greedy_identical"] = all(tokens == greedy_tokens[(set_name, p.prompt_id)] for tokens, p
                                              in zip(outputs, requests)) if sampling.greedy else None
                baseline = baseline or row["tok_s"]
                row["speedup"] = row["tok_s"] / baseline
                rows.append(row)
                tqdm.write(f"serving batch {batch} T={temperature} {name} k={k}: {row['tok_s']:.1f} tok/s "
                           f"({row['speedup']:.2f}x), tau {row['tau']:.2f}", file=sys.stderr)
    progress.close()
    return rows


def check_serving_memory(ev, prompt_lengths: list[int], models: list[torch.nn.Module]) -> None:
    """Refuse batch sizes whose caches would not fit in the memory free now, before any timing
    (batched_speculative.check_cache_memory). ev: the eval config."""
    if not ev.serving_batches:
        return
    try:
        check_cache_memory(max(ev.serving_batches), max(prompt_lengths), ev.max_new_tokens, max(ev.ks), models)
    except ValueError as error:
        raise ConfigError(f"eval.serving_batches: {error}") from None


def _timed_serve(s, target: RaggedRunner, draft, requests: list, group: range, batch: int,
                 k: int, p_min: float, adaptive: bool | AdaptiveK, sampling: SamplingParams, lookup_ngram: int) -> dict:
    ev = s.cfg.eval
    # Request i's generator depends on the request, so each method samples every request alike.
    generators = [torch.Generator().manual_seed(_seed(s.cfg.seed, requests[i].prompt_id, i)) for i in group]
    start = time.perf_counter()
    outcomes = serve(target, draft, [list(requests[i].token_ids) for i in group], batch_size=batch, k=k,
                     max_new_tokens=ev.max_new_tokens, sampling=sampling, eos_token_id=s.tokenizer.eos_token_id,
                     generators=generators, p_min=p_min, adaptive=adaptive, lookup_ngram=lookup_ngram)
    return {"seconds": time.perf_counter() - start, "outcomes": outcomes}


def _merged(runs: list[dict]) -> dict:
    """One row from a method's runs over the request groups, in request order."""
    outcomes = [o for run in runs for o in run["outcomes"]]
    stats = SpeculativeStats(k=max(1, max(o.stats.k for o in outcomes)))
    for outcome in outcomes:
        stats = stats.merge(outcome.stats)
    tokens, seconds = sum(len(o.tokens) for o in outcomes), sum(run["seconds"] for run in runs)
    return {"requests": len(outcomes), "tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds,
            "tau": stats.tau, "alpha": stats.alpha, "mean_latency_s": statistics.mean(o.seconds for o in outcomes),
            "outputs": [o.tokens for o in outcomes]}


def _seed(seed: int, prompt_id: str, index: int) -> int:
    return int(hashlib.sha256(f"{seed}:{prompt_id}:{index}:serving".encode()).hexdigest()[:12], 16)


def speculation_pays_up_to(rows: list[dict]) -> dict[float, int | None]:
    """Per temperature, the largest batch size at which the best draft row beats target-only (None: none)."""
    out: dict[float, int | None] = {}
    for temperature in sorted({r["temperature"] for r in rows}):
        wins = [r["batch"] for r in rows if r["temperature"] == temperature and r["k"] and r["speedup"] > 1.0]
        out[temperature] = max(wins, default=None)
    return out
