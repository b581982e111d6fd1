"""Logits -> the exact distribution that is sampled. The only such place in the project.

Target-only decoding, the speculative draft, and the speculative verifier all call
`warp_probs`, so the distribution a token was sampled from is the one the
acceptance rule compares (RELIABILITY items 1-4).
"""

from __future__ import annotations

import torch


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
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Drop a token when the mass strictly before it already reaches top_p; the most
        # likely token is always kept.
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop_sorted = mass_before >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw one token id per row of probs [..., V] -> [...] (long)."""
    if generator is not None and generator.device != probs.device:
        probs = probs.to(generator.device)
    flat = probs.reshape(-1, probs.shape[-1])
    ids = torch.multinomial(flat, 1, generator=generator).squeeze(-1)
    return ids.reshape(probs.shape[:-1])
