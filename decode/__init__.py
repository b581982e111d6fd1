"""Lossless speculative decoding for Hugging Face causal LMs.

    from decode import generate, speculative_generate
    out = speculative_generate(target, draft, input_ids, k=4, max_new_tokens=64)
    out.tokens, out.stats.alpha, out.stats.tau

Runner-level loops with a pluggable proposer: decode.speculative.speculative_decode, target_decode
and decode.proposers.
"""

import importlib

# Imported on first use (PEP 562): decode.api brings in transformers (~4 s on a 2-core CPU), which a config check
# that reads decode.tree must not wait for.
_EXPORTS = {"generate": "decode.api", "speculative_generate": "decode.api", "speculative_generate_batch": "decode.api",
            "SpeculativeOutput": "decode.speculative", "SpeculativeStats": "decode.stats"}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'decode' has no attribute {name!r}")
