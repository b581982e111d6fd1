"""Logits -> the exact distribution that is sampled, and the one sampler. The only such place in the project.

Target-only decoding, the speculative draft, and the speculative verifier all call
`warp_probs`, so the distribution a token was sampled from is the one the
acceptance rule compares (RELIABILITY items 1-4). Every draw, batch-1 (`sample`) or batched
(`sample_rows`, generate-data), is `inverse_cdf` at a uniform in [0, 1).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch


# Top-p candidates found per row by warp_probs, and by sample_rows for the rows whose first ROW_CANDIDATES
# fall short; at T=0.7, top-p 0.95 SmolLM2's nucleus rarely exceeds ~100 tokens.
NUCLEUS_CANDIDATES = 512
# sample_rows' first search: at batch 128 a topk of 512 over 49,152 logits took 19 ms on a 2-core AMX Xeon,
# a tenth of a generation step, against 6 ms for 64.
ROW_CANDIDATES = 64


@dataclass(frozen=True)
class SamplingParams:
    """How a token is drawn from logits, in every loop (target-only, speculative, batched generation)."""

    temperature: float = 0.0
    """0 means greedy (argmax); otherwise logits are divided by it."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 disables."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; 1 disables."""

    def __post_init__(self):
        for name, kind in (("temperature", numbers.Real), ("top_k", numbers.Integral), ("top_p", numbers.Real)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, kind):
                raise TypeError(f"{name} must be {'an int' if kind is numbers.Integral else 'a number'}, "
                                f"got {type(value).__name__} {value!r}")
        if not self.temperature >= 0:  # also refuses NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def warp(self, logits: torch.Tensor) -> torch.Tensor:
        """The exact distribution sampled from logits [..., V] under these parameters."""
        return warp_probs(logits, self.temperature, self.top_k, self.top_p)


def warp_probs(logits: torch.Tensor, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0) -> torch.Tensor:
    """Turn logits [..., V] into fp32 probabilities [..., V].

    temperature == 0 gives a one-hot on the argmax (exact greedy). Otherwise the
    logits are divided by the temperature, then restricted to the top_k most likely
    tokens (0 = off), then to the smallest set whose mass reaches top_p (1 = off).
    """
    logits = logits.float()
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        logits = logits.masked_fill(_drop_outside_nucleus(logits, top_p), float("-inf"))
    return logits.softmax(-1)


def _drop_outside_nucleus(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """True where a token of logits [..., V] falls outside the top-p nucleus.

    Sorting every 49k-token row made warp_probs take 5.2 ms a row of SmolLM2-135M's logits (T = 0.7,
    top-p 0.95) on a 2-core AVX2 EPYC, a tenth of a target step, and a speculative step warps k + 1
    target rows; the nucleus almost always lies within the NUCLEUS_CANDIDATES most likely tokens (a
    topk), so only rows whose candidates hold less than top_p of the mass are fully sorted: 0.8 ms a
    row. The same tokens are kept either way."""
    flat = logits.reshape(-1, logits.shape[-1])  # [R, V]
    V = flat.shape[-1]
    values, ids = flat.topk(min(V, NUCLEUS_CANDIDATES), dim=-1)  # [R, C], descending
    outside = _outside_nucleus((values - flat.logsumexp(-1, keepdim=True)).exp(), top_p)
    drop = torch.ones_like(flat, dtype=torch.bool).scatter_(-1, ids, outside)
    short = ~outside[:, -1]  # the last candidate is still inside: the nucleus may extend past the candidates
    if ids.shape[-1] < V and short.any():
        sorted_logits, order = flat[short].sort(dim=-1, descending=True)
        drop_sorted = _outside_nucleus(sorted_logits.softmax(-1), top_p)
        drop[short] = drop_sorted.scatter(-1, order, drop_sorted)
    return drop.reshape(logits.shape)


def _outside_nucleus(sorted_probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Descending probabilities [..., C] -> True where a token falls outside the top-p nucleus: the
    mass strictly before it already reaches top_p. The most likely token is always kept."""
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    return mass_before >= top_p


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw one token id per row of probs [..., V] -> [...] (long): `inverse_cdf` at u ~ U[0, 1).

    Why not torch.multinomial: on a 2-core CPU it took 1.0 ms for one draw over 49,152 tokens
    (0.18 ms over 8,192), 4% of a SmolLM2-135M decode step; this takes 0.09 ms (0.04 ms)
    (scripts/bench_sampler.py).
    """
    if generator is not None and generator.device != probs.device:
        probs = probs.to(generator.device)
    flat = probs.reshape(-1, probs.shape[-1])  # [R, V]
    uniforms = torch.rand(flat.shape[0], generator=generator, device=flat.device, dtype=torch.float64)
    return inverse_cdf(flat, uniforms).reshape(probs.shape[:-1])


def sample_each(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token id per row of probs [R, V], row i drawn with generators[i] -> [R] (long): the ids
    `sample(probs[i], generators[i])` gives row by row, each generator advanced as there, in one inverse CDF.

    The batched decoder and the feature rollouts draw every live row's token at once: on a 2-core AVX2 EPYC,
    16 rows' warp and draw over 49,152 tokens (T = 0.7, top-p 0.95) took 22 ms batched against 37 ms row by
    row, 121 ms against 223 ms for 64 rows (warp_probs gives each row the bits it gives that row alone)."""
    devices = {g.device for g in generators if g is not None}
    if len(devices) == 1 and (device := devices.pop()) != probs.device:
        probs = probs.to(device)  # as sample() does: the draw runs where the generator lives
    uniforms = [torch.rand(1, generator=g, device=probs.device, dtype=torch.float64) for g in generators]
    return inverse_cdf(probs, torch.cat(uniforms))


