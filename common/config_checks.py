"""Names and value checks the config sections share (common/config*.py)."""

from __future__ import annotations

import difflib

from common.sampling import SamplingParams


DTYPE_NAMES = ("auto", "fp32", "bf16")
"""The one spelling of a dtype in every section; 'auto' resolves per machine (common/precision.py)."""
LOSS_NAMES = ("forward_kl", "reverse_kl", "jsd", "tvd", "neg_log_accept", "lk", "ce")
DATA_SPLITS = ("train", "eval")
ENGINE_NAMES = ("hf", "vllm", "llamacpp")
GGUF_QUANTS = ("f16", "q8_0")
"""The GGUF files `make export` writes of the draft and the target (distill/export/gguf.py)."""
ENGINE_DRAFTS = ("auto", "standalone", "eagle3")
"""engines.draft: which exported draft the engines run (decode/engines/exports.py)."""


def sampling_problem(key: str, name: str, value) -> str | None:
    """The sampler's own check of one value, so the config accepts exactly what sampling does."""
    try:
        SamplingParams(**{name: value})
    except (TypeError, ValueError) as e:
        return f"{key}: {e}"
    return None


def not_one_of(key: str, value: str, choices: tuple[str, ...]) -> list[str]:
    """[] when value is one of choices, else the one problem saying which are allowed."""
    if value in choices:
        return []
    return [f"{key}: {value!r} is not one of {', '.join(map(repr, choices))}{suggest(value, choices)}"]


def suggest(name: str, candidates) -> str:
    close = difflib.get_close_matches(name, list(candidates), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
