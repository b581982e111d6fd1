"""Lossless speculative decoding for Hugging Face causal LMs.

    from decode import generate, speculative_generate
    out = speculative_generate(target, draft, input_ids, k=4, max_new_tokens=64)
    out.tokens, out.stats.alpha, out.stats.tau

Runner-level loops with a pluggable proposer: decode.speculative.speculative_decode, target_decode
and decode.proposers.
"""

from decode.api import generate, speculative_generate
from decode.speculative import SpeculativeOutput
from decode.stats import SpeculativeStats

__all__ = ["generate", "speculative_generate", "SpeculativeOutput", "SpeculativeStats"]