def draw_each(logits: torch.Tensor, sampling: SamplingParams, generators: list[torch.Generator | None]) -> list[int]:
    """Row i's next token from logits [R, V] under `sampling`, drawn with generators[i]; the argmax when greedy."""
    if sampling.greedy:
        return logits.argmax(-1).tolist()
    return sample_each(sampling.warp(logits), generators).tolist()


def sample_rows(logits: torch.Tensor, uniforms: torch.Tensor, sampling: SamplingParams,
                candidates: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """One token per row of logits [B, V] from `sampling.warp`'s distribution, at uniforms [B] in
    [0, 1) -> ids [B] (long). The batched entry: generate-data draws every row from its own stream.

    Inverse CDF in vocabulary order over the kept tokens, accumulated in fp64: a rounding-level
    change of the logits (another batch, another rank) then moves a draw only when the uniform
    lands within ~1e-9 of a CDF step. (Descending-probability order would not do: near-ties
    reorder under rounding noise.)
    As in warp_probs (where sorting all 49k logits per row once took 30% of a batch-128 decode step),
    only the top ROW_CANDIDATES are found (topk); a row whose candidates hold less than top_p of the
    mass searches NUCLEUS_CANDIDATES, and one still short is fully sorted. Same distribution as
    warp_probs (tests compare them). `candidates` = logits.topk(C) when the caller has it (the teacher
    top-k shares it: temperature keeps the order).
    """
    temperature, top_k, top_p = sampling.temperature, sampling.top_k, sampling.top_p
    if sampling.greedy:
        return logits.argmax(-1)
    scaled = logits.float() / temperature  # [B, V]
    V = scaled.shape[-1]
    if top_k == 0 and top_p >= 1.0:  # plain temperature sampling over every token
        return inverse_cdf(scaled.softmax(-1), uniforms)
    count = min(V, top_k if top_k > 0 else ROW_CANDIDATES)
    if candidates is None or candidates[0].shape[-1] < count:
        candidates = logits.topk(count, dim=-1)
    values, ids = candidates[0][:, :count].float() / temperature, candidates[1][:, :count]  # [B, C], descending
    # Probabilities under warp_probs: renormalised over the top-k set when top-k is on.
    log_norm = (values if top_k > 0 else scaled).logsumexp(-1, keepdim=True)
    probs = (values - log_norm).exp()  # [B, C]
    if top_p >= 1.0:
        return _inverse_cdf_by_id(probs, ids, uniforms)
    short = probs.sum(-1) < top_p  # the nucleus may extend past the candidates
    out = _inverse_cdf_by_id(_nucleus(probs, top_p), ids, uniforms)
    for width in sorted({min(V, NUCLEUS_CANDIDATES), V}):  # short rows: more candidates, then all (sorted)
        if width <= count or not short.any():
            continue
        rows = short.nonzero().squeeze(-1)
        values_wide, ids_wide = scaled[rows].topk(width, dim=-1)
        probs_wide = (values_wide - log_norm[rows]).exp()
        out[rows] = _inverse_cdf_by_id(_nucleus(probs_wide, top_p), ids_wide, uniforms[rows])
        short[rows] = probs_wide.sum(-1) < top_p
        count = width
    return out


def _nucleus(sorted_probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero the tokens outside the top-p nucleus of descending probabilities [B, C]."""
    return sorted_probs.masked_fill(_outside_nucleus(sorted_probs, top_p), 0.0)


def _inverse_cdf_by_id(weights: torch.Tensor, ids: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """weights [B, C] of token ids [B, C] -> the id `inverse_cdf` picks with the tokens in id order [B]."""
    ids_in_order, order = ids.sort(dim=-1)
    column = inverse_cdf(weights.gather(-1, order), uniforms)  # [B]
    return ids_in_order.gather(-1, column[:, None]).squeeze(-1)


def inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """weights [R, C] (unnormalised, >= 0, a positive total), uniforms [R] in [0, 1) -> column [R]:
    the first whose cumulative weight exceeds u * total. Every sampler of the project ends here.

    A zero weight adds nothing to the cumulative sum, so its column can never be the first to exceed it.
    """
    cdf = weights.double().cumsum(-1)  # [R, C]; float64 so the running sum does not drift
    total = cdf[:, -1:]
    # u * total can round up to the total itself (u just below 1), past every column. Capping it at
    # the largest double below the total picks the column where the cumulative sum reaches the
    # total (one with weight) instead, with no host synchronisation.
    threshold = torch.minimum(uniforms.to(cdf)[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, threshold, right=True).squeeze(-1)
